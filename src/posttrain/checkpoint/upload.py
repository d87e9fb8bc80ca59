"""Uploads (``rl.upload``): completed checkpoints copied to an archive destination in the background,
and a resume that starts from the archive when the local copy is gone.

**Order.** The writer calls ``Uploads.on_published`` once a checkpoint is complete and published
(manifest written last, directory renamed into place, pointer rewritten), before retention. One
background thread then copies it, file by file, to
``<destination>/<project>/<group>/<name>/<attempt>/checkpoints/iter_*/``: an older copy's
``manifest.json`` there is removed first, the remote sizes are checked against the manifest, and
the manifest goes last, so a copy that stopped half way has no manifest and is never taken for a
checkpoint. Then ``.uploaded`` (destination, bytes, seconds) is written in the local checkpoint.

**Retention** (``writer.apply_retention(require_uploaded=True)``) never touches a checkpoint
without ``.uploaded``: an upload in flight reads its files, and one that failed is the only copy.

**Failures.** Each upload is tried ``1 + rl.upload.retries`` times with doubling waits. One that
still fails is logged as an error; the checkpoint stays local, whole, and is tried again when the
next checkpoint is queued. With ``rl.upload.required=true`` ``Uploads.check`` (every step
boundary, on every rank: rank 0's verdict is broadcast) raises ``UploadError`` instead.

**Resume.** ``fetch_from_destination``: with ``rl.resume=auto`` the archive's newest checkpoint of
the job, when newer than the newest local one (by attempt, then step), is downloaded into the same
``<attempt>/checkpoints/iter_*`` path of the job directory (through a ``.tmp-`` directory, manifest
last, every file checked per ``rl.checkpoint_verify``) with the attempt's ``metrics.jsonl``; the
resume then goes on as from a local checkpoint.

Nothing here imports torch or fsspec at import time (the preflight imports this module; the
collectives of ``posttrain.distributed`` are imported where they are used).
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from posttrain.checkpoint import CheckpointError
from posttrain.checkpoint.layout import ITER_RE, STATE_NAME, iter_name
from posttrain.checkpoint.manifest import MANIFEST_NAME, fsync_dir, read_manifest, verify_files, write_json_atomic

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.config.upload import UploadConfig

UPLOADED_NAME = ".uploaded"
"""The marker of a checkpoint whose copy at the destination is complete (its JSON says where)."""
METRICS_NAME = "metrics.jsonl"
_PROGRESS_EVERY_S = 10.0

Say = Callable[[str], None]


class UploadError(CheckpointError):
    """A checkpoint could not be copied to ``rl.upload.destination`` (or the destination is unusable)."""


# -- the destination -------------------------------------------------------------------------------


def open_destination(destination: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """``(filesystem, root path)`` of an fsspec URL or a local path; ``UploadError`` naming what to
    install for a protocol whose package is missing, or what is wrong with the options."""
    import fsspec.core

    try:
        return fsspec.core.url_to_fs(destination, **storage_options)
    except ImportError as exc:
        protocol = fsspec.core.split_protocol(destination)[0]
        package = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
        hint = package.get(str(protocol), "")
        install = f"pip install {hint}" + (" (or posttrain[upload])" if hint == "s3fs" else "") if hint else str(exc)
        raise UploadError(
            f"rl.upload.destination={destination!r}: the {protocol}:// protocol needs a package that is not "
            f"installed ({exc}): {install}"
        ) from None
    except ValueError as exc:  # "Protocol not known"
        raise UploadError(f"rl.upload.destination={destination!r}: {exc}; use a path or an fsspec URL") from None
    except TypeError as exc:  # a storage option the filesystem does not take
        raise UploadError(f"rl.upload.storage_options={storage_options!r} do not fit {destination!r}: {exc}") from None


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def job_key(cfg: RunConfig) -> str:
    """The job's path below the destination: ``<project>/<group>/<name>`` (as below the output root)."""
    return posixpath.join(cfg.job.project, cfg.job.group, cfg.job.name)


def probe_destination(destination: str, storage_options: dict[str, Any], key: str) -> str | None:
    """Why the destination cannot take uploads (a small object written below ``key`` and removed
    again), else None. Never creates a bucket: a missing one is reported."""
    try:
        fs, root = open_destination(destination, storage_options)
    except UploadError as exc:
        return str(exc)
    probe = posixpath.join(root, key, f".posttrain-upload-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        if _is_local(fs):
            fs.makedirs(posixpath.dirname(probe), exist_ok=True)
        fs.pipe_file(probe, b"posttrain upload probe\n")
        fs.rm_file(probe)
    except Exception as exc:  # any backend's error: unreachable, no such bucket, denied, read-only
        return (
            f"rl.upload.destination={destination!r} is not writable from here: writing {probe} failed "
            f"({type(exc).__name__}: {exc}); check the URL, rl.upload.storage_options and the credentials"
        )
    return None


# -- one upload ------------------------------------------------------------------------------------


def upload_checkpoint(fs: Any, local: Path, remote: str, progress: Callable[[int], None] | None = None) -> int:
    """Copy the complete checkpoint ``local`` to ``remote`` (a path of ``fs``), manifest last; returns
    the bytes sent. Only the files its manifest lists are sent (never ``.uploaded``)."""
    manifest_bytes = (local / MANIFEST_NAME).read_bytes()
    files = read_manifest(local)["files"]
    remote_manifest = posixpath.join(remote, MANIFEST_NAME)
    fs.invalidate_cache(remote)
    if fs.exists(remote_manifest):  # an older copy of this step: incomplete until the new manifest lands
        fs.rm_file(remote_manifest)
    sent = 0
    for rel in sorted(files):
        target = posixpath.join(remote, rel)
        if _is_local(fs):
            fs.makedirs(posixpath.dirname(target), exist_ok=True)
        fs.put_file(str(local / rel), target)
        sent += int(files[rel]["size"])
        if progress is not None:
            progress(sent)
    fs.invalidate_cache(remote)
    found = {str(p): info for p, info in fs.find(remote, detail=True).items()}
    prefix = fs._strip_protocol(remote).rstrip("/") + "/"
    sizes = {p.removeprefix(prefix): int(info.get("size") or 0) for p, info in found.items()}
    wrong = [
        f"{rel} ({sizes.get(rel)} bytes, not {e['size']})" for rel, e in files.items() if sizes.get(rel) != e["size"]
    ]
    if wrong:
        raise UploadError(f"the copy at {remote} does not match the manifest: {', '.join(sorted(wrong)[:5])}")
    fs.pipe_file(remote_manifest, manifest_bytes)
    return sent


class Uploader:
    """One background thread that uploads queued checkpoints in order, with retries (rank 0 only)."""

    def __init__(self, cfg: UploadConfig, remote_run: str, url_run: str, say: Say) -> None:
        """``remote_run``: the attempt's path at the destination (``.../<attempt>``); ``url_run``: the same
        as an URL, for the log and the ``.uploaded`` marker."""
        self.cfg = cfg
        self.remote_run = remote_run
        self.url_run = url_run
        self.say = say
        self._cond = threading.Condition()
        self._queue: deque[Path] = deque()
        self._failed: dict[Path, str] = {}
        self._active: Path | None = None
        self._active_sent = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fs: Any = None

    def url(self, ckpt: Path) -> str:
        """Where ``ckpt`` goes, as an URL."""
        return f"{self.url_run}/checkpoints/{ckpt.name}"

    def submit(self, ckpt: Path) -> None:
        """Queue ``ckpt`` (published: its manifest is written), after the failed ones still on disk."""
        with self._cond:
            for old in list(self._failed):
                if old.is_dir() and old not in self._queue and old != ckpt:
                    self._queue.append(old)
            if ckpt not in self._queue:
                self._queue.append(ckpt)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="checkpoint-upload", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def failures(self) -> dict[Path, str]:
        """Checkpoints whose last upload failed, with the error."""
        with self._cond:
            return dict(self._failed)

    def pending(self) -> list[Path]:
        """Checkpoints queued or being uploaded."""
        with self._cond:
            return ([self._active] if self._active is not None else []) + list(self._queue)

    def _work(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._cond.wait()
                if self._stop.is_set():
                    return
                self._active, self._active_sent = self._queue.popleft(), 0
            ckpt = self._active
            try:
                error = self._upload_with_retries(ckpt)
            except BaseException as exc:  # never leave the item active: the end of the run waits on it
                error = f"{type(exc).__name__}: {exc}"
            with self._cond:
                if error is None:
                    self._failed.pop(ckpt, None)
                else:
                    self._failed[ckpt] = error
                self._active = None
                self._cond.notify_all()

    def _upload_with_retries(self, ckpt: Path) -> str | None:
        attempts = 1 + self.cfg.retries
        error = ""
        for attempt in range(1, attempts + 1):
            t0 = time.perf_counter()
            try:
                if self._fs is None:
                    self._fs = open_destination(str(self.cfg.destination), self.cfg.storage_options)[0]
                remote = posixpath.join(self.remote_run, "checkpoints", ckpt.name)
                sent = upload_checkpoint(self._fs, ckpt, remote, self._progress)
                seconds = time.perf_counter() - t0
                marker = {"destination": self.url(ckpt), "bytes": sent, "seconds": round(seconds, 3)}
                write_json_atomic(ckpt / UPLOADED_NAME, {**marker, "time": time.time()})
            except Exception as exc:  # any backend's error is retried; the last one is reported
                error = f"{type(exc).__name__}: {exc}"
                if attempt < attempts and not self._stop.is_set():
                    delay = self.cfg.retry_backoff_s * 2 ** (attempt - 1)
                    self.say(
                        f"warning: upload of {ckpt} to {self.url(ckpt)} failed (attempt {attempt} of {attempts}): "
                        f"{error}; retrying in {delay:g}s"
                    )
                    if self._stop.wait(delay):
                        break
                continue
            self._send_history(ckpt.parent.parent / METRICS_NAME)
            self.say(f"upload: {ckpt.name} -> {self.url(ckpt)} ({sent / 2**20:.1f} MiB in {seconds:.1f}s)")
            return None
        self.say(
            f"error: upload of {ckpt} to {self.url(ckpt)} FAILED after {attempts} attempt(s): {error}. The "
            "checkpoint is intact locally without .uploaded (retention keeps it); it is tried again with the "
            "next checkpoint"
        )
        return error

    def _send_history(self, history: Path) -> None:
        """The attempt's ``metrics.jsonl`` beside its checkpoints, so that a resume from the archive
        starts its own file with the run's history (best effort: a failure only warns)."""
        if not history.is_file():
            return
        try:
            self._fs.put_file(str(history), posixpath.join(self.remote_run, METRICS_NAME))
        except Exception as exc:
            self.say(f"warning: could not upload {history} to {self.url_run}: {type(exc).__name__}: {exc}")

    def mark_failed(self, ckpts: list[Path], why: str) -> None:
        """Record ``ckpts`` as failed with ``why`` (uploads the end of the run gave up waiting for)."""
        with self._cond:
            for ckpt in ckpts:
                self._failed.setdefault(ckpt, why)

    def _progress(self, sent: int) -> None:
        with self._cond:
            self._active_sent = sent

    def drain(self, timeout_s: float) -> list[Path]:
        """Wait (at most ``timeout_s``) for every queued upload, logging progress; returns those left."""
        deadline = time.monotonic() + timeout_s
        last = time.monotonic()
        with self._cond:
            while self._active is not None or self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if time.monotonic() - last >= _PROGRESS_EVERY_S:
                    last = time.monotonic()
                    active = self._active.name if self._active is not None else "-"
                    self.say(
                        f"upload: waiting for {len(self._queue) + (self._active is not None)} upload(s) to "
                        f"{self.cfg.destination}: {active} ({self._active_sent / 2**20:.1f} MiB sent), "
                        f"{left:.0f}s left of rl.upload.wait_timeout_s"
                    )
                self._cond.wait(min(left, _PROGRESS_EVERY_S))
            return ([self._active] if self._active is not None else []) + list(self._queue)

    def close(self) -> None:
        """Stop the thread (an upload in flight is abandoned: its copy has no manifest)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()


# -- the run's uploads -----------------------------------------------------------------------------


class Uploads:
    """What the loop holds when ``rl.upload.enabled``: the uploader on rank 0, and the collective
    verdict of ``rl.upload.required`` on every rank."""

    def __init__(self, cfg: UploadConfig, uploader: Uploader | None, say: Say, retention: Callable[[], None]) -> None:
        self.cfg = cfg
        self.uploader = uploader
        self.say = say
        self._retention = retention

    @property
    def on_published(self) -> Callable[[Path], None] | None:
        """The writer's hook (rank 0): queue a checkpoint the moment it is published."""
        return self.uploader.submit if self.uploader is not None else None

    def check(self) -> None:
        """With ``rl.upload.required``: raise ``UploadError`` on every rank once an upload failed for
        good. A collective (every rank calls it at the same boundary); nothing without ``required``."""
        if not self.cfg.required:
            return
        from posttrain.distributed.world import broadcast_object

        failures = self.uploader.failures() if self.uploader is not None else {}
        text = "; ".join(f"{path}: {error}" for path, error in sorted(failures.items()))
        verdict = broadcast_object(text or None)
        if verdict:
            raise UploadError(
                f"checkpoint upload to rl.upload.destination={self.cfg.destination!r} failed after "
                f"{1 + self.cfg.retries} attempt(s) ({verdict}) and rl.upload.required=true stops the run; the "
                "checkpoints are intact locally (rl.resume=auto resumes from them). Fix the destination, or set "
                "rl.upload.required=false to train on without the copies"
            )

    def finish(self) -> None:
        """At the end of the run (the last save published): wait for the uploads in flight (bounded by
        ``rl.upload.wait_timeout_s``), prune what retention held back for them, report what failed.
        The other ranks wait for rank 0 outside any collective (``distributed/rank_zero.py``): a drain
        may outlast ``grid.collective_timeout_s``."""
        from posttrain.distributed.rank_zero import on_rank_zero

        on_rank_zero(self._drain, what="waiting for the checkpoint uploads")
        self.check()

    def _drain(self) -> None:
        if self.uploader is not None:
            pending = self.uploader.pending()
            if pending:
                self.say(f"upload: waiting for {len(pending)} checkpoint upload(s) to {self.cfg.destination}")
            left = self.uploader.drain(self.cfg.wait_timeout_s)
            self.uploader.mark_failed(left, f"not done within rl.upload.wait_timeout_s={self.cfg.wait_timeout_s:g}")
            self._retention()
            failures = self.uploader.failures()
            if failures:
                self.say(
                    f"error: {len(failures)} checkpoint(s) NOT uploaded to {self.cfg.destination}: "
                    + "; ".join(f"{p.name} ({why})" for p, why in sorted(failures.items()))
                    + ". They are intact locally, without .uploaded"
                )

    def close(self) -> None:
        """Stop the upload thread (after ``finish``, or when the run stops on an error)."""
        if self.uploader is not None:
            left = self.uploader.pending()
            if left:
                self.say(f"warning: abandoning {len(left)} checkpoint upload(s) in flight: {[p.name for p in left]}")
            self.uploader.close()


def start_uploads(
    cfg: RunConfig, run_dir: Path, say: Say, *, keep_model_last: int | None, keep_optim_last: int | None
) -> Uploads | None:
    """The run's ``Uploads`` (None unless ``rl.upload.enabled``; the same on every rank)."""
    from posttrain.distributed.world import is_rank_zero

    up = cfg.rl.upload
    if not up.enabled:
        return None
    uploader = None
    if is_rank_zero():
        _fs, root = open_destination(str(up.destination), up.storage_options)
        key = posixpath.join(job_key(cfg), run_dir.name)
        uploader = Uploader(up, posixpath.join(root, key), f"{str(up.destination).rstrip('/')}/{key}", say)
        say(f"upload: completed checkpoints go to {uploader.url_run}/checkpoints/ (rl.upload.required={up.required})")

    def retention() -> None:
        from posttrain.checkpoint.writer import apply_retention

        root = run_dir / "checkpoints"
        apply_retention(root, keep_model_last=keep_model_last, keep_optim_last=keep_optim_last, require_uploaded=True)

    return Uploads(up, uploader, say, retention)


# -- resume from the destination -------------------------------------------------------------------


def _safe_rel(rel: str) -> bool:
    """A manifest path that stays inside the checkpoint (an archive is not trusted to be well formed)."""
    parts = PurePosixPath(rel).parts
    return bool(parts) and not PurePosixPath(rel).is_absolute() and ".." not in parts


def download_checkpoint(fs: Any, remote: str, target: Path, *, full: bool) -> list[str]:
    """Copy the archive's checkpoint ``remote`` to ``target`` through ``<target>.tmp-<pid>`` (manifest
    last), check every file's size (``full``: and sha256), then rename it into place and mark it
    ``.uploaded``. Returns the problems (nothing is left behind then); empty: done."""
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    problems: list[str] = []
    try:
        staging.mkdir(parents=True)
        raw = fs.cat_file(posixpath.join(remote, MANIFEST_NAME))
        listed = json.loads(raw).get("files", {})
        bad = [rel for rel in listed if not _safe_rel(rel)]
        if bad:
            raise UploadError(f"the manifest lists paths outside the checkpoint: {bad[:3]}")
        for rel in sorted(listed):
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(posixpath.join(remote, rel), str(staging / rel))
        (staging / MANIFEST_NAME).write_bytes(raw)
        manifest = read_manifest(staging)
        problems = verify_files(staging, manifest, full=full)
        if STATE_NAME not in manifest["files"]:
            problems.append(f"the manifest lists no {STATE_NAME}")
        if manifest.get("pruned"):
            problems.append(f"retention removed parts of it: {sorted(manifest['pruned'])}")
    except Exception as exc:  # any backend's error: this candidate is skipped
        problems = [f"download failed ({type(exc).__name__}: {exc})"]
    if problems:
        shutil.rmtree(staging, ignore_errors=True)
        return problems
    if target.exists():  # a local copy that did not verify or was pruned: the archive's replaces it
        aside = target.with_name(f"{target.name}.replaced-{os.getpid()}")
        target.rename(aside)
        staging.rename(target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        staging.rename(target)
    fsync_dir(target.parent)
    write_json_atomic(target / UPLOADED_NAME, {"destination": remote, "downloaded": time.time()})
    return []


def _remote_candidates(fs: Any, base: str) -> list[tuple[str, int, str]]:
    """``(attempt, step, path)`` of every archived checkpoint holding a manifest, newest first."""
    fs.invalidate_cache(base)
    found = []
    for manifest in fs.glob(posixpath.join(base, "*", "checkpoints", "iter_*", MANIFEST_NAME)):
        ckpt = PurePosixPath(str(manifest)).parent
        match = ITER_RE.match(ckpt.name)
        if match:
            found.append((ckpt.parent.parent.name, int(match.group(1)), str(ckpt)))
    return sorted(found, reverse=True)


def fetch_from_destination(cfg: RunConfig, job_dir: Path, local: Path | None, say: Say) -> Path | None:
    """The checkpoint ``rl.resume=auto`` resumes from once the archive is looked at: the archive's
    newest one when it is newer than ``local`` (the newest local one, by attempt then step), downloaded
    into ``job_dir``; else ``local``. Rank 0 looks and downloads, the others wait outside any
    collective (a download may outlast ``grid.collective_timeout_s``); every rank gets its answer."""
    from posttrain.distributed.rank_zero import on_rank_zero

    chosen = on_rank_zero(lambda: _fetch_newest(cfg, job_dir, local, say), what="the download from the archive")
    return Path(chosen) if chosen is not None else None


def _fetch_newest(cfg: RunConfig, job_dir: Path, local: Path | None, say: Say) -> str | None:
    up = cfg.rl.upload
    match = ITER_RE.match(local.name) if local is not None else None
    here = (local.parent.parent.name, int(match.group(1))) if local is not None and match else None
    try:
        fs, root = open_destination(str(up.destination), up.storage_options)
        candidates = _remote_candidates(fs, posixpath.join(root, job_key(cfg)))
    except Exception as exc:  # unreachable now: resume from what is here
        say(f"warning: rl.resume=auto could not list rl.upload.destination={up.destination!r}: {exc}")
        return str(local) if local is not None else None
    for attempt, step, remote in candidates:
        if here is not None and (attempt, step) <= here:
            break
        target = job_dir / attempt / "checkpoints" / iter_name(step)
        problems = download_checkpoint(fs, remote, target, full=cfg.rl.checkpoint_verify == "hash")
        if problems:
            say(f"warning: skipping the archived checkpoint {remote}: {'; '.join(problems)}")
            continue
        history = job_dir / attempt / METRICS_NAME
        remote_history = posixpath.join(posixpath.dirname(posixpath.dirname(remote)), METRICS_NAME)
        if not history.is_file() and fs.exists(remote_history):
            fs.get_file(remote_history, str(history))
        say(f"rl.resume=auto: downloaded {target.name} of attempt {attempt} from {up.destination} to {target}")
        return str(target)
    return str(local) if local is not None else None
