"""GPU-only checks (``pytest -m gpu`` on the device machine; deselected everywhere else)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")


def test_default_precision_on_cuda_is_mixed_and_a_run_trains(tiny_model_dir: str, grpo_run: Callable[..., Any]) -> None:
    cfg, run_dir, records = grpo_run(tiny_model_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0 for r in records)
    assert torch.cuda.max_memory_allocated() > 0
    # fp32 master weights by default on CUDA (the compute runs on bf16 copies of them)
    from posttrain.models.precision import resolve_precision

    assert "on cuda:0 in torch.float32" in (run_dir / "train.log").read_text()
    precision = resolve_precision(cfg.model.dtype, cfg.model.compute_dtype, torch.device("cuda"))
    assert (precision.param_dtype, precision.compute_dtype) == (torch.float32, torch.bfloat16)


def _tiny_llama_on_cuda(vocab: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = LlamaConfig(vocab_size=vocab, num_key_value_heads=2, attn_implementation="sdpa", **shape)
    return LlamaForCausalLM(config).cuda()


def test_the_body_forward_of_padded_rows_makes_no_host_sync() -> None:
    # transformers' packing check reads the position ids on the host; padded rows skip it
    # (models.structure.rows_not_packed), so a micro-batch's forward queues behind the last backward
    from posttrain.models.structure import body_hidden_states, split_body_and_head

    body, _ = split_body_and_head(_tiny_llama_on_cuda(vocab=64))
    ids_RL = torch.randint(0, 64, (4, 32), device="cuda")
    body_hidden_states(body, ids_RL)  # warm-up: lazy initialisations may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hidden = body_hidden_states(body, ids_RL)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert hidden.shape == (4, 32, 64)


def _host_waits_in_one_update(rows: int, micro_batch: int) -> list[str]:
    """Where one ``train_on`` of ``rows`` completions made the host wait for the GPU (CUDA's sync
    debug mode), as ``file:line`` of the innermost posttrain frame."""
    from posttrain.config.schema import GRPOConfig
    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.train_batch import TrainBatch
    from posttrain.policy.trainer import PolicyTrainer
    from posttrain.policy.transfer import host_waits

    torch.manual_seed(0)
    model = _tiny_llama_on_cuda(vocab=128)
    cfg = GRPOConfig()
    cfg.rl.group_size, cfg.rl.batch_per_replica, cfg.rl.micro_batch_per_replica = 4, rows, micro_batch
    cfg.rl.kl_beta, cfg.model.cuda_graphs, cfg.model.fused_kernels = 0.0, False, False
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=0)
    g = torch.Generator().manual_seed(0)
    completions = [torch.randint(1, 128, (12,), generator=g).tolist() for _ in range(rows)]
    batch = TrainBatch(
        prompt_ids=[[5, 6, 7]] * rows,
        completion_ids=completions,
        advantages_B=torch.randn(rows, generator=g),
        in_loss_B=torch.ones(rows, dtype=torch.bool),
        sampler_logprobs=[[-2.0] * 12 for _ in completions],  # padded per micro-batch: once a row before
        group_size=4,
    )
    trainer.train_on(batch, step=1)  # warm-up: first-use initialisations may wait once
    sites = []
    for stack in host_waits(lambda: trainer.train_on(batch, step=2)):
        ours = [f for f in stack if "/posttrain/" in f.filename]
        sites.append(f"{ours[-1].filename.rsplit('/posttrain/', 1)[1]}:{ours[-1].lineno}" if ours else "?")
    return sites


def test_an_update_waits_for_the_gpu_a_fixed_number_of_times_not_once_a_row() -> None:
    # a micro-batch's inputs go to the GPU from pinned memory (policy/transfer.py); the waits left are
    # the optimizer step's and the metrics' own, the same at any row or micro-batch count
    base = _host_waits_in_one_update(16, 4)  # 4 micro-batches of 4 rows
    more_rows, more_micro_batches = _host_waits_in_one_update(32, 8), _host_waits_in_one_update(16, 2)
    assert len(base) == len(more_rows) == len(more_micro_batches), (base, more_rows, more_micro_batches)
    assert len(base) <= 12, base
