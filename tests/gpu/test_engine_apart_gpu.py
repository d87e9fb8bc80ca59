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

import pytest
import torch
from engine_weights import assert_samples_with, gpu_model_dir, moved, trainer_side

from posttrain.rollout.base import SamplingParams

pytestmark = pytest.mark.gpu


def test_an_engine_apart_takes_the_weights_by_the_loaders_then_by_one_copy(
    caplog: pytest.LogCaptureFixture, trainer_logprobs
) -> None:
    model_dir = gpu_model_dir()
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    side = trainer_side(model_dir, 3)
    masters = side.masters
    engine = VLLMRolloutEngine(
        model_dir, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.25, max_model_len=1024, seed=0,
        separate_process=True,
    )  # fmt: skip
    try:
        with caplog.at_level(logging.INFO, logger="posttrain.rollout"):
            engine.load_weights(masters.state_dict(), version=1)
        assert engine._shared is not None and engine._shared.last_paths == ["loaders"]
        assert "one foreach copy of" in caplog.text and "in the engine's process from now on" in caplog.text
        engine.load_weights(moved(masters).state_dict(), version=2)
        assert engine._shared.last_paths == ["plan"]
        batch = engine.generate(side.prompts, 4, SamplingParams(max_tokens=24, seed=5))
        assert batch.weight_version == 2
        assert_samples_with(batch, masters.to(torch.bfloat16), side.base, side.pad_id, trainer_logprobs)
    finally:
        engine.close()
