"""What the GPU tests of vLLM engines share: the model they run and the logprob gap allowed between
engine and trainer (``test_vllm_gpu.py`` too), and for the engines whose cores run apart from the trainer
(``test_engine_apart_gpu.py``, ``test_vllm_fleet_gpu.py``) the prompts, the trainer's side, its weights
moved off the checkpoint, and the check that an engine samples with them."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from posttrain.errors import PosttrainError
from posttrain.models.chat import render_prompt_ids
from posttrain.models.loading import resolve_model_path

MODEL = os.environ.get("POSTTRAIN_GPU_TEST_MODEL", "embedded:smollm2-135m-instruct")
# bf16 on both sides, different kernels (vLLM's FlashAttention and fused layers against transformers'
# SDPA): the sampled tokens' logprobs agree to about 1e-2 nats on average; single tokens deviate more.
MEAN_GAP_TOL = 0.1
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


@dataclass(frozen=True)
class TrainerSide:
    """The trainer's side of an engine test: prompts, the pad id, fp32 master weights and the bf16
    checkpoint weights the engine starts with."""

    prompts: list[list[int]]
    pad_id: int
    masters: torch.nn.Module
    base: torch.nn.Module


def trainer_side(model_dir: str, prompt_count: int, device: str = "cuda") -> TrainerSide:
    """``prompt_count`` sum prompts and the model of ``model_dir`` twice on ``device``: fp32 masters, bf16 base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    masters = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    return TrainerSide(sum_prompts(tokenizer, prompt_count), pad_id, masters, base)


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
