"""The data pool (``rl.data_pool.data_plane=ray_nixl_pool``) on a local Ray cluster (CPU).

Disaggregated GRPO runs (transformers replicas, weights through the object store), each a driver
subprocess that starts and stops its own cluster (``ray_runs.run_driver``):

* with score centering on, so the sampler's top-k head is pooled too, a pooled run's metrics equal
  an inline run's exactly, step for step, at the same seeds;
* over many steps of a smaller run the object store holds no step's payloads after its commit: the
  owner rank's probe (``rollout/data_pool.py``'s ``PROBE_ENV``) reads the store's live object count
  and bytes from Ray (``get_memory_info_reply``'s ``store_stats``) after each release, and they stay
  flat instead of growing by one object per completion per step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from ray_runs import REFERENCE, REFERENCE_PLACEMENT, RayRun, run_driver, run_frames

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

RUN_TIMEOUT_S = 300  # above ray_runs.RUN_TIMEOUT_S: the 40-step leak run
RAY = ["grid.backend=ray", "grid.collective_timeout_s=60", "grid.gpu_placement=disaggregated"]
POOL = "rl.data_pool.data_plane=ray_nixl_pool"
START_LINE = "rl.data_pool.data_plane=ray_nixl_pool: NIXL unavailable ("
# timings, throughput and memory differ between any two runs; every other metric must be equal
TIMING_PREFIXES = ("timer/", "perf/", "memory/")
TIMING_SUFFIXES = ("_s", "tokens_per_s", "_bytes", "_gib", "_mib")


def _deterministic(frame: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in frame.items() if not (k.startswith(TIMING_PREFIXES) or k.endswith(TIMING_SUFFIXES))}


@pytest.mark.slow
def test_pooled_run_trains_exactly_like_inline(
    ray_reference: RayRun, tiny_model_dir: str, run_overrides: Callable[..., list[str]], tmp_path: Path
) -> None:
    """The inline run is the Ray tests' shared reference (``conftest.ray_reference``: score centering
    on, weights through the object store); the pooled run is the same with the data pool on."""
    probe = tmp_path / "probe.jsonl"
    pooled = run_driver(
        run_overrides(tiny_model_dir, tmp_path, "pooled", *REFERENCE, *REFERENCE_PLACEMENT, POOL),
        {"POSTTRAIN_TEST_DATA_POOL_PROBE": str(probe)},
        timeout_s=RUN_TIMEOUT_S,
    )
    assert pooled.returncode == 0, pooled.stderr[-3000:]
    assert START_LINE in pooled.stderr and "pooling through Ray's object store" in pooled.stderr
    assert START_LINE not in ray_reference.stderr
    frames = run_frames(tmp_path, "pooled")
    assert [f["step"] for f in frames] == [1, 2, 3]
    for mine, theirs in zip(ray_reference.frames, frames, strict=True):
        assert _deterministic(theirs) == _deterministic(mine), mine["step"]
        assert mine["train/grad_norm"] > 0
    # the owner rank (0) holds its own cell's 1 prompt x 4 samples a step
    rows = [json.loads(line) for line in probe.read_text().splitlines()]
    assert [(r["version"], r["final"]) for r in rows] == [(1, False), (2, False), (3, False), (3, True)]
    assert all(r["released"] == 4 for r in rows[:-1]), rows
    assert rows[-1]["objects"] == 0, rows  # once the run closes, no payload is left in the store


@pytest.mark.slow
def test_pooled_payloads_are_freed_every_step(
    tiny_model_dir: str, run_overrides: Callable[..., list[str]], tmp_path: Path
) -> None:
    """40 steps of 4 completions: a leak would leave 160 payload objects by the end. The weights go by
    broadcasts (``nccl``, gloo on CPU), so the pool's payloads are the only objects in the store."""
    steps = 40
    small = ["grid.shapes.policy=[1,1]", "rl.batch_per_replica=4", "rl.group_size=2", "rollout.max_tokens=6"]
    overrides = run_overrides(
        tiny_model_dir, tmp_path, "leak", *RAY, "rl.weight_sync_transport=nccl", *small, POOL, f"rl.max_steps={steps}"
    )
    probe = tmp_path / "probe.jsonl"
    res = run_driver(overrides, {"POSTTRAIN_TEST_DATA_POOL_PROBE": str(probe)}, timeout_s=RUN_TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in probe.read_text().splitlines()]
    *per_step, final = rows
    assert [r["version"] for r in per_step] == list(range(1, steps + 1))
    assert all(r["released"] == 4 and not r["final"] for r in per_step), rows  # each step's 4, let go
    # Ray frees unreferenced objects in batches about once a second, so right after a release the
    # store may still hold the last second's payloads; every 10th step the probe waits for it to empty
    settled = [r for r in per_step if r["settled"]]
    assert [r["version"] for r in settled] == [10, 20, 30, 40]
    assert all(r["objects"] == 0 and r["bytes"] == 0 for r in settled), settled  # a leak: >= 10 more each
    counts = [r["objects"] for r in per_step]
    assert max(counts) < 4 * 10, counts  # never even 10 steps' worth in the store
    assert final["final"] and final["objects"] == 0 and final["bytes"] == 0, final
