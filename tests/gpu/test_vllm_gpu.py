"""The vLLM engine on a CUDA GPU, bf16: its sampling logprobs against the trainer's on the same
weights, sleep / wake around the policy update, and an in-process weight update.

Runs a vLLM engine in the test process: run it in a pytest process of its own, on the device machine
(``pytest -m gpu tests/gpu/test_vllm_gpu.py``; benchmarks/vllm_gpu.sh does). The model is the
embedded SmolLM2-135M-Instruct (``POSTTRAIN_GPU_TEST_MODEL`` names another HF directory). With
``POSTTRAIN_GPU_TEST_REPORT=path.json`` the measured gaps are written there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
import torch
from engine_weights import MEAN_GAP_TOL, gpu_model_dir

from posttrain.models.chat import render_prompt_ids
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.rollout.base import RolloutBatch, SamplingParams

pytestmark = pytest.mark.gpu

REPORT: dict[str, float] = {}
MAX_GAP_TOL = 1.0  # single tokens deviate more than the mean (engine_weights.MEAN_GAP_TOL)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return gpu_model_dir()


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Iterator[object]:
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    eng = VLLMRolloutEngine(
        model_dir,
        dtype="bfloat16",
        enforce_eager=True,  # starts in seconds instead of a minute; the logprobs are the same
        gpu_memory_utilization=0.25,
        max_model_len=1024,
        seed=0,
        enable_sleep_mode=True,
    )
    REPORT["engine_start_s"] = eng.start_s
    yield eng
    eng.close()
    if path := os.environ.get("POSTTRAIN_GPU_TEST_REPORT"):
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=1)


@pytest.fixture(scope="module")
def tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = [f"What is {a} + {b}? Reply with only the number." for a, b in [(3, 4), (12, 9), (17, 5), (8, 20)]]
    return [render_prompt_ids(tokenizer, t, use_chat_template=True) for t in texts]


def _policy(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _gaps(batch: RolloutBatch, expected: list[list[float]]) -> torch.Tensor:
    rows = zip(batch.completions, expected)
    return torch.cat([(torch.tensor(c.logprobs) - torch.tensor(ref)).abs() for c, ref in rows])


def test_engine_logprobs_match_the_trainers_in_bf16(
    engine, model_dir: str, tokenizer, prompts, trainer_logprobs
) -> None:
    model = _policy(model_dir)
    engine.load_weights(model.state_dict(), version=0)  # the trainer's bf16 tensors, as the loop sends them
    out = engine.generate(prompts, 4, SamplingParams(max_tokens=48, seed=1))
    assert len(out.completions) == 16 and all(len(c.logprobs) == len(c.token_ids) for c in out.completions)
    gaps = _gaps(out, trainer_logprobs(model, out, _pad_id(tokenizer)))
    REPORT.update(gap_mean=float(gaps.mean()), gap_max=float(gaps.max()), gap_tokens=float(gaps.numel()))
    REPORT["tokens_per_s_eager"] = out.stats["rollout/tokens_per_s"]
    assert float(gaps.mean()) < MEAN_GAP_TOL, REPORT
    assert float(gaps.max()) < MAX_GAP_TOL, REPORT


def test_sleep_frees_memory_and_an_update_moves_the_engine_logprobs(
    engine, model_dir: str, tokenizer, prompts, trainer_logprobs
) -> None:
    """generate leaves the engine asleep (KV cache released); load_weights after one AdamW step wakes
    it with the new weights: the engine reports the updated trainer's logprobs, which moved far more
    than the bf16 engine / trainer gap."""
    base = _policy(model_dir)
    model = _policy(model_dir)
    engine.load_weights(model.state_dict(), version=0)
    before = engine.generate(prompts, 4, SamplingParams(max_tokens=32, seed=2))
    assert engine.asleep and before.stats["rollout/sleep_s"] >= 0.0
    torch.cuda.synchronize()
    free_asleep = torch.cuda.mem_get_info()[0]

    pb = build_policy_batch(
        [before.prompt_token_ids[c.prompt_index] for c in before.completions],
        [c.token_ids for c in before.completions],
        pad_id=_pad_id(tokenizer),
        device="cuda",
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # large enough to survive bf16 rounding
    model.train()
    logprobs_BT = completion_logprobs(model, pb, chunk_tokens=1024)
    assert isinstance(logprobs_BT, torch.Tensor)
    (-(logprobs_BT * pb.completion_mask_BT).sum() / pb.completion_mask_BT.sum()).backward()
    optimizer.step()
    model.eval()

    engine.load_weights(model.state_dict(), version=1)
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    # a dense bf16 model on CUDA: written in place by the model's weight loaders (vllm_weight_load.py),
    # every parameter reported written (else the engine would have fallen back to vLLM's reload); the
    # first load learned the copy plan (vllm_copy_plan.py), which wrote this second one
    assert engine._writer.in_place and engine._writer.plan is not None
    REPORT.update(
        weight_load="in place (copy plan after model.load_weights)",
        sleep_s=engine.last_sleep_s,
        wake_s=engine.last_wake_s,
        weight_sync_s=engine.last_sync_s,
        freed_by_sleep_gib=(free_asleep - free_awake) / 2**30,
    )
    assert not engine.asleep and engine.weight_version == 1
    assert free_asleep - free_awake > 2**30, REPORT  # the KV cache (about 30 GiB here) was released

    after = engine.generate(prompts, 4, SamplingParams(max_tokens=32, seed=3))
    assert after.weight_version == 1
    new = trainer_logprobs(model, after, _pad_id(tokenizer))
    gaps = _gaps(after, new)
    old = trainer_logprobs(base, after, _pad_id(tokenizer))
    moved = torch.cat([(torch.tensor(n) - torch.tensor(o)).abs() for n, o in zip(new, old)])
    REPORT.update(
        gap_after_update_mean=float(gaps.mean()),
        gap_after_update_max=float(gaps.max()),
        update_shift_mean=float(moved.mean()),
    )
    assert float(gaps.mean()) < MEAN_GAP_TOL, REPORT
    assert float(moved.mean()) > 4 * float(gaps.mean()) and float(moved.mean()) > 0.05, REPORT


def test_the_copy_plan_writes_fp32_master_weights_as_vllms_loaders_do(engine, model_dir: str) -> None:
    """The trainer's fp32 master weights through the copy plan (one foreach copy, cast to the engine's
    bf16 on the way) leave vLLM's parameters bit for bit as its own weight loaders leave them."""
    from transformers import AutoModelForCausalLM

    from posttrain.rollout.vllm_weight_load import load_in_place

    masters = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().state_dict()
    # moved by 1 % of each weight: above bf16's relative step (2**-8), so most entries read back moved
    # (1e-3 absolute left the final norm's weights, near 1.75 where the step is 2**-7, all as they were)
    moved = {name: t * (1 + 1e-2 * torch.randn_like(t)) for name, t in masters.items()}
    engine.load_weights(moved, version=7)
    assert engine._writer.plan is not None and engine.weight_version == 7

    def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    by_plan = engine._llm.apply_model(snapshot)[0]
    cast = [(name, t.to(torch.bfloat16)) for name, t in moved.items()]
    assert engine._llm.apply_model(load_in_place(cast)) == [[]]
    by_loaders = engine._llm.apply_model(snapshot)[0]
    assert by_plan.keys() == by_loaders.keys()
    assert [name for name in by_plan if not torch.equal(by_plan[name], by_loaders[name])] == []
    assert not torch.equal(by_plan["model.norm.weight"], masters["model.norm.weight"].to(torch.bfloat16))


def test_call_seeding_is_refused_on_cuda(tiny_model_dir: str) -> None:
    """Per-call seeding (rollout.per_prompt_seeds=false) did not replay on vLLM 0.24's CUDA sampler
    (2026-12-01, one H200: a call replayed after a restored call counter drew other tokens), so a CUDA
    engine refuses it before it starts, by name; the default (a seed per prompt) replays."""
    from posttrain.errors import ConfigError
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    with pytest.raises(ConfigError, match=r"rollout\.per_prompt_seeds=false: per-call seeding does not replay"):
        VLLMRolloutEngine(tiny_model_dir, call_seeds=True)
