"""What the GPU tests of vLLM engines whose cores run apart from the trainer share
(``test_engine_apart_gpu.py``, ``test_vllm_fleet_gpu.py``): the model they run, its prompts, the
trainer's weights moved off the checkpoint, and the check that an engine samples with them."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from posttrain.errors import PosttrainError
from posttrain.models.chat import render_prompt_ids
from posttrain.models.loading import resolve_model_path

MODEL = os.environ.get("POSTTRAIN_GPU_TEST_MODEL", "embedded:smollm2-135m-instruct")
MEAN_GAP_TOL = 0.1  # bf16 engine against bf16 trainer, different kernels (tests/gpu/test_vllm_gpu.py)
PAIRS = [(3, 4), (12, 9), (17, 5), (8, 8), (21, 13)]


def gpu_model_dir() -> str:
    """``MODEL``'s directory, on a machine with CUDA and vLLM (fails without CUDA, skips without vLLM
    or the model)."""
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    pytest.importorskip("vllm", reason="vLLM is not installed (see docs/vllm.md)")
    try:
        return resolve_model_path(MODEL)
    except PosttrainError as err:
        pytest.skip(f"{MODEL} is not available here: {err}")


def sum_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """``count`` chat prompts asking for a sum (at most ``len(PAIRS)``)."""
    texts = [f"What is {a} + {b}? Reply with only the number." for a, b in PAIRS[:count]]
    return [render_prompt_ids(tokenizer, t, use_chat_template=True) for t in texts]


def moved(masters: torch.nn.Module) -> torch.nn.Module:
    """``masters`` with every weight moved by 1e-2 of seeded noise (in place): weights an engine
    can only sample with if a sync reached it."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in masters.parameters():
            p.add_(1e-2 * torch.randn_like(p))
    return masters


def assert_samples_with(
    batch: Any, trained: torch.nn.Module, base: torch.nn.Module, pad_id: int, trainer_logprobs: Callable[..., Any]
) -> None:
    """The engine's sampler logprobs of ``batch`` are the ``trained`` weights' (mean gap under
    ``MEAN_GAP_TOL``), and far closer to them than the ``base`` weights' are."""
    engine_lp = torch.cat([torch.tensor(c.logprobs) for c in batch.completions])
    new = torch.tensor([lp for row in trainer_logprobs(trained, batch, pad_id) for lp in row])
    old = torch.tensor([lp for row in trainer_logprobs(base, batch, pad_id) for lp in row])
    gaps, shift = (engine_lp - new).abs(), (new - old).abs()
    assert float(gaps.mean()) < MEAN_GAP_TOL, (float(gaps.mean()), float(shift.mean()))
    assert float(shift.mean()) > 4 * float(gaps.mean()), (float(gaps.mean()), float(shift.mean()))
