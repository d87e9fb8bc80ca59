"""Checkpoints written: snapshot, payload, publish, retention (``CheckpointWriter``, sync or async).

A save writes ``iter_<step>.tmp-<pid>/`` first, files then ``manifest.json`` last, renames the
directory to ``iter_<step>/`` only when it is complete, and only then rewrites
``latest_checkpoint.txt``. So a crash at any point leaves either the previous state or a ``.tmp-``
directory that nothing ever resumes from, and the pointer only ever names complete checkpoints.
The files of each format are described in ``posttrain.checkpoint.layout``.

The save is split in two: the *snapshot* (model, optimizer and scheduler state captured before
``save`` returns, copied to CPU memory for a background save) and the *write phase* (payload,
manifest, rename, pointer, retention), which an async save runs in a thread.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain.checkpoint import CheckpointError
from posttrain.checkpoint.failed_saves import IO_FAILURES, failure_reason, payload_bytes
from posttrain.checkpoint.layout import (
    ALIASES_KEY,
    HF_DIR,
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
from posttrain.distributed.world import barrier, broadcast_object, is_rank_zero, rank_and_world

if TYPE_CHECKING:
    from torch import nn

_log = logging.getLogger("posttrain.checkpoint")


# -- snapshot: the synchronous part of a save ----------------------------------------------------


def _dedupe(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors safetensors can store (tied weights once, no shared storage) and the alias map."""
    seen: dict[tuple[Any, ...], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        t = tensor.detach()
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t
    storages: dict[tuple[Any, int], int] = {}
    for t in tensors.values():
        skey = (t.device, t.untyped_storage().data_ptr())
        storages[skey] = storages.get(skey, 0) + 1
    for name, t in tensors.items():
        # partial views of one buffer, or non-contiguous tensors: safetensors needs them split
        if storages[(t.device, t.untyped_storage().data_ptr())] > 1 or not t.is_contiguous():
            tensors[name] = t.contiguous().clone()
    return tensors, aliases


def _to_cpu(obj: Any, *, copy: bool) -> Any:
    """``obj`` with every tensor moved to the CPU (cloned when ``copy``, so later updates cannot leak in)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {k: _to_cpu(v, copy=copy) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v, copy=copy) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v, copy=copy) for v in obj)
    return obj


@dataclass
class _Snapshot:
    """What a save writes, captured before ``save`` returns (copied to CPU memory when async)."""

    step: int
    fmt: Format
    model: dict[str, Any]
    aliases: dict[str, str]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    meta: dict[str, Any]


def _model_meta(model: nn.Module) -> dict[str, Any]:
    dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
    return {"model_class": type(model).__name__, "model_dtype": sorted(dtypes)[0] if len(dtypes) == 1 else None}


def _take_snapshot(
    step: int, fmt: Format, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *, copy: bool
) -> _Snapshot:
    from posttrain.distributed.fsdp import is_sharded

    model_sd: dict[str, Any]
    optim_sd: dict[str, Any]
    aliases: dict[str, str] = {}
    meta = _model_meta(model)
    if fmt == "dcp":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        with quiet_dcp():
            model_sd = dict(get_model_state_dict(model))
            optim_sd = dict(get_optimizer_state_dict(model, optimizer))
    # A sharded policy (several ranks) has no whole tensor on any rank: gather them to rank 0 first.
    elif is_sharded(model):
        model_sd, aliases, optim_sd = _gather_to_rank0(model, optimizer)
        meta["optimizer_layout"] = "fqn"
    else:
        model_sd, aliases = _dedupe(model.state_dict())
        optim_sd = optimizer.state_dict()
    return _Snapshot(
        step=step,
        fmt=fmt,
        model=_to_cpu(model_sd, copy=copy) if fmt == "consolidated" else model_sd,
        aliases=aliases,
        optimizer=_to_cpu(optim_sd, copy=copy) if fmt == "consolidated" else optim_sd,
        scheduler=_to_cpu(scheduler.state_dict(), copy=True) if scheduler is not None else None,
        meta=meta,
    )


def _gather_to_rank0(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, Any]]:
    """A sharded model's full weights (deduplicated) and full optimizer state, keyed by parameter
    name, on rank 0; empty on the other ranks. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from posttrain.distributed.fsdp import full_state_dict

    weights = full_state_dict(model, to_cpu=True, rank0_only=True)
    with quiet_dcp():
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optim_sd = dict(get_optimizer_state_dict(model, optimizer, options=options))
    if not is_rank_zero():
        return {}, {}, {}
    model_sd, aliases = _dedupe(weights)
    return model_sd, aliases, optim_sd


def _write_hf_meta(model: nn.Module, tokenizer: Any, root: Path) -> list[str]:
    """``hf/``: the model's config, generation config and the tokenizer (whatever exists)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return []
    hf = root / HF_DIR
    config.save_pretrained(hf)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(hf)
    if tokenizer is not None:
        tokenizer.save_pretrained(hf)
    return [HF_DIR]


# -- the write phase (runs in the background thread for async saves) ------------------------------


def _write_payload(snap: _Snapshot, tmp: Path) -> dict[str, list[str]]:
    """Model, optimizer and scheduler files; returns the manifest's parts for them."""
    if snap.fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        with quiet_dcp():
            dcp.save(snap.model, checkpoint_id=str(tmp / MODEL_DCP))
            dcp.save(snap.optimizer, checkpoint_id=str(tmp / OPTIM_DCP))
        parts = {"model": [MODEL_DCP], "optimizer": [OPTIM_DCP, SCHED_FILE]}
    elif not is_rank_zero():  # consolidated: rank 0 holds the gathered state and writes it alone
        parts = {"model": [MODEL_FILE], "optimizer": [OPTIM_FILE, SCHED_FILE]}
    else:
        from safetensors.torch import save_file

        # one metadata key only: safetensors orders header metadata from a hash map, so with two keys
        # the same tensors could serialise to different bytes (and different manifest hashes)
        metadata = {ALIASES_KEY: json.dumps(snap.aliases)}
        save_file(snap.model, str(tmp / MODEL_FILE), metadata=metadata)
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

    snap: _Snapshot
    tmp: Path
    final: Path
    root: Path
    parts: dict[str, list[str]]
    keep_model_last: int | None
    keep_optim_last: int | None
    world: int
    """Ranks that wrote a training state (recorded in the manifest)."""


def _finish_save(job: _Job) -> Path:
    """Payload, manifest (last), rename, pointer, retention."""
    zero = is_rank_zero()
    try:
        parts = {**job.parts, **_write_payload(job.snap, job.tmp)}
        barrier()
        if zero:
            meta = {"checkpoint_format": job.snap.fmt, "step": job.snap.step, "world_size": job.world, **job.snap.meta}
            write_manifest(job.tmp, build_manifest(job.tmp, parts=parts, meta=meta))
            _publish(job.tmp, job.final)
            write_latest_pointer(job.root, job.final)
            apply_retention(
                job.root, keep_model_last=job.keep_model_last, keep_optim_last=job.keep_optim_last, protect=job.final
            )
    except BaseException as exc:
        if zero:
            needed = payload_bytes(job.snap.model) + payload_bytes(job.snap.optimizer)
            failed = _save_failed(exc, job.snap.step, job.final, job.tmp, needed_bytes=needed)
            if failed is not None:
                raise failed from exc
        raise
    finally:
        barrier()
    return job.final


def _save_failed(
    exc: BaseException, step: int, final: Path, tmp: Path, *, needed_bytes: int = 0
) -> CheckpointError | None:
    """Remove the failed save's ``.tmp-`` directory; for a write that failed (a full disk, a file-size
    limit, a read-only directory, ...) the ``CheckpointError`` to raise instead of the library's raw
    error: the path, the operating system's reason, and the newest checkpoint that survives."""
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

    With ``async_save`` a save copies the model, optimizer and scheduler state to CPU memory,
    writes the small files, and returns; a background (non-daemon) thread writes the rest. At most
    one save is in flight: the next ``save`` first joins the previous one. Call ``wait()`` before
    exiting (or use the writer as a context manager); a background save that failed raises its
    ``CheckpointError`` at that next join. ``dcp`` saves, and saves of a sharded policy, are always
    synchronous (their collectives must not run beside the training step's).

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
    ) -> None:
        self.ckpt_root = Path(ckpt_root)
        self.fmt: Format = fmt
        self.keep_model_last = keep_model_last
        self.keep_optim_last = keep_optim_last
        self.async_save = async_save
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._last: Path | None = None
        if async_save and fmt == "dcp":
            _log.warning("rl.save_async applies to consolidated checkpoints; dcp checkpoints are saved synchronously")

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

        ``tokenizer`` (optional) is stored with the model's HF config under ``hf/`` for export.
        For an async save the returned directory appears when the background write completes.
        """
        from posttrain.distributed.fsdp import is_sharded

        self.wait()
        rank, world = rank_and_world()
        # A sharded policy saves synchronously: gathering its state and the write phase's barriers are
        # collectives, which must not run in a thread beside the training step's own collectives.
        background = self.async_save and self.fmt == "consolidated" and not is_sharded(model)
        final = self.ckpt_root / iter_name(step)
        tmp = self.ckpt_root / broadcast_object(f"{final.name}.tmp-{os.getpid()}")
        try:
            if rank == 0:
                self.ckpt_root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
            barrier()
            snap = _take_snapshot(step, self.fmt, model, optimizer, scheduler, copy=background)
            (tmp / state_file(rank)).write_text(state.to_json(), encoding="utf-8")
            hf_parts = _write_hf_meta(model, tokenizer, tmp) if rank == 0 else []
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
            {"state": states, "hf": hf_parts},
            self.keep_model_last,
            self.keep_optim_last,
            world,
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
    ckpt_root: Path, *, keep_model_last: int | None, keep_optim_last: int | None, protect: Path | None = None
) -> None:
    """Drop model weights beyond the newest ``keep_model_last`` checkpoints, optimizer state beyond the
    newest ``keep_optim_last``; ``protect`` (the one just written) is never touched.

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
