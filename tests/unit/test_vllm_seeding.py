"""Which seeding scheme a vLLM engine uses (``posttrain.rollout.vllm_seeding``), what the per-call
scheme does to the process's generators, and how a resume treats a change of scheme. No vLLM needed."""

from __future__ import annotations

import pytest
import torch

from posttrain.checkpoint import CheckpointError, TrainingState
from posttrain.config.loading import build_config
from posttrain.loop.resume import check_resume_compatible, resume_identity
from posttrain.rollout.vllm_seeding import call_seed, engine_seeding, generators_seeded, wants_call_seeds

CALL = "rollout.per_prompt_seeds=false"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["rollout.backend=vllm"], False),  # the default: a seed per prompt
        (["rollout.backend=vllm", CALL], True),
        (["rollout.backend=hf", CALL], False),  # the transformers engine has its own per-call generator
        (["rollout.backend=vllm", CALL, "rollout.seed=null"], False),  # nothing seeded at all
        (["rollout.backend=vllm", CALL, "rollout.separate_engine_process=true"], False),
        (["rollout.backend=vllm", CALL, "rollout.tensor_parallel_size=2"], False),
        (["rollout.backend=vllm", CALL, "rl.max_off_policy_steps=1", "rl.use_rollout_logprobs_for_loss=true"], False),
    ],
)
def test_call_seeds_only_where_the_sampler_draws_from_this_process_alone(overrides: list[str], expected: bool) -> None:
    assert wants_call_seeds(build_config(None, overrides)) is expected


def test_engine_falls_back_to_prompt_seeds_when_vllm_samples_elsewhere() -> None:
    assert engine_seeding(True, separate_process=False, vllm_workers=1) == "call"
    assert engine_seeding(True, separate_process=True, vllm_workers=1) == "prompt"
    assert engine_seeding(True, separate_process=False, vllm_workers=2) == "prompt"
    assert engine_seeding(False, separate_process=False, vllm_workers=1) == "prompt"


def test_call_seed_is_a_63_bit_function_of_seed_and_call() -> None:
    seeds = {call_seed(s, k) for s in range(4) for k in range(50)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)
    assert call_seed(3, 7) == call_seed(3, 7)


def test_generators_seeded_draws_from_the_seed_and_leaves_the_callers_stream_alone() -> None:
    torch.manual_seed(123)
    expected_after = torch.rand(4)  # what the caller's stream yields next, untouched
    torch.manual_seed(123)
    with generators_seeded(99, None):
        inside = torch.rand(3)
        torch.randint(0, 2**31, (8,))  # vLLM's CPU sampler draws row seeds like this
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(99)))
    assert torch.equal(torch.rand(4), expected_after)


def test_generators_seeded_restores_even_when_sampling_fails() -> None:
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom"), generators_seeded(5, None):
        torch.rand(2)
        raise RuntimeError("boom")
    assert torch.equal(torch.get_rng_state(), state)


def _state(identity: dict) -> TrainingState:
    return TrainingState(
        step=2,
        optimizer_step=2,
        zero_grad_skips_total=0,
        data_state={"index": 8},
        engine_state={"generate_calls": 2},
        rng={},
        identity=identity,
    )


def test_resume_identity_pins_call_seeding_and_a_prompt_seeded_checkpoint_is_refused_with_the_way_back() -> None:
    call = build_config(None, ["rollout.backend=vllm", CALL])
    prompt = build_config(None, ["rollout.backend=vllm"])
    hf = build_config(None, [])
    assert resume_identity(call)["rollout.vllm_seeding"] == "call"
    assert "rollout.vllm_seeding" not in resume_identity(prompt)  # as vLLM runs were before call seeding
    assert "rollout.vllm_seeding" not in resume_identity(hf)  # the default job's identity is unchanged
    with pytest.raises(CheckpointError, match=r"rollout.vllm_seeding changed: None -> 'call' .*per_prompt_seeds=true"):
        check_resume_compatible(_state(resume_identity(prompt)), resume_identity(call), n_mini=1)
    check_resume_compatible(_state(resume_identity(prompt)), resume_identity(prompt), n_mini=1)
