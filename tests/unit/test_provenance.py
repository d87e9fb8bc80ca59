"""Provenance: the tree hash, the record's fields, bounded probes, never-overwritten files."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.checkpoint.provenance import POSTTRAIN_ROOT, collect_provenance, hash_tree, write_provenance

FIELDS = {
    "tree_hash", "tree_files", "git_commit", "git_dirty", "python_version", "torch_version", "argv", "cwd",
    "env", "hostname", "slurm_job_id", "timestamp", "attempt_ts", "repo_root", "posttrain_root", "errors",
}  # fmt: skip


def reference_tree_hash(root: Path) -> str:
    """Written independently from the spec: sha256 over sorted (relative path, file sha256) pairs."""
    pairs = sorted(
        (str(p.relative_to(root)).replace(os.sep, "/"), hashlib.sha256(p.read_bytes()).hexdigest())
        for p in root.rglob("*.py")
    )
    return hashlib.sha256("".join(f"{rel}\0{h}\n" for rel, h in pairs).encode()).hexdigest()


def make_tree(root: Path) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("x = 1\n")
    (root / "pkg" / "sub" / "mod.py").write_text("y = 2\n")
    (root / "pkg" / "data.txt").write_text("not python\n")
    return root / "pkg"


def fake_git(bin_dir: Path, body: str) -> None:
    """A real executable named ``git`` that the probe finds first on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    git = bin_dir / "git"
    git.write_text(f"#!/bin/sh\n{body}\n")
    git.chmod(git.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def test_hash_tree_is_stable_and_follows_content(tmp_path: Path) -> None:
    pkg = make_tree(tmp_path)
    first = hash_tree(pkg)
    assert first == (reference_tree_hash(pkg), 2)
    assert hash_tree(pkg) == first
    (pkg / "data.txt").write_text("changed, but not a .py file\n")
    assert hash_tree(pkg) == first
    (pkg / "sub" / "mod.py").write_text("y = 3\n")
    assert hash_tree(pkg)[0] != first[0]
    (pkg / "sub" / "mod.py").write_text("y = 2\n")
    (pkg / "sub" / "mod.py").rename(pkg / "sub" / "other.py")  # same bytes, new name: a different tree
    assert hash_tree(pkg)[0] != first[0]


def test_record_has_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTTRAIN_OUTPUT_ROOT", "/tmp/out")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    prov = collect_provenance(argv=["posttrain", "grpo", "--config", "r.py"], attempt_ts="20260101-000000")
    assert set(prov) >= FIELDS
    assert (prov["tree_hash"], prov["tree_files"]) == hash_tree(POSTTRAIN_ROOT)
    assert prov["posttrain_root"] == str(POSTTRAIN_ROOT)
    assert prov["argv"] == ["posttrain", "grpo", "--config", "r.py"]
    assert prov["env"]["POSTTRAIN_OUTPUT_ROOT"] == "/tmp/out" and prov["slurm_job_id"] == "4242"
    assert prov["attempt_ts"] == "20260101-000000" and prov["cwd"] == os.getcwd()
    assert prov["python_version"] == ".".join(map(str, sys.version_info[:3]))
    import torch

    assert prov["torch_version"] == torch.__version__
    for name in ("git_commit", "git_dirty"):  # either an answer or a reason, never silently empty
        assert (prov[name] is not None) != (name in prov["errors"])


def test_one_line_command_prints_the_installed_hash() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "posttrain.checkpoint.provenance"], capture_output=True, text=True, check=True
    ).stdout
    assert out.split()[0] == hash_tree(POSTTRAIN_ROOT)[0]


def test_hung_git_does_not_block_past_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = make_tree(tmp_path / "repo")
    (tmp_path / "repo" / ".git").mkdir()
    pids = tmp_path / "pids"
    fake_git(tmp_path / "bin", f"echo $$ >> {pids}\nsleep 30")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    start = time.monotonic()
    prov = collect_provenance(argv=[], budget_s=1.5, posttrain_root=pkg)
    elapsed = time.monotonic() - start
    assert elapsed < 2.5, elapsed
    assert prov["git_commit"] is None and "timed out" in prov["errors"]["git_commit"]
    assert prov["git_dirty"] is None and "git_dirty" in prov["errors"]
    assert prov["tree_hash"] == reference_tree_hash(pkg) and prov["repo_root"] == str(tmp_path / "repo")
    time.sleep(0.2)
    for pid in pids.read_text().split():  # the sleeping fake git was killed, not left behind
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "State:\tZ" in status.read_text()


def test_failing_git_leaves_null_and_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = make_tree(tmp_path / "repo")
    (tmp_path / "repo" / ".git").mkdir()
    fake_git(tmp_path / "bin", 'echo "fatal: broken checkout" >&2\nexit 3')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    prov = collect_provenance(argv=[], posttrain_root=pkg)
    assert prov["git_commit"] is None
    assert prov["errors"]["git_commit"] == f"git -C {tmp_path / 'repo'} rev-parse HEAD exited 3: fatal: broken checkout"
    assert prov["tree_hash"] == reference_tree_hash(pkg)


def test_no_checkout_and_no_budget(tmp_path: Path) -> None:
    pkg = make_tree(tmp_path)
    prov = collect_provenance(argv=[], posttrain_root=pkg)
    if prov["repo_root"] is None:  # tmp dirs normally live outside any checkout
        assert "no git checkout" in prov["errors"]["git_commit"]
    prov = collect_provenance(argv=[], budget_s=0.0, posttrain_root=pkg)
    assert prov["tree_hash"] is None and "budget" in prov["errors"]["tree_hash"]


def test_write_provenance_never_overwrites(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    paths = [write_provenance(tmp_path, {"attempt_ts": "20260101-000000", "n": i}) for i in range(3)]
    assert [p.name for p in paths if p] == [
        "provenance.20260101-000000.json",
        "provenance.20260101-000000-1.json",
        "provenance.20260101-000000-2.json",
    ]
    assert [json.loads(p.read_text())["n"] for p in paths if p] == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths if p)  # no temp files
    with caplog.at_level(logging.WARNING, logger="posttrain.checkpoint"):
        assert write_provenance(tmp_path / "missing" / "dir", {"attempt_ts": "x"}) is None
    assert "could not write the provenance record" in caplog.text
