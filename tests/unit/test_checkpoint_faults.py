"""Checkpoint saves that fail on the file system, and what killed saves leave behind (issue 15).

A full disk, a read-only checkpoint directory or a file-size limit used to surface as a raw
``RuntimeError: [enforce fail at inline_container.cc]`` or ``SafetensorError``; now each is a
``CheckpointError`` naming the path, the operating system's reason and the newest checkpoint that
survives, and the failed save's ``.tmp-`` directory is gone. Sync and async saves alike.

How the faults are made for real (tests run as root, so ``chmod`` would not stop a write):

* file-size limit: ``resource.setrlimit(RLIMIT_FSIZE)`` in a subprocess (Python ignores SIGXFSZ, so
  the write fails with EFBIG instead of killing the process);
* full disk and read-only directory: a small tmpfs mounted in a private user + mount namespace
  (``unshare -rm``), and a read-only bind mount of it for the second case; skipped where the kernel
  refuses unprivileged namespaces;
* a file where the checkpoint directory must go, in process.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from posttrain.checkpoint import CheckpointError, CheckpointWriter, TrainingState, find_latest_complete
from posttrain.checkpoint.failed_saves import remove_unfinished_saves
from posttrain.checkpoint.layout import iter_name, read_latest_pointer
from posttrain.checkpoint.reader import describe_fresh_start, resolve_resume

SCRIPT = textwrap.dedent(
    """
    import json, os, resource, subprocess, sys
    from pathlib import Path
    import torch
    from torch import nn
    from posttrain.checkpoint import CheckpointError, CheckpointWriter, TrainingState

    root = Path(sys.argv[1])
    torch.manual_seed(0)
    model = nn.Linear(256, 256)  # 257 KiB of weights, 514 KiB of Adam moments
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 256)).sum().backward()
    opt.step()

    def state(step):
        return TrainingState(step, step, 0, {}, {}, {}, {})

    def save(step, case, async_save=False, where=root):
        writer = CheckpointWriter(where, async_save=async_save)
        out = {"case": case}
        try:
            writer.save(step, model, opt, None, state(step))
            writer.wait()
            out["saved"] = True
        except CheckpointError as exc:
            out["error"] = str(exc)
        except BaseException as exc:
            out["raw"] = f"{type(exc).__name__}: {exc}"
        out["listing"] = sorted(p.name for p in where.iterdir()) if where.is_dir() else None
        print(json.dumps(out), flush=True)

    def fsize(limit):
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    save(1, "first")
    for case in sys.argv[2:]:
        kind, _, arg = case.partition(":")
        if kind == "fsize":
            fsize(int(arg))
            save(2, case)
            save(2, case + ":async", async_save=True)
            fsize(resource.RLIM_INFINITY)
        elif kind == "full":
            save(2, case)
            save(2, case + ":async", async_save=True)
        elif kind == "readonly":  # a read-only bind mount of the same directory
            view = Path(arg)
            view.mkdir()
            subprocess.run(["mount", "--bind", str(root.parent), str(view)], check=True)
            subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True)
            save(2, case, where=view / root.name)
    """
)


def _run(root: Path, *cases: str, mount_kib: int | None = None) -> dict[str, dict[str, Any]]:
    command = [sys.executable, "-c", SCRIPT, str(root), *cases]
    if mount_kib is not None:
        if shutil.which("unshare") is None:
            pytest.skip("needs unshare(1) for a private tmpfs")
        mount = f"mount -t tmpfs -o size={mount_kib}k tmpfs {root.parent}"
        command = ["unshare", "-rm", "sh", "-c", f'{mount} && exec "$0" "$@"', *command]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if mount_kib is not None and out.returncode != 0 and "mount" in out.stderr and "{" not in out.stdout:
        pytest.skip(f"no private tmpfs here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in results}


def _assert_named_failure(result: dict[str, Any], root: Path, reason: str) -> None:
    assert "raw" not in result, result
    message = result.get("error", "")
    assert message, result
    assert str(root / iter_name(2)) in message, message
    assert reason in message, message
    assert f"the earlier checkpoints are intact: the newest complete one is {root / iter_name(1)}" in message
    if "read-only" not in reason:  # a read-only directory refuses the .tmp- directory itself
        assert f"the unfinished {iter_name(2)}.tmp-" in message and "was removed" in message
    # The failed save left nothing behind: only the first checkpoint and its pointer.
    assert result["listing"] == [iter_name(1), "latest_checkpoint.txt"], result


def test_a_file_size_limit_is_named_for_sync_and_async_saves(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    # 100 kB: the safetensors model file fails (SafetensorError); 400 kB: the model fits and torch.save
    # of the optimizer fails with a bare "unexpected pos" RuntimeError.
    results = _run(root, "fsize:100000", "fsize:400000")
    assert results["first"].get("saved"), results
    for case in ("fsize:100000", "fsize:100000:async", "fsize:400000", "fsize:400000:async"):
        _assert_named_failure(results[case], root, "file too large")
        assert "(this process may write files of at most" in results[case]["error"]
        assert "RLIMIT_FSIZE, `ulimit -f`" in results[case]["error"]
    assert "the background save of step 2" in results["fsize:400000:async"]["error"]
    assert "inline_container" in results["fsize:400000"]["error"]  # the library's own words, kept after ours


def test_a_full_disk_and_a_read_only_directory_are_named(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    root, view = mnt / "ckpts", tmp_path / "ro_view"
    # One checkpoint is about 790 KiB: the first fits in 1200 KiB, a second does not.
    results = _run(root, "full", f"readonly:{view}", mount_kib=1200)
    assert results["first"].get("saved"), results
    for case in ("full", "full:async"):
        _assert_named_failure(results[case], root, "no space left on device")
    _assert_named_failure(results[f"readonly:{view}"], view / "ckpts", "read-only file system")


def test_a_file_where_the_checkpoint_directory_must_go(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    root.write_text("not a directory")
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError) as info:
        CheckpointWriter(root).save(1, model, opt, None, TrainingState(1, 1, 0, {}, {}, {}, {}))
    message = str(info.value)
    assert message.startswith(f"cannot save the checkpoint of step 1 to {root / iter_name(1)}: a file is in the way")
    assert f"{root} holds no earlier complete checkpoint" in message


# ---------------------------------------------------------------- leftovers of killed saves


def _save(root: Path, step: int) -> Path:
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointWriter(root) as writer:
        return writer.save(step, model, opt, None, TrainingState(step, step, 0, {}, {}, {}, {}))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has this pid now (until it is reused)


def test_leftover_tmp_dirs_of_killed_saves_are_named_and_removed(tmp_path: Path) -> None:
    job = tmp_path / "proj" / "grpo" / "name"
    older, newer = job / "20260101-100000" / "checkpoints", job / "20260101-110000" / "checkpoints"
    good = _save(older, 2)
    dead = older / f"{iter_name(4)}.tmp-{_dead_pid()}"
    shutil.copytree(good, dead)
    own = newer / f"{iter_name(6)}.tmp-{os.getpid()}"  # a restarted container reuses the dead run's pid
    own.mkdir(parents=True)
    alive = newer / f"{iter_name(8)}.tmp-1"  # pid 1 always runs: a save still in flight
    alive.mkdir()
    lines = remove_unfinished_saves(job)
    assert lines == [
        f"removed {dead}: an unfinished save left by a process that was stopped mid-save",
        f"removed {own}: an unfinished save left by a process that was stopped mid-save",
        f"leaving {alive} alone: an unfinished save of process 1, which is still running",
    ]
    assert not dead.exists() and not own.exists() and alive.exists() and good.exists()
    assert remove_unfinished_saves(tmp_path / "nope") == []


def test_a_fresh_start_over_corrupt_checkpoints_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    job = tmp_path / "job"
    assert describe_fresh_start([]) == "rl.resume=auto: no complete checkpoint of this job yet, starting fresh"
    first = _save(job / "a1" / "checkpoints", 1)
    second = _save(job / "a2" / "checkpoints", 2)
    (first / "manifest.json").unlink()
    with open(second / "optimizer.pt", "ab") as fh:
        fh.write(b"x")
    skipped: list[tuple[Path, str]] = []
    with caplog.at_level(logging.WARNING, logger="posttrain.checkpoint"):
        assert resolve_resume("auto", job, skipped=skipped) is None
    assert [p for p, _ in skipped] == [second, first]
    message = describe_fresh_start(skipped)
    assert message.startswith("rl.resume=auto: no resumable checkpoint of this job: 2 corrupt or incomplete ")
    assert re.search(rf"{re.escape(str(second))} \(optimizer\.pt: \d+ bytes, the manifest says \d+\); ", message)
    assert f"{first} (manifest.json: no manifest.json (the save did not finish))" in message
    assert message.endswith("Starting fresh")
    assert find_latest_complete(job / "a2" / "checkpoints") is None
    assert read_latest_pointer(job / "a2" / "checkpoints") == second  # the pointer alone is not trusted


def test_restore_cleans_up_and_reports_corrupt_checkpoints(tmp_path: Path) -> None:
    # restore() before any model work: rl.resume=auto over a job whose one checkpoint is corrupt and
    # whose killed save left a .tmp- directory. It touches only the config and the log.
    from posttrain.config.loading import build_config
    from posttrain.loop.collect import Roles
    from posttrain.loop.run import Run, restore
    from posttrain.loop.run_dir import job_dir
    from posttrain.metrics.sinks import MetricsLogger
    from posttrain.rewards.registry import get_reward

    cfg = build_config(None, [f"job.output_root={tmp_path}", "rl.resume=auto"])
    ckpts = job_dir(cfg) / "20260101-100000" / "checkpoints"
    broken = _save(ckpts, 3)
    (broken / "model.safetensors").unlink()
    leftover = ckpts / f"{iter_name(5)}.tmp-{_dead_pid()}"
    leftover.mkdir()
    run_dir = job_dir(cfg) / "20260101-110000"
    run_dir.mkdir()
    roles = Roles(data=None, engine=None, reward=get_reward("arithmetic"), tokenizer=None)  # type: ignore[arg-type]
    with MetricsLogger(run_dir, console=False) as log:
        run = Run(cfg, run_dir, log, roles, trainer=None, identity={}, tokenizer=None)  # type: ignore[arg-type]
        assert restore(run) == 0
    text = (run_dir / "train.log").read_text()
    assert f"removed {leftover}: an unfinished save" in text and not leftover.exists()
    assert f"1 corrupt or incomplete checkpoint(s) found and skipped: {broken} (model.safetensors: missing)" in text
    assert "no complete checkpoint of this job yet" not in text
