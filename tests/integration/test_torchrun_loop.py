"""The GRPO and OPD loops under ``torchrun --nproc-per-node 2`` (gloo, CPU): two FSDP2 policy ranks,
one data cell and one colocated rollout engine each, rank 0 writing the run directory.

What is compared, and why not against one process: every rank samples only its own cell's groups
with its own seeded stream (``rollout.seed + cell``), and the transformers engine's random numbers
depend on the batch it decodes, so a 2-rank run draws different completions from a 1-rank run of the
same config and their metrics cannot match. That the UPDATE on a given batch is the same on 2 ranks
as on one is proven in ``test_fsdp_equivalence.py`` (gradients within 1e-5). Here: the run completes,
``metrics.jsonl`` is written once with every step, loss and gradient norm are finite, the weights
moved, and a resume of the 2-rank run from its step-2 checkpoint reproduces step 3 of the
uninterrupted run exactly (CPU, gloo: deterministic), for the consolidated (gathered to rank 0)
and the DCP (sharded) checkpoint formats. The same runs upload their checkpoints (``rl.upload``, to
a local directory: rank 0 alone, each once, complete) and the resume downloads its checkpoint from
that archive after the local job directory is gone. A rank that fails stops the whole launch with
its error.

Every launch is bounded (``LAUNCH_TIMEOUT_S``) and every collective times out
(``grid.collective_timeout_s``).
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rank_runs import run_two_ranks
from upload_checks import check_uploads

LAUNCH_TIMEOUT_S = 120
TWO_RANKS = ["grid.shapes.policy=[1,2]", "grid.collective_timeout_s=60"]


def _torchrun(module: str, args: list[str], extra_path: str = "") -> subprocess.CompletedProcess[str]:
    return run_two_ranks(module, args, timeout_s=LAUNCH_TIMEOUT_S, extra_path=extra_path)


def _frames(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _only_run_dir(root: Path, job: str) -> Path:
    dirs = [d for d in (root / "posttrain" / "grpo" / job).iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs  # rank 1 created no directory of its own
    return dirs[0]


@pytest.mark.parametrize("fmt", ["consolidated", pytest.param("dcp", marks=pytest.mark.slow)])
def test_grpo_two_ranks_trains_uploads_and_resumes_exactly_from_the_archive(
    tiny_model_dir: str, run_overrides: Callable[..., list[str]], tmp_path: Path, fmt: str
) -> None:
    """Two ranks with ``rl.upload`` to a local directory: rank 0 alone uploads each checkpoint once it
    is published, retention (``rl.keep_model_last=1``) prunes the step-2 weights locally only after
    their upload, and after the machine is lost (the job directory goes) and the step-3 copy with it,
    ``rl.resume=auto`` downloads step 2 from the archive and repeats step 3 exactly."""
    import shutil

    from safetensors.torch import load_file

    from posttrain.checkpoint.manifest import read_manifest

    archive = tmp_path / "archive"
    upload = ["rl.upload.enabled=true", f"rl.upload.destination={archive}", "rl.keep_model_last=1"]
    overrides = run_overrides(
        tiny_model_dir, tmp_path / "a", "two", *TWO_RANKS, "rl.max_steps=3", f"rl.checkpoint_format={fmt}", *upload
    )
    res = _torchrun("posttrain.entrypoints.grpo", ["--", *overrides, "rl.save_every=2"])
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = _only_run_dir(tmp_path / "a", "two")
    frames = _frames(run_dir)
    assert [f["step"] for f in frames] == [1, 2, 3]
    for f in frames:
        assert math.isfinite(f["train/loss_avg"]) and f["train/grad_norm"] > 0, f
        assert f["optim/step"] == f["step"]
    assert res.stdout.count("step 3/3") == 1  # one console: rank 0's
    if fmt == "consolidated":  # the gathered weights moved away from the initial ones
        initial = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
        final = load_file(str(run_dir / "checkpoints" / "iter_000000003" / "model.safetensors"))
        assert any(not (final[k] == initial[k]).all() for k in initial if k in final)
    check_uploads(res.stdout + res.stderr, run_dir, archive, (2, 3))
    assert "model" in read_manifest(run_dir / "checkpoints" / "iter_000000002").get("pruned", {})

    shutil.rmtree(run_dir.parent)  # the machine is lost; step 3's copy never made it to the archive
    shutil.rmtree(archive / "posttrain" / "grpo" / "two" / run_dir.name / "checkpoints" / "iter_000000003")
    resumed = _torchrun("posttrain.entrypoints.grpo", ["--", *overrides, "rl.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count(f"rl.resume=auto: downloaded iter_000000002 of attempt {run_dir.name}") == 1
    (again_dir,) = [d for d in run_dir.parent.iterdir() if d.is_dir() and d.name != run_dir.name]
    again = _frames(again_dir)
    assert [f["step"] for f in again] == [1, 2, 3]  # history downloaded with the checkpoint, then step 3 again
    for key in ("train/loss_avg", "train/grad_norm", "train/reward_mean", "train/response_len_mean"):
        assert again[2][key] == pytest.approx(frames[2][key], rel=1e-6, abs=1e-9), key


@pytest.mark.slow
def test_opd_two_ranks(tiny_model_dir: str, tmp_path: Path) -> None:
    overrides = [
        f"model.name_or_path={tiny_model_dir}",
        f"rl.teacher.name_or_path={tiny_model_dir}",
        f"job.output_root={tmp_path}",
        "job.name=opd2",
        "rl.data.arithmetic_max=5",
        "rl.max_steps=2",
        "rl.batch_per_replica=16",
        "rl.group_size=4",
        "rollout.max_tokens=8",
        "rl.teacher.top_k=4",
        *TWO_RANKS,
    ]
    res = _torchrun("posttrain.entrypoints.opd", ["--config", "opd_direct", "--", *overrides])
    assert res.returncode == 0, res.stderr[-3000:]
    (run_dir,) = (tmp_path / "posttrain" / "opd" / "opd2").iterdir()
    frames = _frames(run_dir)
    assert [f["step"] for f in frames] == [1, 2]
    for f in frames:  # each rank's teacher scored its own cell: 8 sequences each, summed
        assert f["train/opd_teacher_scored_sequences"] == 16
        assert f["train/opd_teacher_score_success_count"] == 2
        assert math.isfinite(f["train/loss_avg"])


FAILING_REWARD = """
import os


def reward(sample):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("reward exploded on rank 1")
    return float(len(sample.completion))
"""


def test_a_failing_rank_stops_the_launch(
    tiny_model_dir: str, run_overrides: Callable[..., list[str]], tmp_path: Path
) -> None:
    (tmp_path / "rank_fail.py").write_text(FAILING_REWARD)
    overrides = run_overrides(tiny_model_dir, tmp_path, "fail", *TWO_RANKS, "rl.max_steps=2")
    started = time.monotonic()
    res = _torchrun("posttrain.entrypoints.grpo", ["--", *overrides, "rl.reward=rank_fail:reward"], str(tmp_path))
    assert res.returncode != 0
    assert "reward exploded on rank 1" in res.stderr, res.stderr[-3000:]
    assert time.monotonic() - started < 90  # torchrun tears the surviving rank down; no collective timeout
