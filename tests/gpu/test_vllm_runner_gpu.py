"""``rollout.vllm_model_runner=auto`` on a CUDA GPU: a Qwen2 policy (an architecture vLLM 0.24 leaves on its V1
model runner) gets vLLM's V2 runner, and on it the engine does what posttrain relies on: the sampler's
logprobs match the trainer's, a seeded call replays after the call counter is restored, and received
weights move the engine's logprobs.

Runs a vLLM engine in the test process, which fixes vLLM's runner for the whole process: run this file in
a pytest process of its own on the device machine (``pytest -m gpu tests/gpu/test_vllm_runner_gpu.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from posttrain.models.tiny import make_tiny_model
from posttrain.rollout.base import RolloutBatch, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    pytest.importorskip("vllm", reason="vLLM is not installed (see docs/vllm.md)")
    out = tmp_path_factory.mktemp("tiny_qwen2")
    # head size 64 (FlashAttention's sizes start at 32), biased q/k/v projections as in Qwen2.5
    return make_tiny_model(
        str(out), smollm2_tokenizer_dir, family="qwen2", hidden_size=128, num_heads=2, num_kv_heads=1,
        intermediate_size=256, num_layers=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(qwen2_dir: str) -> Iterator[object]:
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # auto decides, not an inherited variable
    eng = VLLMRolloutEngine(
        qwen2_dir, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=512, seed=0
    )
    yield eng
    eng.close()


def _policy(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()


def _prompts(engine) -> list[list[int]]:
    return [engine.tokenizer(t)["input_ids"] for t in ("What is 2 + 3?", "Name a colour.", "Count to five:")]


def _mean_gap(batch: RolloutBatch, expected: list[list[float]]) -> float:
    rows = zip(batch.completions, expected)
    return float(torch.cat([(torch.tensor(c.logprobs) - torch.tensor(ref)).abs() for c, ref in rows]).mean())


def test_auto_runs_a_qwen2_policy_on_vllms_v2_runner(engine) -> None:
    assert engine.model_runner == "v2"
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_sampler_logprobs_match_the_trainers_and_follow_received_weights(
    engine, qwen2_dir: str, trainer_logprobs
) -> None:
    model = _policy(qwen2_dir)
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else engine.eos_ids[0]
    engine.load_weights(model.state_dict(), version=0)
    out = engine.generate(_prompts(engine), 4, SamplingParams(max_tokens=32, seed=1))
    assert len(out.completions) == 12
    assert _mean_gap(out, trainer_logprobs(model, out, pad)) < 0.1  # bf16 on both sides, other kernels
    with torch.no_grad():  # new weights: the engine must sample from them, not from its start-up copy
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.load_weights(model.state_dict(), version=1)
    moved = engine.generate(_prompts(engine), 4, SamplingParams(max_tokens=32, seed=1))
    assert _mean_gap(moved, trainer_logprobs(model, moved, pad)) < 0.1


def test_a_seeded_call_replays_after_restoring_the_call_counter(engine) -> None:
    params = SamplingParams(max_tokens=24, seed=7)
    state = engine.state_dict()
    first = engine.generate(_prompts(engine), 4, params)
    engine.generate(_prompts(engine), 4, params)  # another call between: its own draws
    torch.randn(1000, device="cuda")  # and other draws on the device's generator
    engine.load_state_dict(state)
    again = engine.generate(_prompts(engine), 4, params)
    assert [c.token_ids for c in again.completions] == [c.token_ids for c in first.completions]
    assert len({tuple(c.token_ids) for c in first.completions}) > 1  # sampled, not one greedy answer
