"""Asynchronous checkpoints of CUDA-resident state (``pytest -m gpu`` on the device machine).

On the CPU the staged copy and the live state share a device; here ``async_save``'s staging copies
GPU tensors to host memory (the consolidated writer's copy does the same), the next step then
overwrites the weights on the GPU while the upload runs, and the resume must still be bit-exact.
Ran on one H200 on 2026-12-01 (torch 2.11.0+cu130, transformers 5.17.0), with the smoke test: 3
passed (benchmarks/gpu_tests.md). The CPU versions of these checks are
tests/unit/test_checkpoint_library.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.checkpoint import CheckpointWriter, TrainingState, load_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")


def _trio(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _step(trio: tuple, seed: int) -> None:
    model, opt, sched = trio
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(seed)).cuda()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


@pytest.mark.parametrize("fmt", ["dcp", "consolidated"])
def test_async_save_of_cuda_state_resumes_bitwise(tmp_path: Path, fmt: str) -> None:
    ref = _trio(0)
    _step(ref, 0)
    expected = {k: v.detach().clone() for k, v in ref[0].state_dict().items()}
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in ref[1].state_dict()["state"].items()}
    writer = CheckpointWriter(tmp_path, fmt=fmt, async_save=True)  # type: ignore[arg-type]
    path = writer.save(1, *ref, TrainingState(1, 1, 0, {}, {}, {}, {}))
    _step(ref, 1)  # overwrites weights and moments on the GPU while the upload runs
    assert writer.wait() == path
    resumed = _trio(5)
    load_checkpoint(path, *resumed)
    for name, value in resumed[0].state_dict().items():
        assert value.is_cuda and torch.equal(value, expected[name]), name
    for index, per_param in resumed[1].state_dict()["state"].items():
        for key, value in per_param.items():
            assert torch.equal(value.to(moments[index][key].device), moments[index][key]), (index, key)
