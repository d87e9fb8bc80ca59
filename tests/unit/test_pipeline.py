"""The rollout schedules: on-policy calls in order; one step off-policy samples batch k+1 while
batch k trains, never lets the weights change under a rollout in flight, and surfaces its errors."""

from __future__ import annotations

import threading
import time

import pytest

from posttrain.loop.pipeline import OneStepOffPolicy, OnPolicy, batch_source
from posttrain.metrics.timers import StepTimer


class Recorder:
    def __init__(self, fail_at: int | None = None) -> None:
        self.calls = 0
        self.events: list[str] = []
        self.fail_at = fail_at
        self.lock = threading.Lock()

    def __call__(self, timer: StepTimer) -> tuple[int, dict[str, float]]:
        with self.lock:
            self.calls += 1
            k = self.calls
        if k == self.fail_at:
            raise RuntimeError(f"rollout {k} failed")
        with timer.phase("rollout"):
            self.events.append(f"start {k}")
            time.sleep(0.05)
            self.events.append(f"end {k}")
        return k, {"train/reward_mean": float(k)}


def test_on_policy_samples_in_the_callers_thread() -> None:
    rec = Recorder()
    source = batch_source(0, rec)
    assert isinstance(source, OnPolicy)
    assert [source.next(StepTimer())[0] for _ in range(3)] == [1, 2, 3]
    assert rec.calls == 3


def test_off_policy_prefetches_the_next_batch_and_settles_before_a_weight_change() -> None:
    rec = Recorder()
    source = batch_source(1, rec)
    assert isinstance(source, OneStepOffPolicy)
    timer = StepTimer()
    batch, metrics = source.next(timer)
    assert batch == 1 and metrics["train/off_policy_steps"] == 1.0 and metrics["timer/rollout_overlapped_s"] > 0
    time.sleep(0.01)
    assert "start 2" in rec.events  # batch 2 is sampled while batch 1 trains
    source.settle()
    assert rec.events[-1] == "end 2"  # nothing in flight when the weights are published
    batch, _ = source.next(timer)
    assert batch == 2
    time.sleep(0.01)  # let batch 3 start: close() must then wait for it instead of abandoning it
    source.close()
    assert rec.calls == 3 and rec.events[-1] == "end 3"  # the batch in flight finished before closing


def test_off_policy_surfaces_a_failed_rollout() -> None:
    source = batch_source(1, Recorder(fail_at=2))
    source.next(StepTimer())
    source.settle()
    with pytest.raises(RuntimeError, match="rollout 2 failed"):
        source.next(StepTimer())
    source.close()
