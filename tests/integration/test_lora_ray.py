"""LoRA under the Ray backend: a disaggregated transformers replica receives the adapter alone
(``rollout/replica_lora.py``) and the run equals the same run under ``grid.backend=local``
(torchrun), with uploads (``rl.upload``, to a local directory) on both sides.

One story, two launches (2 policy ranks each, gloo on CPU, LoRA rank 4, lr 1e-2):

1. torchrun, colocated: 3 steps, a checkpoint and its upload after each, ``rl.keep_model_last=1``.
2. The machine is lost after step 1's upload (the job directory and the archive's later copies go).
   Ray, disaggregated (1 replica, ``rl.weight_sync_transport=nccl``: gloo broadcasts on CPU),
   ``rl.resume=auto``: downloads step 1 from the archive and trains steps 2 and 3, sampling on the
   replica after each adapter sync.

Steps 2 and 3 under Ray equal the local run's to rel 1e-6 (the tolerance of the other Ray-vs-colocated
tests; uninterrupted runs compared by hand were bit-identical). A replica left on the base weights
(its adapter load disabled, by hand) sampled step 2 with a reward of 0.410 instead of 0.426 and a
logprob gap of 0.11, so the equality checks the sync. Both launches upload each checkpoint once, completely, and
mark it ``.uploaded`` before retention prunes it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from rank_runs import run_two_ranks
from ray_runs import RUN_TIMEOUT_S, run_driver
from upload_checks import check_uploads

pytest.importorskip("ray")
pytest.importorskip("peft", reason="peft is not installed (pip install 'posttrain[lora]')")
pytestmark = pytest.mark.ray

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "rl.optimizer.lr=1e-2"]
TWO = ["grid.shapes.policy=[1,2]", "grid.collective_timeout_s=60"]
RAY = ["grid.backend=ray", "grid.gpu_placement=disaggregated", "rl.weight_sync_transport=nccl"]
ADAPTER_TENSORS = 28  # the tiny model's 2 layers x 7 linear layers x (lora_A, lora_B)


def _frames(run_dir: Path) -> list[dict[str, float]]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_lora_under_ray_syncs_the_adapter_alone_equals_local_and_resumes_from_the_archive(
    tiny_model_dir: str, run_overrides: Callable[..., list[str]], tmp_path: Path
) -> None:
    from posttrain.checkpoint.manifest import read_manifest

    archive = tmp_path / "archive"
    upload = ["rl.upload.enabled=true", f"rl.upload.destination={archive}", "rl.upload.required=true"]
    keep = ["rl.save_every=1", "rl.keep_model_last=1"]
    overrides = run_overrides(tiny_model_dir, tmp_path / "out", "lora", *LORA, *TWO, "rl.max_steps=3", *keep, *upload)
    local = run_two_ranks("posttrain.entrypoints.grpo", ["--", *overrides], timeout_s=RUN_TIMEOUT_S)
    assert local.returncode == 0, local.stderr[-3000:]
    job = tmp_path / "out" / "posttrain" / "grpo" / "lora"
    (first,) = job.iterdir()
    frames = _frames(first)
    assert [f["step"] for f in frames] == [1, 2, 3]
    check_uploads(local.stdout + local.stderr, first, archive, (1, 2, 3))
    for step in (1, 2):  # pruned locally only once uploaded (.uploaded checked above); whole in the archive
        assert "model" in read_manifest(first / "checkpoints" / f"iter_{step:09d}").get("pruned", {})

    shutil.rmtree(job)
    for step in (2, 3):
        shutil.rmtree(archive / "posttrain" / "grpo" / "lora" / first.name / "checkpoints" / f"iter_{step:09d}")
    # RAY_DEDUP_LOGS=0: every actor's lines as printed (Ray would fold repeated ones into one)
    ray = run_driver([*overrides, *RAY, "rl.resume=auto"], {"RAY_DEDUP_LOGS": "0"})
    assert ray.returncode == 0, ray.stderr[-3000:]
    out = ray.stdout + ray.stderr
    assert out.count(f"rl.resume=auto: downloaded iter_000000001 of attempt {first.name}") == 1
    (again_dir,) = [d for d in job.iterdir() if d.is_dir() and d.name != first.name]
    again = _frames(again_dir)
    assert [f["step"] for f in again] == [1, 2, 3]
    for mine, theirs in zip(frames[1:], again[1:]):
        for key in ("train/reward_mean", "train/loss_avg", "train/grad_norm", "train/response_len_mean"):
            assert theirs[key] == pytest.approx(mine[key], rel=1e-6, abs=1e-9), (mine["step"], key)
        assert theirs["train/logprob_gap_max"] < 1e-4, theirs  # the replica sampled with the trained adapter
    # only the adapter crossed: the replica's first version (the resumed one) held the 28 adapter tensors
    assert out.count(f"rollout replica: weight version 1 is the LoRA adapter alone: {ADAPTER_TENSORS} tensors") == 1
    check_uploads(out, again_dir, archive, (2, 3))
    assert "model" in read_manifest(again_dir / "checkpoints" / "iter_000000002").get("pruned", {})
