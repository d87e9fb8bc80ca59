"""``rollout.engines_per_device`` without vLLM: how a call's prompts are split between the engines,
and the preflight's rules for the knob (the fleet itself runs in tests/integration/test_vllm_fleet.py)."""

from __future__ import annotations

import pytest

from posttrain.config.loading import build_config
from posttrain.errors import ConfigError
from posttrain.preflight.grpo import grpo_preflight
from posttrain.rollout.vllm_fleet import split_prompts
from posttrain.rollout.vllm_seeding import wants_call_seeds

FLEET = ["rollout.backend=vllm", "rollout.separate_engine_process=true", "rollout.engines_per_device=2"]


@pytest.mark.parametrize(
    ("count", "parts", "sizes"),
    [(32, 2, [16, 16]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]), (1, 2, [1, 0]), (0, 2, [0, 0]), (3, 4, [1, 1, 1, 0])],
)
def test_prompts_split_into_contiguous_runs_of_near_equal_size(count: int, parts: int, sizes: list[int]) -> None:
    runs = split_prompts(count, parts)
    assert [len(r) for r in runs] == sizes
    assert [i for r in runs for i in r] == list(range(count))  # every prompt once, in order


def test_split_prompts_needs_a_part() -> None:
    with pytest.raises(ValueError, match="parts must be >= 1"):
        split_prompts(4, 0)


def _fleet_errors(*overrides: str) -> list[str]:
    errors = grpo_preflight(build_config(None, [*FLEET, *overrides])).errors
    return [e for e in errors if "rollout.engines_per_device" in e]


def test_a_colocated_text_fleet_passes() -> None:
    assert _fleet_errors() == []
    findings = grpo_preflight(build_config(None, FLEET))
    # the engine processes are the point: no warning that a separate process only adds traffic
    assert not any("inter-process" in w for w in findings.warnings)
    assert not wants_call_seeds(build_config(None, FLEET))  # each prompt seeded: the draws do not depend on N


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["rollout.backend=hf"], "needs rollout.backend=vllm (got hf)"),
        (["rollout.separate_engine_process=false"], "set rollout.separate_engine_process=true"),
        (
            ["grid.backend=ray", "grid.gpu_placement=disaggregated", "rl.weight_sync_transport=object_store"],
            "with grid.gpu_placement=disaggregated add rollout replicas instead",
        ),
        (["rollout.tensor_parallel_size=2", "grid.shapes.rollout=[1,2]"], "needs rollout.tensor_parallel_size=1"),
        (["model.lora.rank=4"], "does not serve LoRA adapters yet"),
    ],
)
def test_what_a_fleet_cannot_do_is_named(overrides: list[str], needle: str) -> None:
    errors = _fleet_errors(*overrides)
    assert any(needle in e for e in errors), errors


def test_routing_replay_is_refused() -> None:
    errors = _fleet_errors("rl.routing_replay=rollout")
    assert any("does not return routed experts yet" in e for e in errors), errors


@pytest.mark.parametrize("value", ["0", "9"])
def test_the_count_is_bounded(value: str) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.engines_per_device"):
        build_config(None, [f"rollout.engines_per_device={value}"])
