"""``rollout.engines_per_device`` without vLLM: how a call's prompts are split between the engines,
when the engines' weights are written at once, and the preflight's rules for the knob (the fleet
itself runs in tests/integration/test_vllm_fleet.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from posttrain.config.loading import build_config
from posttrain.errors import ConfigError
from posttrain.preflight.grpo import grpo_preflight
from posttrain.rollout.vllm_fleet import VLLMEngineFleet, split_prompts
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


class _Member:
    """A stand-in fleet member that records how many members write at the same time (which path a
    real member's worker takes needs CUDA: on vLLM's CPU build every write is a reload, so the fleet's
    at-once branch cannot be reached there; tests/integration/test_vllm_fleet.py runs real members)."""

    weight_dtype = torch.bfloat16
    logprobs_mode = seeding = model_runner = "stand-in"

    def __init__(
        self, by_plan: bool, log: dict[str, int], lock: threading.Lock, meet: threading.Barrier | None
    ) -> None:
        self.writes_by_copy_plan, self.log, self.lock, self.meet = by_plan, log, lock, meet

    def holds(self, version: int) -> bool:
        return False

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        with self.lock:
            self.log["active"] += 1
            self.log["most"] = max(self.log["most"], self.log["active"])
        if self.meet is not None:  # expected at once: each waits for the other (a write in turn breaks it)
            self.meet.wait()
        else:
            time.sleep(0.1)  # long enough for the other member's write to begin if they ran at once
        with self.lock:
            self.log["active"] -= 1

    def close(self) -> None:
        pass


class _Weights:
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {"w": torch.ones(2)}


@pytest.mark.parametrize(("by_plan", "most"), [([True, True], 2), ([True, False], 1), ([False, False], 1)])
def test_members_are_written_at_once_only_when_each_write_is_one_copy(by_plan: list[bool], most: int) -> None:
    """A first sync (vLLM's weight loaders) into two engine processes at once took 3.7 s each on an H100,
    0.17-0.24 s one after the other: the fleet writes members at once only when every one goes by its
    copy plan."""
    log, lock = {"active": 0, "most": 0}, threading.Lock()
    meet = threading.Barrier(len(by_plan), timeout=10) if most > 1 else None
    members = iter(_Member(flag, log, lock, meet) for flag in by_plan)
    fleet = VLLMEngineFleet(lambda _share: next(members), len(by_plan), 0.5)  # type: ignore[arg-type,return-value]
    try:
        fleet.receive_weights(_Weights(), version=1)  # type: ignore[arg-type]
    finally:
        fleet.close()
    assert log["most"] == most and fleet.weight_version == 1
