"""Checkpoints written: snapshot, payload, publish, retention (``CheckpointWriter``, sync or async).

A save writes ``iter_<step>.tmp-<pid>/`` first, files then ``manifest.json`` last, renames the
directory to ``iter_<step>/`` only when it is complete, and only then rewrites
``latest_checkpoint.txt``. So a crash at any point leaves either the previous state or a ``.tmp-``
directory that nothing ever resumes from, and the pointer only ever names complete checkpoints.
The files of each format are described in ``posttrain.checkpoint.layout``.

The save is split in two: the *snapshot* (``posttrain.checkpoint.snapshot``: model, optimizer and
scheduler state captured before ``save`` returns) and the *write phase* (payload, manifest, rename,
pointer, retention), which an async save runs in a thread. For an async ``dcp`` save the payload is
``torch.distributed.checkpoint.async_save``'s: it stages (copies) the state to CPU memory before
``save`` returns and uploads it in its own thread; the write phase waits for both uploads (model,
optimizer) and then writes the manifest. With several ranks every collective of a background save
(DCP's planning, the write phase's barriers) runs on gloo groups of its own
(``posttrain.distributed.world.background_groups``), never on the training step's groups.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain.checkpoint import CheckpointError
from posttrain.checkpoint.failed_saves import IO_FAILURES, failure_reason, payload_bytes, root_failure
from posttrain.checkpoint.hf_dir import write_model_file, write_side_files
from posttrain.checkpoint.layout import (
    MODEL_DCP,
    MODEL_FILE,
    OPTIM_DCP,
    OPTIM_FILE,
    SCHED_FILE,
    STATE_NAME,
    Format,
    TrainingState,
    iter_dirs,
    iter_name,
    quiet_dcp,
    state_file,
    write_latest_pointer,
)
from posttrain.checkpoint.manifest import build_manifest, fsync_dir, part_paths, read_manifest, write_manifest
from posttrain.checkpoint.reader import find_latest_complete, verify_checkpoint
from posttrain.checkpoint.snapshot import Snapshot, take_snapshot
from posttrain.checkpoint.upload import UPLOADED_NAME
from posttrain.distributed.world import background_groups, barrier, broadcast_object, is_rank_zero, rank_and_world

if TYPE_CHECKING:
    from torch import nn

_log = logging.getLogger("posttrain.checkpoint")

# DCP warns on every save without a process group; an async upload's save runs in DCP's own thread,
# outside any ``quiet_dcp`` block, so the (intended) one-process case is silenced for the process.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")


# -- the write phase (runs in the background thread for async saves) ------------------------------


def _start_uploads(snap: Snapshot, tmp: Path, groups: list[Any]) -> list[Future[Any]]:
    """``async_save`` of the model and the optimizer state (a dcp save in the background): each copies
    its state to CPU memory before it returns, then writes it in a thread of its own, on a process
    group of its own (so the two uploads' collectives cannot interleave). The snapshot then drops
    its references to the live state."""
    import torch.distributed.checkpoint as dcp

    futures: list[Future[Any]] = []
    try:
        with quiet_dcp():
            for sd, sub, group in ((snap.model, MODEL_DCP, groups[0]), (snap.optimizer, OPTIM_DCP, groups[1])):
                response = dcp.async_save(sd, checkpoint_id=str(tmp / sub), process_group=group)
                futures.append(response if isinstance(response, Future) else response.upload_completion)
    except BaseException:
        _join_uploads(futures, reraise=False)  # no upload may still write into a directory about to go
        raise
    snap.model, snap.optimizer = {}, {}
    return futures


def _join_uploads(futures: list[Future[Any]], *, reraise: bool = True) -> None:
    """Wait for every upload (even after one failed: none may still be writing when the caller cleans
    up); then raise the first failure."""
    errors = []
    for future in futures:
        try:
            future.result()
        except BaseException as exc:
            errors.append(exc)
    if errors and reraise:
        raise errors[0]


def _write_payload(job: _Job) -> dict[str, list[str]]:
    """Model, optimizer and scheduler files; returns the manifest's parts for them."""
    snap, tmp = job.snap, job.tmp
    if snap.fmt == "dcp":
        if job.uploads:
            _join_uploads(job.uploads)
        else:
            import torch.distributed.checkpoint as dcp

            with quiet_dcp():
                dcp.save(snap.model, checkpoint_id=str(tmp / MODEL_DCP))
                dcp.save(snap.optimizer, checkpoint_id=str(tmp / OPTIM_DCP))
        parts = {"model": [MODEL_DCP], "optimizer": [OPTIM_DCP, SCHED_FILE]}
    elif not is_rank_zero():  # consolidated: rank 0 holds the gathered state and writes it alone
        parts = {"model": [MODEL_FILE], "optimizer": [OPTIM_FILE, SCHED_FILE]}
    else:
        write_model_file(snap.model, snap.aliases, tmp / MODEL_FILE)
        torch.save(snap.optimizer, tmp / OPTIM_FILE)
        parts = {"model": [MODEL_FILE], "optimizer": [OPTIM_FILE, SCHED_FILE]}
    if is_rank_zero():
        torch.save(snap.scheduler, tmp / SCHED_FILE)
    return parts


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``.tmp-`` directory into place (replacing an older save of the same step)."""
    if final.exists() or final.is_symlink():
        if final.is_symlink() or not final.is_dir():
            raise CheckpointError(f"{final} exists and is not a checkpoint directory; move it away")
        aside = final.with_name(f"{final.name}.replaced-{os.getpid()}")
        final.rename(aside)
        tmp.rename(final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_dir(final.parent)


@dataclass
class _Job:
    """One save in flight: where it goes and what it must do after the payload."""

    snap: Snapshot
    tmp: Path
    final: Path
    root: Path
    parts: dict[str, list[str]]
    keep_model_last: int | None
    keep_optim_last: int | None
    world: int
    """Ranks that wrote a training state (recorded in the manifest)."""
    needed_bytes: int
    """About what the payload writes (a failed save's report compares it with the free space)."""
    uploads: list[Future[Any]] = field(default_factory=list)
    """An async dcp save's uploads in flight (``_start_uploads``)."""
    group: Any = None
    """The process group of the write phase's barriers (None: the default group; one process: none)."""
    on_published: Callable[[Path], None] | None = None
    """``rl.upload``: called with the published checkpoint before retention (``checkpoint/upload.py``)."""


def _finish_save(job: _Job) -> Path:
    """Payload, manifest (last), rename, pointer, retention."""
    zero = is_rank_zero()
    try:
        parts = {**job.parts, **_write_payload(job)}
        barrier(job.group)
        if zero:
            meta = {"checkpoint_format": job.snap.fmt, "step": job.snap.step, "world_size": job.world, **job.snap.meta}
            write_manifest(job.tmp, build_manifest(job.tmp, parts=parts, meta=meta))
            _publish(job.tmp, job.final)
            write_latest_pointer(job.root, job.final)
            if job.on_published is not None:
                job.on_published(job.final)
            apply_retention(
                job.root,
                keep_model_last=job.keep_model_last,
                keep_optim_last=job.keep_optim_last,
                protect=job.final,
                require_uploaded=job.on_published is not None,
            )
    except BaseException as exc:
        if zero:
            failed = _save_failed(exc, job.snap.step, job.final, job.tmp, needed_bytes=job.needed_bytes)
            if failed is not None:
                raise failed from exc
        raise
    finally:
        barrier(job.group)
    return job.final


def _save_failed(
    exc: BaseException, step: int, final: Path, tmp: Path, *, needed_bytes: int = 0
) -> CheckpointError | None:
    """Remove the failed save's ``.tmp-`` directory; for a write that failed (a full disk, a file-size
    limit, a read-only directory, ...) the ``CheckpointError`` to raise instead of the library's raw
    error: the path, the operating system's reason, and the newest checkpoint that survives."""
    exc = root_failure(exc)  # a DCP save reports its ranks' errors wrapped in one CheckpointException
    io_failure = isinstance(exc, IO_FAILURES) and not isinstance(exc, CheckpointError)
    root = final.parent
    # The reason first: removing the partial files frees the space a probe would look for.
    reason = (
        failure_reason(exc, root if root.is_dir() else root.parent, needed_bytes=needed_bytes) if io_failure else ""
    )
    existed = tmp.exists()
    shutil.rmtree(tmp, ignore_errors=True)
    if not io_failure:
        return None
    newest = find_latest_complete(root, full=False) if root.is_dir() else None
    survivors = (
        f"the earlier checkpoints are intact: the newest complete one is {newest} (rl.resume=auto resumes from it)"
        if newest is not None
        else f"{root} holds no earlier complete checkpoint"
    )
    return CheckpointError(
        f"cannot save the checkpoint of step {step} to {final}: {reason} ({type(exc).__name__}: {exc}); "
        + (f"the unfinished {tmp.name} was removed and " if existed else "")
        + survivors
    )


class CheckpointWriter:
    """Saves checkpoints into one ``checkpoints/`` directory, synchronously or in the background.

    With ``async_save`` a save captures the model, optimizer and scheduler state in CPU memory (a
    copy; for ``dcp``, ``torch.distributed.checkpoint.async_save``'s staging), writes the small files,
    and returns; background threads write the rest. Both formats and every topology save this way;
    a sharded policy's ``consolidated`` save gathers the full state to rank 0 before ``save``
    returns (a collective on the training step's groups) and writes it in the background. At most
    one save is in flight: the next ``save`` first joins the previous one. Call ``wait()`` before
    exiting (or use the writer as a context manager); a background save that failed raises its
    ``CheckpointError`` at that next join.

    ``fmt`` and the ``keep_*_last`` counts come from the validated config (``rl.checkpoint_format``,
    ``rl.keep_model_last >= 1``, ``rl.keep_optim_last >= 1``; ``None`` keeps all).
    """

    def __init__(
        self,
        ckpt_root: Path,
        *,
        fmt: Format = "consolidated",
        keep_model_last: int | None = None,
        keep_optim_last: int | None = None,
        async_save: bool = False,
        on_published: Callable[[Path], None] | None = None,
    ) -> None:
        """``on_published`` (``rl.upload``, rank 0): called with each checkpoint once it is published;
        retention then never prunes a checkpoint without ``.uploaded`` (its upload has not completed)."""
        self.ckpt_root = Path(ckpt_root)
        self.on_published = on_published
        self.fmt: Format = fmt
        self.keep_model_last = keep_model_last
        self.keep_optim_last = keep_optim_last
        self.async_save = async_save
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._last: Path | None = None

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()

    @property
    def pending(self) -> bool:
        """Whether a background save is still running."""
        return self._thread is not None and self._thread.is_alive()

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        state: TrainingState,
        *,
        tokenizer: Any = None,
    ) -> Path:
        """Checkpoint after ``step`` collected batches; returns the final ``iter_*`` path.

        ``tokenizer`` (optional) is stored beside the weights with the model's HF config, so that a
        consolidated checkpoint loads as a Hugging Face model directory (``posttrain.checkpoint.hf_dir``).
        For an async save the returned directory appears when the background write completes.
        """
        self.wait()
        rank, world = rank_and_world()
        background = self.async_save
        # a collective on the first async save (every rank saves at the same step): the groups of the
        # background collectives; the model upload's group also carries the write phase's barriers
        groups = background_groups(2) if background else [None, None]
        final = self.ckpt_root / iter_name(step)
        tmp = self.ckpt_root / broadcast_object(f"{final.name}.tmp-{os.getpid()}")
        try:
            if rank == 0:
                self.ckpt_root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
            barrier()
            snap = take_snapshot(
                step, self.fmt, model, optimizer, scheduler, copy=background and self.fmt == "consolidated"
            )
            (tmp / state_file(rank)).write_text(state.to_json(), encoding="utf-8")
            side = write_side_files(model, tokenizer, tmp, dtype=snap.meta["model_dtype"]) if rank == 0 else []
            needed = payload_bytes(snap.model) + payload_bytes(snap.optimizer)
            uploads = _start_uploads(snap, tmp, groups) if background and self.fmt == "dcp" else []
        except BaseException as exc:
            if rank == 0:
                failed = _save_failed(exc, step, final, tmp)
                if failed is not None:
                    raise failed from exc
            raise
        states = [STATE_NAME, *(state_file(r) for r in range(1, world))]
        job = _Job(
            snap,
            tmp,
            final,
            self.ckpt_root,
            {"state": states, "hf": side},
            self.keep_model_last,
            self.keep_optim_last,
            world,
            needed_bytes=needed,
            uploads=uploads,
            group=groups[0],
            on_published=self.on_published,
        )
        if not background:
            self._last = _finish_save(job)
            return final
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"checkpoint-{step}", daemon=False)
        self._thread.start()
        return final

    def _run(self, job: _Job) -> None:
        try:
            self._last = _finish_save(job)
        except BaseException as exc:  # reported at the next join, where the loop can act on it
            self._error = (job.snap.step, exc)

    def wait(self) -> Path | None:
        """Join a background save; raise ``CheckpointError`` if it failed. Returns the last saved path."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            step, exc = self._error
            self._error = None
            raise CheckpointError(
                f"the background save of step {step} to {self.ckpt_root / iter_name(step)} failed: {exc}"
            ) from exc
        return self._last

    close = wait


# -- retention ------------------------------------------------------------------------------------


def apply_retention(
    ckpt_root: Path,
    *,
    keep_model_last: int | None,
    keep_optim_last: int | None,
    protect: Path | None = None,
    require_uploaded: bool = False,
) -> None:
    """Drop model weights beyond the newest ``keep_model_last`` checkpoints, optimizer state beyond the
    newest ``keep_optim_last``; ``protect`` (the one just written) is never touched, nor (with
    ``require_uploaded``, ``rl.upload``) one without ``.uploaded``: its upload is in flight or failed.

    A pruned checkpoint keeps a valid manifest that records what was removed (``pruned``), so it
    is not mistaken for a corrupt one; it can no longer be resumed (and without weights not
    exported either). A checkpoint that loses both is deleted whole.
    """
    if keep_model_last is None and keep_optim_last is None:
        return
    rank = 0
    for _step, path in iter_dirs(ckpt_root):
        if verify_checkpoint(path, full=False):
            continue  # incomplete or corrupt: not counted, and left alone for a human to inspect
        drop = {}
        if keep_model_last is not None and rank >= keep_model_last:
            drop["model"] = f"rl.keep_model_last={keep_model_last}"
        if keep_optim_last is not None and rank >= keep_optim_last:
            drop["optimizer"] = f"rl.keep_optim_last={keep_optim_last}"
        rank += 1
        if drop and require_uploaded and not (path / UPLOADED_NAME).is_file():
            _log.info("retention: keeping %s whole: its upload has not completed (no %s)", path, UPLOADED_NAME)
            continue
        if drop and (protect is None or path.resolve() != Path(protect).resolve()):
            _prune(path, drop)


def _prune(path: Path, drop: dict[str, str]) -> None:
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        _log.warning("retention: leaving %s alone: %s", path, exc)
        return
    pruned = manifest.setdefault("pruned", {})
    new = {part: why for part, why in drop.items() if part not in pruned}
    if not new:
        return
    if {"model", "optimizer"} <= set(pruned) | set(new):
        aside = path.with_name(f"{path.name}.deleting-{os.getpid()}")
        path.rename(aside)  # out of the iter_* namespace first: a half-deleted dir is never a candidate
        shutil.rmtree(aside, ignore_errors=True)
        _log.info("retention: deleted %s (%s)", path, ", ".join(new.values()))
        return
    doomed = [p for part in new for p in manifest.get("parts", {}).get(part, [])]
    for part in new:
        for rel in part_paths(manifest, part):
            manifest["files"].pop(rel, None)
    pruned.update(new)
    write_manifest(path, manifest)  # manifest first: a crash mid-delete leaves unlisted extras, not holes
    for rel in doomed:
        target = path / rel
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)
    _log.info("retention: removed %s of %s", " and ".join(new), path)


__all__ = ["CheckpointWriter", "apply_retention"]
