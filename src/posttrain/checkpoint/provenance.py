"""Provenance: which code, interpreter and command produced a run, stamped on every attempt.

``collect_provenance`` returns the mapping written to ``<run dir>/provenance.<ts>.json`` (and under
the ``provenance`` key of ``config_resolved.yaml``). The identity of the code is ``tree_hash``: sha256
over the sorted ``(relative path, sha256)`` of every ``*.py`` under the installed package, which
does not depend on git (the tree on ``PYTHONPATH`` need not be the checkout whose log you read).

The stamp is best effort and bounded: the source walk and the git probes run in a separate,
isolated interpreter (``python -I`` this file ``--probe``) with an outer timeout; every probe shares
one budget (8 s by default) and each git command is also capped at 5 s. A probe that fails or runs
out of time leaves ``null`` in its field and the reason under ``errors``; ``collect_provenance``
and ``write_provenance`` never raise.

This module imports only the standard library (it runs as a script in the probe subprocess).
``python -m posttrain.checkpoint.provenance`` prints the installed tree's hash, to compare with a
run's record.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_log = logging.getLogger("posttrain.checkpoint")

POSTTRAIN_ROOT = Path(__file__).resolve().parents[1]
"""The installed ``posttrain`` package directory whose ``*.py`` files ``tree_hash`` covers."""
GIT_TIMEOUT_S = 5.0
DEFAULT_BUDGET_S = 8.0
_REPORT_MARGIN_S = 0.3  # the probe stops this long before the outer deadline so its partial report arrives


def hash_tree(root: Path) -> tuple[str, int]:
    """``(sha256 hex, file count)`` over the sorted ``(relative path, sha256 of file)`` of every
    ``*.py`` below ``root``. Each pair enters the digest as ``"<posix path>\\0<file sha256>\\n"``."""
    root = Path(root)
    entries = []
    for path in root.rglob("*.py"):
        if path.is_file():
            entries.append((path.relative_to(root).as_posix(), hashlib.sha256(path.read_bytes()).hexdigest()))
    digest = hashlib.sha256()
    for rel, file_hash in sorted(entries):
        digest.update(f"{rel}\0{file_hash}\n".encode())
    return digest.hexdigest(), len(entries)


def find_repo_root(start: Path) -> Path | None:
    """The nearest directory at or above ``start`` holding ``.git`` (a directory or a worktree file)."""
    for candidate in (start, *start.parents):
        if (candidate / ".git").exists():
            return candidate
    return None


# -- the probe subprocess -------------------------------------------------------------------------


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _bounded_git(args: list[str], timeout: float) -> str:
    """stdout of ``git ARGS``; raises with a reason on a non-zero exit or after ``timeout`` seconds.

    git runs in its own process group (killed whole on timeout, so a wrapper script's children
    die too); the group id is reported first so the parent can kill it if it kills us.
    """
    if timeout <= 0:
        raise TimeoutError("no time left in the provenance budget")
    proc = subprocess.Popen(
        ["git", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        text=True,
    )
    _emit({"pgid": proc.pid})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"git {' '.join(args)} timed out after {timeout:.1f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} exited {proc.returncode}: {err.strip()[:300]}")
    return out


def _probe(root: Path, budget_s: float) -> None:
    """Subprocess body: one JSON line per finished probe (so a timeout still yields the earlier ones)."""
    deadline = time.monotonic() + budget_s - _REPORT_MARGIN_S
    try:
        if not root.is_dir():
            raise NotADirectoryError(f"{root} is not a directory")
        tree_hash, files = hash_tree(root)
        _emit({"field": "tree_hash", "value": tree_hash})
        _emit({"field": "tree_files", "value": files})
    except OSError as exc:
        _emit({"field": "tree_hash", "error": f"reading the source tree failed: {exc}"})
    repo = find_repo_root(root)
    _emit({"field": "repo_root", "value": str(repo) if repo else None})
    if repo is None:
        for name in ("git_commit", "git_dirty"):
            _emit({"field": name, "error": f"no git checkout at or above {root}"})
        return
    probes = (("git_commit", ["rev-parse", "HEAD"]), ("git_dirty", ["status", "--porcelain"]))
    for name, args in probes:
        try:
            out = _bounded_git(["-C", str(repo), *args], min(GIT_TIMEOUT_S, deadline - time.monotonic()))
            _emit({"field": name, "value": out.strip() if name == "git_commit" else bool(out.strip())})
        except (OSError, TimeoutError, RuntimeError) as exc:
            _emit({"field": name, "error": str(exc)})


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def _run_probe(root: Path, budget_s: float) -> tuple[dict[str, Any], dict[str, str]]:
    """Start the probe, wait at most ``budget_s``, and return ``(values, errors)``."""
    values: dict[str, Any] = {}
    errors: dict[str, str] = {}
    cmd = [sys.executable, "-I", str(Path(__file__).resolve()), "--probe", str(root), f"{budget_s:.3f}"]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=max(0.0, budget_s))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        try:
            out, _ = proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            out = ""
    for record in _records(out):
        if "pgid" in record:
            if timed_out:
                _kill_group(int(record["pgid"]))
        elif "error" in record:
            errors[record["field"]] = record["error"]
        else:
            values[record["field"]] = record["value"]
    for name in ("tree_hash", "tree_files", "repo_root", "git_commit", "git_dirty"):
        if name not in values and name not in errors:
            why = (
                f"timed out: the {budget_s:.1f} s provenance budget ran out"
                if timed_out
                else f"the probe process exited {proc.returncode} without reporting it"
            )
            errors[name] = why
    return values, errors


def _records(text: str) -> Iterator[dict[str, Any]]:
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                yield record


# -- public API -----------------------------------------------------------------------------------


def _local_fields(argv: list[str], attempt_ts: str | None, errors: dict[str, str]) -> dict[str, Any]:
    """The cheap fields, read in this process (each guarded: one failure leaves one null)."""
    fields: dict[str, Any] = {
        "python_version": platform.python_version(),
        "argv": list(argv),
        "env": {k: v for k, v in sorted(os.environ.items()) if k == "PYTHONPATH" or k.startswith("POSTTRAIN_")},
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "attempt_ts": attempt_ts or time.strftime("%Y%m%d-%H%M%S"),
    }
    probes = (
        ("torch_version", lambda: importlib.metadata.version("torch")),
        ("posttrain_version", lambda: importlib.metadata.version("posttrain")),
        ("cwd", os.getcwd),
        ("hostname", socket.gethostname),
    )
    for name, probe in probes:
        try:
            fields[name] = probe()
        except Exception as exc:  # any failure of a probe is a null plus a reason, never an error
            fields[name] = None
            errors[name] = f"{type(exc).__name__}: {exc}"
    return fields


def collect_provenance(
    *,
    argv: list[str],
    budget_s: float = DEFAULT_BUDGET_S,
    attempt_ts: str | None = None,
    posttrain_root: Path | None = None,
) -> dict[str, Any]:
    """The provenance record of this attempt (fields in the module docstring); never raises and
    returns within about ``budget_s`` seconds.

    ``attempt_ts`` names the attempt (pass the run directory's name); ``posttrain_root`` overrides
    the tree that is hashed (tests).
    """
    start = time.monotonic()
    root = Path(posttrain_root) if posttrain_root is not None else POSTTRAIN_ROOT
    errors: dict[str, str] = {}
    prov: dict[str, Any] = {"tree_hash": None, "tree_files": None, "git_commit": None, "git_dirty": None}
    try:
        prov.update(_local_fields(argv, attempt_ts, errors))
        prov["posttrain_root"] = str(root)
        values, probe_errors = _run_probe(root, budget_s - (time.monotonic() - start))
        prov.update({"repo_root": None, **values})
        errors.update(probe_errors)
    except Exception as exc:  # the stamp must never be why a run fails
        errors["provenance"] = f"{type(exc).__name__}: {exc}"
    prov["collect_s"] = round(time.monotonic() - start, 3)
    prov["errors"] = errors
    return prov


def _publish_exclusive(tmp: Path, path: Path, text: str) -> bool:
    """Create ``path`` with ``text`` unless it exists (then False). A hard link is atomic (a reader
    sees the whole file or none); filesystems without hard links get an exclusive create."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        try:
            with open(path, "x", encoding="utf-8") as fh:
                fh.write(text)
            return True
        except FileExistsError:
            return False


def write_provenance(run_dir: Path, prov: dict[str, Any]) -> Path | None:
    """Write ``run_dir/provenance.<attempt_ts>.json`` without ever overwriting one: a name already
    taken gets ``-1``, ``-2``, ... appended. Returns the path, or None (with a warning) on failure."""
    try:
        stamp = str(prov.get("attempt_ts") or time.strftime("%Y%m%d-%H%M%S")).replace(os.sep, "_")
        text = json.dumps(prov, indent=1, default=str) + "\n"
        tmp = Path(run_dir) / f".provenance.{os.getpid()}.tmp"
        tmp.write_text(text, encoding="utf-8")
        try:
            for n in range(1000):
                path = Path(run_dir) / f"provenance.{stamp}{'' if n == 0 else f'-{n}'}.json"
                if _publish_exclusive(tmp, path, text):
                    return path
        finally:
            tmp.unlink(missing_ok=True)
        raise FileExistsError(f"1000 provenance files named provenance.{stamp}*.json already exist")
    except Exception as exc:  # a stamp that could not be written is a warning, not an error
        _log.warning("could not write the provenance record to %s: %s", run_dir, exc)
        return None


def main(argv: list[str] | None = None) -> int:
    """``python -m posttrain.checkpoint.provenance [ROOT]``: print ``<tree_hash>  <n> files  <root>``.

    ``--json`` prints the whole provenance record instead.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--probe"]:
        _probe(Path(args[1]), float(args[2]))
        return 0
    if args[:1] == ["--json"]:
        print(json.dumps(collect_provenance(argv=sys.argv), indent=1, default=str))
        return 0
    root = Path(args[0]) if args else POSTTRAIN_ROOT
    tree_hash, files = hash_tree(root)
    print(f"{tree_hash}  {files} files  {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
