"""The ``nixl`` weight-sync transport in a real disaggregated run on a local Ray cluster (CPU): 2
policy-rank actors and 1 rollout replica, the owner writing packed buckets into the replica's
registered host buffer over NIXL's UCX backend, against the same run with the weights through the
object store.

Both runs sample the same per-rank streams on the same weights, so their metrics are equal step for
step only if every update reached the replica whole: a sync that missed would change the rewards
from step 2 on. Small buckets (``rl.weight_sync_bucket_bytes``) make each sync many writes, and the
probe is on (the default). Each run is a driver subprocess that starts and stops its own cluster.
Skipped where NIXL cannot run (the reason names what is missing).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from ray_runs import DISAGGREGATED_PLACEMENT, REFERENCE, RayRun, run_driver, run_frames

from posttrain.distributed.nixl_sync import missing_library

pytest.importorskip("ray")
pytestmark = pytest.mark.ray
MISSING = missing_library()

NIXL = ["rl.weight_sync_transport=nixl", "rl.weight_sync_bucket_bytes=65536"]


@pytest.mark.slow
@pytest.mark.skipif(MISSING is not None, reason=f"NIXL cannot run here: {MISSING}")
def test_a_nixl_run_trains_the_same_as_the_object_store(
    ray_reference: RayRun, tiny_model_dir: str, run_overrides: Callable[..., list[str]], tmp_path: Path
) -> None:
    """The object-store run is the shared reference (``conftest.ray_reference``)."""
    res = run_driver(run_overrides(tiny_model_dir, tmp_path, "nixl", *REFERENCE, DISAGGREGATED_PLACEMENT, *NIXL))
    assert res.returncode == 0, res.stderr[-3000:]
    for role in ("owner", "replica"):  # both ends made NIXL agents (NIXL's own log line, forwarded by Ray)
        assert f"Initialized NIXL agent: posttrain-{role}-" in res.stdout, res.stdout[-3000:]
    frames = run_frames(tmp_path, "nixl")
    assert [f["step"] for f in frames] == [1, 2, 3]
    assert all(f["train/grad_norm"] > 0 and f["optim/step"] == f["step"] for f in frames)
    for mine, theirs in zip(ray_reference.frames, frames, strict=True):
        for key in ("train/reward_mean", "train/loss_avg", "train/grad_norm"):
            assert theirs[key] == mine[key], (mine["step"], key)
