"""Saves that did not finish: why a save failed, in words, and the ``.tmp-`` directories killed saves
leave behind.

**Why.** The libraries that write the payload lose the operating system's reason: ``torch.save``
raises ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534`` on a
full disk and under a file-size limit alike, safetensors a ``SafetensorError`` with the errno in its
text. ``failure_reason`` recovers it ("no space left on device", "file too large", "read-only file
system"): from an ``OSError`` in the exception chain, from the ``os error N`` or strerror text in
the message, and otherwise by probing the checkpoint directory's file system (read-only flag, free
space against what the save needed) and the process's ``RLIMIT_FSIZE``. It must run before the
failed save's ``.tmp-`` directory is removed (that frees the space).

**Leftovers.** A save killed mid-write (SIGKILL, a node lost) leaves ``iter_<step>.tmp-<pid>/``,
which is never resumed from but holds a checkpoint's worth of bytes. ``remove_unfinished_saves``
deletes those of a job's attempts at the start of a run, naming each; one whose pid is a live
process on this host (another run of the same job still saving) is left alone.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from posttrain.checkpoint.layout import TMP_RE

_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a path component is a file, not a directory",
    errno.EEXIST: "a file is in the way where a directory must go",
    errno.ENAMETOOLONG: "file name too long",
    errno.EIO: "input/output error",
}
_TEXT = [
    (re.compile(r"no space left|storagefull", re.IGNORECASE), errno.ENOSPC),
    (re.compile(r"quota", re.IGNORECASE), errno.EDQUOT),
    (re.compile(r"file too large|filetoolarge", re.IGNORECASE), errno.EFBIG),
    (re.compile(r"read-only file system|readonlyfilesystem", re.IGNORECASE), errno.EROFS),
    (re.compile(r"permission denied", re.IGNORECASE), errno.EACCES),
]
_OS_ERROR_RE = re.compile(r"os error (\d+)")
_LOW_SPACE = 64 << 20  # below this, a write that failed without a reason is taken as out of space

IO_FAILURES: tuple[type[BaseException], ...] = (OSError, RuntimeError)
"""Exceptions a failing write raises (torch.save's is a RuntimeError); safetensors' is added below."""
try:
    from safetensors import SafetensorError

    IO_FAILURES = (*IO_FAILURES, SafetensorError)
except ImportError:  # pragma: no cover - safetensors ships with transformers
    pass


def root_failure(exc: BaseException) -> BaseException:
    """The error that stopped a save: for ``torch.distributed.checkpoint``'s ``CheckpointException``
    (a ``BaseException`` carrying ``{rank: (error, traceback)}``) the lowest rank's own error, which
    is what a reason can be read from; ``exc`` itself otherwise."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) and first else first
        if isinstance(inner, BaseException):
            return inner
    return exc


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _errno_in(exc: BaseException) -> int | None:
    for item in _chain(exc):
        if isinstance(item, OSError) and item.errno:
            return item.errno
    for item in _chain(exc):
        text = str(item)
        match = _OS_ERROR_RE.search(text)
        if match:
            return int(match.group(1))
        for pattern, code in _TEXT:
            if pattern.search(text):
                return code
    return None


def _fsize_limit() -> int | None:
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _probe(root: Path, needed_bytes: int) -> int | None:
    """The likely errno of a write under ``root`` that failed without saying why."""
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    free = st.f_bavail * st.f_frsize
    if free < _LOW_SPACE or free < needed_bytes:
        return errno.ENOSPC
    limit = _fsize_limit()
    if limit is not None and (needed_bytes == 0 or needed_bytes > limit):
        return errno.EFBIG
    return None


def failure_reason(exc: BaseException, root: Path, *, needed_bytes: int = 0) -> str:
    """The operating system's reason for a failed write under ``root``, in words (with the detail that
    helps: the free space, the file-size limit); a generic phrase when none can be found."""
    code = _errno_in(exc)
    if code is None:
        code = _probe(root, needed_bytes)
    if code is None:
        return "the write failed"
    reason = _REASONS.get(code) or os.strerror(code)
    if code == errno.ENOSPC:
        try:
            st = os.statvfs(root)
            reason += f" ({st.f_bavail * st.f_frsize} bytes free on the file system of {root})"
        except OSError:
            pass
    limit = _fsize_limit()
    if code == errno.EFBIG and limit is not None:
        reason += f" (this process may write files of at most {limit} bytes: RLIMIT_FSIZE, `ulimit -f`)"
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        reason += f" ({root} cannot be written)"
    return reason


def payload_bytes(obj: object) -> int:
    """Bytes of every tensor in a (nested) state dict: about what a save of it writes."""
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int) and hasattr(obj, "shape"):
        return nbytes
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process has not saved yet: a same-pid directory is a dead run's (containers reuse pids)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # exists but belongs to someone else (or is not a pid at all)
    return True


def remove_unfinished_saves(job_dir: Path) -> list[str]:
    """Delete the ``iter_*.tmp-<pid>`` directories under every attempt of ``job_dir``
    (``<attempt>/checkpoints/``) whose process is gone; one log line per directory found."""
    lines: list[str] = []
    job_dir = Path(job_dir)
    if not job_dir.is_dir():
        return lines
    for ckpts in sorted(p / "checkpoints" for p in job_dir.iterdir() if (p / "checkpoints").is_dir()):
        for tmp in sorted(p for p in ckpts.iterdir() if TMP_RE.match(p.name)):
            pid = int(tmp.name.rsplit("-", 1)[1])
            if _pid_alive(pid):
                lines.append(f"leaving {tmp} alone: an unfinished save of process {pid}, which is still running")
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            state = "removed" if not tmp.exists() else "could not remove"
            lines.append(f"{state} {tmp}: an unfinished save left by a process that was stopped mid-save")
    return lines
