"""The vLLM engine with its engine core in a process of its own (``rollout.separate_engine_process``)
on a CUDA GPU, bf16: the trainer's fp32 master weights reach its worker through the mapped buffer,
by the model's weight loaders at the first sync (which teaches the worker a copy plan) and by one
foreach copy from the second on (``ViewSync``, rollout/vllm_shared_weights.py); the engine then
samples with exactly those weights.

A file of its own because vLLM decides where an engine core runs once per process (docs/vllm.md):
run it in a pytest process of its own on the device machine (``benchmarks/side_by_side.sh tests``).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from posttrain.errors import PosttrainError
from posttrain.models.chat import render_prompt_ids
from posttrain.models.loading import resolve_model_path
from posttrain.rollout.base import SamplingParams

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("POSTTRAIN_GPU_TEST_MODEL", "embedded:smollm2-135m-instruct")
MEAN_GAP_TOL = 0.1  # bf16 engine against bf16 trainer, different kernels (tests/gpu/test_vllm_gpu.py)


def test_an_engine_apart_takes_the_weights_by_the_loaders_then_by_one_copy(
    caplog: pytest.LogCaptureFixture, trainer_logprobs
) -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    pytest.importorskip("vllm", reason="vLLM is not installed (see docs/vllm.md)")
    try:
        model_dir = resolve_model_path(MODEL)
    except PosttrainError as err:
        pytest.skip(f"{MODEL} is not available here: {err}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    texts = [f"What is {a} + {b}? Reply with only the number." for a, b in [(3, 4), (12, 9), (17, 5)]]
    prompts = [render_prompt_ids(tokenizer, t, use_chat_template=True) for t in texts]
    masters = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    engine = VLLMRolloutEngine(
        model_dir, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.25, max_model_len=1024, seed=0,
        separate_process=True,
    )  # fmt: skip
    try:
        with caplog.at_level(logging.INFO, logger="posttrain.rollout"):
            engine.load_weights(masters.state_dict(), version=1)
        assert engine._shared is not None and engine._shared.last_paths == ["loaders"]
        assert "one foreach copy of" in caplog.text and "in the engine's process from now on" in caplog.text
        torch.manual_seed(0)
        with torch.no_grad():
            for p in masters.parameters():
                p.add_(1e-2 * torch.randn_like(p))
        engine.load_weights(masters.state_dict(), version=2)
        assert engine._shared.last_paths == ["plan"]
        batch = engine.generate(prompts, 4, SamplingParams(max_tokens=24, seed=5))
        assert batch.weight_version == 2
        engine_lp = torch.cat([torch.tensor(c.logprobs) for c in batch.completions])
        trained = masters.to(torch.bfloat16)
        new = torch.tensor([lp for row in trainer_logprobs(trained, batch, pad_id) for lp in row])
        old = torch.tensor([lp for row in trainer_logprobs(base, batch, pad_id) for lp in row])
        gaps, moved = (engine_lp - new).abs(), (new - old).abs()
        assert float(gaps.mean()) < MEAN_GAP_TOL, (float(gaps.mean()), float(moved.mean()))
        assert float(moved.mean()) > 4 * float(gaps.mean()), (float(gaps.mean()), float(moved.mean()))
    finally:
        engine.close()
