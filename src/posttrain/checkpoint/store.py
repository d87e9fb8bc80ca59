"""Checkpoints: save (sync or in the background), verify, find the newest complete one, load, retain.

A save writes ``iter_<step>.tmp-<pid>/`` first, files then ``manifest.json`` last, renames the
directory to ``iter_<step>/`` only when it is complete, and only then rewrites
``latest_checkpoint.txt``. So a crash at any point leaves either the previous state or a ``.tmp-``
directory that nothing ever resumes from, and the pointer only ever names complete checkpoints.

Formats (``rl.checkpoint_format``):

* ``consolidated``: ``model.safetensors`` (tied weights stored once, the aliases in the file's
  metadata), ``optimizer.pt`` (``optimizer.state_dict()``), ``scheduler.pt``. One process writes.
  An FSDP2-sharded policy (several ranks) is gathered to rank 0 first, which writes the full
  weights and the full optimizer state keyed by parameter name (``optimizer_layout: fqn`` in the
  manifest; loaded with ``set_optimizer_state_dict``); every rank still writes its own training state.
* ``dcp``: ``model_dcp/`` and ``optim_dcp/`` written with ``torch.distributed.checkpoint`` (every
  rank writes its own shards; in a single process it works without a process group). Model and
  optimizer are separate DCP directories so retention can drop one without the other.

Both also hold ``training_state.json`` (counters, data cursor, engine state, RNG, run identity;
rank r > 0 of a multi-rank job adds ``training_state.rank<r>.json`` for its own RNG and cursors)
and, for Hugging Face models, ``hf/`` (config, generation config, tokenizer) so that
``posttrain export-hf`` needs nothing but the checkpoint.

Exactness: on CPU a resumed run continues bitwise (weights, optimizer moments and step counts,
schedule, RNG, data cursor and sampling-call counter are all restored). On GPUs the state is
restored just as exactly, but nondeterministic kernels (atomics in attention / matmul backward)
already make two uninterrupted runs differ, so a resume matches only as closely as those do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from posttrain.checkpoint import CheckpointError
from posttrain.checkpoint.manifest import (
    MANIFEST_NAME,
    build_manifest,
    fsync_dir,
    part_paths,
    read_manifest,
    sha256_file,
    verify_files,
    write_manifest,
)

if TYPE_CHECKING:
    from torch import nn

    from posttrain.config.schema import GRPOConfig

_log = logging.getLogger("posttrain.checkpoint")

Format = Literal["consolidated", "dcp"]
LATEST_NAME = "latest_checkpoint.txt"
STATE_NAME = "training_state.json"
MODEL_FILE, MODEL_DCP = "model.safetensors", "model_dcp"
OPTIM_FILE, OPTIM_DCP = "optimizer.pt", "optim_dcp"
SCHED_FILE = "scheduler.pt"
HF_DIR = "hf"
ITER_RE = re.compile(r"^iter_(\d+)$")
TMP_RE = re.compile(r"^iter_(\d+)\.tmp-\d+$")
_ALIASES_KEY = "posttrain_aliases"


@dataclass
class TrainingState:
    """Everything an exact resume needs besides weights and optimizer state."""

    step: int
    """Collected batches done."""
    optimizer_step: int
    """Optimizer steps applied (``PolicyTrainer.optimizer_step``)."""
    zero_grad_skips_total: int
    """Updates skipped on an exactly-zero gradient (they count toward ``n_mini`` per batch)."""
    data_state: dict[str, Any]
    """``DataSource.state_dict()``."""
    engine_state: dict[str, Any]
    """The rollout engine's ``state_dict()`` (its sampling-call counter)."""
    rng: dict[str, Any]
    """``posttrain.checkpoint.rng.capture_rng()``."""
    identity: dict[str, Any]
    """``{"data_seed", "objective", "ref_anchor", "n_mini"}``: what an exact resume must not change."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else the loop wants back (JSON values)."""

    def to_json(self) -> str:
        """JSON text; ``CheckpointError`` naming the field that holds a non-JSON value."""
        tree = dataclasses.asdict(self)
        for name, value in tree.items():
            try:
                json.dumps(value, default=_json_default)
            except (TypeError, ValueError) as exc:
                raise CheckpointError(
                    f"TrainingState.{name} is not JSON-serialisable ({exc}); state dicts must hold plain "
                    "numbers, strings, lists and dicts"
                ) from None
        return json.dumps(tree, default=_json_default, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrainingState:
        """The inverse of ``to_json`` (unknown keys are refused, a missing ``extra`` is empty)."""
        tree = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(tree) - names)
        if unknown:
            raise CheckpointError(f"training state has unknown fields {unknown}: written by a newer posttrain?")
        return cls(**tree)


def _json_default(value: Any) -> Any:
    """NumPy scalars and 0-d tensors become Python numbers; anything else is refused."""
    shape = getattr(value, "shape", None)
    if callable(getattr(value, "item", None)) and shape is not None and len(shape) == 0:
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def iter_name(step: int) -> str:
    """The directory name of the checkpoint after ``step`` collected batches."""
    return f"iter_{step:09d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of an ``iter_*`` directory name, else None."""
    match = ITER_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


# -- distributed helpers (a plain single process is rank 0 of 1) ---------------------------------


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _broadcast(obj: Any, world: int) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if world == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _quiet_dcp() -> Any:
    """DCP warns on every call that it runs without a process group: intended here, so silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


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
    model_sd: dict[str, Any]
    optim_sd: dict[str, Any]
    aliases: dict[str, str] = {}
    meta = _model_meta(model)
    if fmt == "dcp":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        with _quiet_dcp():
            model_sd = dict(get_model_state_dict(model))
            optim_sd = dict(get_optimizer_state_dict(model, optimizer))
    elif _is_sharded(model):
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


def _is_sharded(model: nn.Module) -> bool:
    """Whether the model's parameters are DTensors (an FSDP2-sharded policy)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _gather_to_rank0(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, Any]]:
    """A sharded model's full weights (deduplicated) and full optimizer state, keyed by parameter
    name, on rank 0; empty on the other ranks. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from posttrain.distributed.fsdp import full_state_dict

    weights = full_state_dict(model, to_cpu=True, rank0_only=True)
    with _quiet_dcp():
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optim_sd = dict(get_optimizer_state_dict(model, optimizer, options=options))
    if _rank_world()[0] != 0:
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


def _state_file(rank: int) -> str:
    return STATE_NAME if rank == 0 else f"training_state.rank{rank:05d}.json"


# -- the write phase (runs in the background thread for async saves) ------------------------------


def _write_payload(snap: _Snapshot, tmp: Path) -> dict[str, list[str]]:
    """Model, optimizer and scheduler files; returns the manifest's parts for them."""
    if snap.fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        with _quiet_dcp():
            dcp.save(snap.model, checkpoint_id=str(tmp / MODEL_DCP))
            dcp.save(snap.optimizer, checkpoint_id=str(tmp / OPTIM_DCP))
        parts = {"model": [MODEL_DCP], "optimizer": [OPTIM_DCP, SCHED_FILE]}
    elif _rank_world()[0] != 0:  # consolidated: rank 0 holds the gathered state and writes it alone
        parts = {"model": [MODEL_FILE], "optimizer": [OPTIM_FILE, SCHED_FILE]}
    else:
        from safetensors.torch import save_file

        # one metadata key only: safetensors orders header metadata from a hash map, so with two keys
        # the same tensors could serialise to different bytes (and different manifest hashes)
        metadata = {_ALIASES_KEY: json.dumps(snap.aliases)}
        save_file(snap.model, str(tmp / MODEL_FILE), metadata=metadata)
        torch.save(snap.optimizer, tmp / OPTIM_FILE)
        parts = {"model": [MODEL_FILE], "optimizer": [OPTIM_FILE, SCHED_FILE]}
    if _rank_world()[0] == 0:
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


def write_latest_pointer(ckpt_root: Path, final: Path) -> None:
    """Point ``latest_checkpoint.txt`` at ``final`` (atomic replace)."""
    path = ckpt_root / LATEST_NAME
    tmp = path.with_name(f".{LATEST_NAME}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(final.name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    fsync_dir(ckpt_root)


def read_latest_pointer(ckpt_root: Path) -> Path | None:
    """The directory ``latest_checkpoint.txt`` names, or None when there is no pointer."""
    path = Path(ckpt_root) / LATEST_NAME
    if not path.is_file():
        return None
    name = path.read_text(encoding="utf-8").strip()
    return Path(ckpt_root) / name if name else None


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


def _finish_save(job: _Job) -> Path:
    """Payload, manifest (last), rename, pointer, retention."""
    rank = _rank_world()[0]
    try:
        parts = {**job.parts, **_write_payload(job.snap, job.tmp)}
        _barrier(job.world)
        if rank == 0:
            meta = {"checkpoint_format": job.snap.fmt, "step": job.snap.step, "world_size": job.world, **job.snap.meta}
            write_manifest(job.tmp, build_manifest(job.tmp, parts=parts, meta=meta))
            _publish(job.tmp, job.final)
            write_latest_pointer(job.root, job.final)
            apply_retention(
                job.root, keep_model_last=job.keep_model_last, keep_optim_last=job.keep_optim_last, protect=job.final
            )
    except BaseException:
        if rank == 0:
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise
    finally:
        _barrier(job.world)
    return job.final


class CheckpointWriter:
    """Saves checkpoints into one ``checkpoints/`` directory, synchronously or in the background.

    With ``async_save`` a save copies the model, optimizer and scheduler state to CPU memory,
    writes the small files, and returns; a background (non-daemon) thread writes the rest. At most
    one save is in flight: the next ``save`` first joins the previous one. Call ``wait()`` before
    exiting (or use the writer as a context manager); a background save that failed raises its
    ``CheckpointError`` at that next join. ``dcp`` saves are always synchronous (DCP's collectives
    must not run beside the training step's).
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
        if fmt not in ("consolidated", "dcp"):
            raise CheckpointError(f"rl.checkpoint_format={fmt!r}: use 'consolidated' or 'dcp'")
        for knob, value in (("keep_model_last", keep_model_last), ("keep_optim_last", keep_optim_last)):
            if value is not None and value < 1:
                raise CheckpointError(f"rl.{knob}={value}: keep at least 1 (or null to keep all)")
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
        self.wait()
        rank, world = _rank_world()
        # several ranks save synchronously: the write phase ends in barriers, which must not run in a
        # thread beside the training step's collectives
        background = self.async_save and self.fmt == "consolidated" and world == 1
        final = self.ckpt_root / iter_name(step)
        tmp = self.ckpt_root / _broadcast(f"{final.name}.tmp-{os.getpid()}", world)
        if rank == 0:
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier(world)
        try:
            snap = _take_snapshot(step, self.fmt, model, optimizer, scheduler, copy=background)
            (tmp / _state_file(rank)).write_text(state.to_json(), encoding="utf-8")
            hf_parts = _write_hf_meta(model, tokenizer, tmp) if rank == 0 else []
        except BaseException:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        states = [STATE_NAME, *(_state_file(r) for r in range(1, world))]
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


_WRITERS: dict[Path, CheckpointWriter] = {}


def save_checkpoint(  # noqa: PLR0917 (the documented positional order)
    ckpt_root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainingState,
    *,
    fmt: Format = "consolidated",
    keep_model_last: int | None = None,
    keep_optim_last: int | None = None,
    async_save: bool = False,
    tokenizer: Any = None,
) -> Path:
    """Write ``ckpt_root/iter_{step:09d}/`` (see the module docstring); returns that path.

    A module-level ``CheckpointWriter`` per ``ckpt_root`` carries async saves; join them with
    ``wait_for_pending_save()`` (the next call here joins the previous save first).
    """
    key = Path(ckpt_root).resolve()
    writer = _WRITERS.get(key)
    settings = (fmt, keep_model_last, keep_optim_last, async_save)
    if writer is None or (writer.fmt, writer.keep_model_last, writer.keep_optim_last, writer.async_save) != settings:
        if writer is not None:
            writer.wait()
        writer = CheckpointWriter(
            ckpt_root, fmt=fmt, keep_model_last=keep_model_last, keep_optim_last=keep_optim_last, async_save=async_save
        )
        _WRITERS[key] = writer
    return writer.save(step, model, optimizer, scheduler, state, tokenizer=tokenizer)


def wait_for_pending_save() -> None:
    """Join every background save started through ``save_checkpoint``; raise the first failure."""
    errors = []
    for writer in list(_WRITERS.values()):
        try:
            writer.wait()
        except CheckpointError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


# -- retention ------------------------------------------------------------------------------------


def _iter_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``iter_*`` directory, newest first."""
    if not ckpt_root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in ckpt_root.iterdir() if p.is_dir()]
    return sorted(((s, p) for s, p in found if s is not None), reverse=True)


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
    for _step, path in _iter_dirs(ckpt_root):
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


# -- verify / find / resolve ----------------------------------------------------------------------

_VERIFIED: dict[str, tuple[int, int]] = {}  # fully hashed checkpoints: path -> manifest (mtime, size)


def verify_checkpoint(path: Path, *, full: bool = True) -> list[str]:
    """Problems that make ``path`` not a complete checkpoint (empty list: it verifies).

    Checks: it is a directory, not an unfinished ``.tmp-`` save, its manifest exists and parses,
    every listed file exists with the recorded size and (``full``) the recorded sha256.
    """
    path = Path(path)
    if not path.is_dir():
        return [f"{path}: not a directory"]
    if TMP_RE.match(path.name):
        return [f"{path}: an unfinished save (.tmp- directory); it never became a checkpoint"]
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        return [str(exc)]
    mstat = (path / MANIFEST_NAME).stat()
    key, stamp = str(path.resolve()), (mstat.st_mtime_ns, mstat.st_size)
    if full and _VERIFIED.get(key) == stamp:
        full = False  # hashed earlier in this process and unchanged since: sizes suffice
    problems = [f"{path}/{p}" for p in verify_files(path, manifest, full=full)]
    if not problems and STATE_NAME not in manifest["files"]:
        problems.append(f"{path}: the manifest lists no {STATE_NAME}")
    if full and not problems:
        _VERIFIED[key] = stamp
    return problems


def _unresumable(path: Path) -> str | None:
    """Why a verified checkpoint cannot be resumed from (retention removed a part), else None."""
    pruned = read_manifest(path).get("pruned", {})
    if not pruned:
        return None
    what = " and ".join(f"its {part} state ({why})" for part, why in pruned.items())
    return f"retention removed {what}"


def find_latest_complete(ckpt_root: Path, *, full: bool = True) -> Path | None:
    """The newest resumable ``iter_*`` under ``ckpt_root``; None when there is none.

    Candidates are checked newest first by size (fast), the first that passes by hash too
    (``full``). A partial or corrupt one is skipped with a warning naming the problem, an
    unfinished ``.tmp-`` save is reported and ignored, one pruned by retention is skipped.
    """
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return None
    for tmp in sorted(p for p in ckpt_root.iterdir() if TMP_RE.match(p.name)):
        _log.warning("ignoring %s: an unfinished save (interrupted, or still being written)", tmp)
    for _step, path in _iter_dirs(ckpt_root):
        problems = verify_checkpoint(path, full=False)
        if not problems and full:
            problems = verify_checkpoint(path, full=True)
        if problems:
            _log.warning("skipping incomplete or corrupt checkpoint %s: %s", path, "; ".join(problems))
            continue
        why = _unresumable(path)
        if why:
            _log.info("skipping %s: %s", path, why)
            continue
        return path
    return None


def resolve_resume(resume: str, job_dir: Path) -> Path | None:
    """What ``rl.resume`` names: ``off`` -> None; ``auto`` -> the newest complete checkpoint of the
    newest attempt under ``job_dir`` that has one (older attempts are searched when the newer ones
    have none), None if none; otherwise an ``iter_*`` path, which must verify."""
    if resume == "off":
        return None
    if resume == "auto":
        job_dir = Path(job_dir)
        attempts = (
            sorted((p for p in job_dir.iterdir() if (p / "checkpoints").is_dir()), reverse=True)
            if job_dir.is_dir()
            else []
        )
        for attempt in attempts:
            found = find_latest_complete(attempt / "checkpoints")
            if found is not None:
                return found
        return None
    path = Path(resume).expanduser()
    if not path.exists():
        raise CheckpointError(f"rl.resume={resume!r}: no such path; use off, auto or an iter_* checkpoint directory")
    if not (path / MANIFEST_NAME).exists():
        for root in (path, path / "checkpoints"):
            newest = find_latest_complete(root) if root.is_dir() else None
            if newest is not None:
                raise CheckpointError(f"rl.resume={resume!r} is not a checkpoint; did you mean {newest}?")
    problems = verify_checkpoint(path, full=True)
    if problems:
        raise CheckpointError(
            f"rl.resume={resume!r}: refusing a checkpoint that does not verify: " + "; ".join(problems)
        )
    why = _unresumable(path)
    if why:
        raise CheckpointError(f"rl.resume={resume!r}: cannot resume: {why}")
    return path


# -- load -----------------------------------------------------------------------------------------


def _read_consolidated_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a consolidated checkpoint on the CPU, tied names restored from its aliases."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(file), framework="pt") as fh:
        aliases = json.loads((fh.metadata() or {}).get(_ALIASES_KEY, "{}"))
    tensors = load_file(str(file), device="cpu")
    for name, target in aliases.items():
        tensors[name] = tensors[target]
    return tensors


def _load_model_consolidated(path: Path, model: nn.Module) -> None:
    file = path / MODEL_FILE
    tensors = _read_consolidated_tensors(file)
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{file} does not fit this model (other model.name_or_path?): {exc}") from None


def _load_consolidated_by_name(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """A consolidated checkpoint into a sharded (or plain) model: every rank reads the full files and
    keeps its shards (``set_model_state_dict`` / ``set_optimizer_state_dict`` with full state dicts)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    file = path / MODEL_FILE
    tensors = _read_consolidated_tensors(file)
    options = StateDictOptions(full_state_dict=True)
    with _quiet_dcp():
        try:
            if optimizer is not None:
                osd = torch.load(path / OPTIM_FILE, map_location="cpu", weights_only=True)
                if read_manifest(path).get("optimizer_layout") != "fqn":
                    raise CheckpointError(
                        f"{path} was written by one process (optimizer state keyed by position); a sharded "
                        "policy resumes from checkpoints written by sharded runs (or rl.checkpoint_format=dcp)"
                    )
                set_optimizer_state_dict(model, optimizer, osd, options=options)
            set_model_state_dict(model, dict[str, Any](tensors), options=options)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: the consolidated state does not fit this model/optimizer: {exc}") from None


def _load_dcp(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    with _quiet_dcp():
        try:
            if optimizer is not None:  # before the weights: building the template may touch the optimizer
                osd = get_optimizer_state_dict(model, optimizer)
                dcp.load(osd, checkpoint_id=str(path / OPTIM_DCP))
                set_optimizer_state_dict(model, optimizer, osd)
            msd = get_model_state_dict(model)
            dcp.load(msd, checkpoint_id=str(path / MODEL_DCP))
            set_model_state_dict(model, msd)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: the DCP state does not fit this model/optimizer: {exc}") from None


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    verify: bool = True,
) -> TrainingState:
    """Restore weights (and optimizer / scheduler state when given) from ``path``; return the
    training state of this rank. Refuses a checkpoint that does not verify or was pruned."""
    path = Path(path)
    problems = verify_checkpoint(path, full=True) if verify else []
    if problems:
        raise CheckpointError(f"refusing to load {path}: " + "; ".join(problems))
    manifest = read_manifest(path)
    pruned = manifest.get("pruned", {})
    for part, needed in (("model", True), ("optimizer", optimizer is not None or scheduler is not None)):
        if needed and part in pruned:
            raise CheckpointError(f"{path}: its {part} state was removed by retention ({pruned[part]})")
    if manifest["checkpoint_format"] == "dcp":
        _load_dcp(path, model, optimizer)
    elif _is_sharded(model) or manifest.get("optimizer_layout") == "fqn":
        _load_consolidated_by_name(path, model, optimizer)
    else:
        if optimizer is not None:
            try:
                optimizer.load_state_dict(torch.load(path / OPTIM_FILE, map_location="cpu", weights_only=True))
            except (ValueError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"{path / OPTIM_FILE} does not fit this optimizer: {exc}") from None
        _load_model_consolidated(path, model)
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(path / SCHED_FILE, weights_only=True))
    return _read_state(path, manifest)


def read_training_state(path: Path) -> TrainingState:
    """This rank's training state of a checkpoint, without touching weights: lets a resume run
    ``check_resume_compatible`` before it spends time loading a large model."""
    return _read_state(Path(path), read_manifest(Path(path)))


def _read_state(path: Path, manifest: dict[str, Any]) -> TrainingState:
    rank, world = _rank_world()
    name = _state_file(rank)
    saved_world = int(manifest.get("world_size", 1))
    if world != saved_world or not (path / name).is_file():
        if world != saved_world:
            _log.warning(
                "%s was written by %d rank(s), this job has %d: every rank restores rank 0's RNG and "
                "cursors, so the resume is not exact",
                path,
                saved_world,
                world,
            )
        name = STATE_NAME
    return TrainingState.from_json((path / name).read_text(encoding="utf-8"))


# -- resume compatibility -------------------------------------------------------------------------


def _short(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return f"sha256 {value[:12]}…"
    return "none" if value is None else repr(value)


def check_resume_compatible(saved: TrainingState, current_identity: dict[str, Any], n_mini: int) -> None:
    """Refuse (``CheckpointError`` listing every difference) a resume that cannot be exact.

    The optimizer-step rule counts skipped zero-gradient updates too: the trainer does not
    advance ``optimizer_step`` on those, but they still use up one of the batch's ``n_mini`` slots.
    """
    problems = []
    attempted = saved.optimizer_step + saved.zero_grad_skips_total
    if attempted % n_mini:
        skips = (
            f" + {saved.zero_grad_skips_total} skipped zero-gradient update(s)" if saved.zero_grad_skips_total else ""
        )
        problems.append(
            f"optimizer step {saved.optimizer_step}{skips} is not a multiple of rl.n_mini={n_mini}: the "
            "checkpoint does not sit on a collected-batch boundary"
        )
    # the saved side went through JSON (tuples became lists): compare like with like
    old, new = saved.identity, json.loads(json.dumps(current_identity, default=_json_default))
    if old.get("data_seed") != new.get("data_seed"):
        problems.append(
            f"data seed changed: the checkpoint was written with {old.get('data_seed')!r}, this run uses "
            f"{new.get('data_seed')!r} (rl.seed, or rollout.seed with rl.data_seed_follows_rollout_seed)"
        )
    old_obj, new_obj = old.get("objective") or {}, new.get("objective") or {}
    changed = [
        f"{k} {old_obj.get(k)!r} -> {new_obj.get(k)!r}"
        for k in sorted(set(old_obj) | set(new_obj))
        if old_obj.get(k) != new_obj.get(k)
    ]
    if changed:
        problems.append("objective identity changed: " + ", ".join(changed))
    if old.get("ref_anchor") != new.get("ref_anchor"):
        problems.append(
            f"reference anchor changed (content of rl.ref.model_dir): {_short(old.get('ref_anchor'))} -> "
            f"{_short(new.get('ref_anchor'))}"
        )
    for key in sorted((set(old) | set(new)) - {"data_seed", "objective", "ref_anchor"}):
        if old.get(key) != new.get(key):
            label = "rl.n_mini" if key == "n_mini" else key
            problems.append(f"{label} changed: {_difference(old.get(key), new.get(key))}")
    if problems:
        raise CheckpointError(
            "cannot resume exactly from this checkpoint:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nrestore the original settings, or start fresh with rl.resume=off"
        )


def _difference(old: Any, new: Any) -> str:
    """``old -> new``; for two dicts only the entries that differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return ", ".join(f"{k} {_short(old.get(k))} -> {_short(new.get(k))}" for k in keys)
    return f"{old!r} -> {new!r}"


def anchor_hash(model_dir: str | Path | None) -> str | None:
    """sha256 over the sorted (relative path, sha256) of every file in ``model_dir``; None for None.

    Reads every byte (a multi-GB reference takes seconds): it is computed once per attempt.
    """
    if model_dir is None:
        return None
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"rl.ref.model_dir={str(model_dir)!r} is not a directory")
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(root).as_posix()}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def resume_identity(cfg: GRPOConfig) -> dict[str, Any]:
    """The identity ``check_resume_compatible`` compares, built from a config."""
    from posttrain.policy.trainer import objective_spec

    return {
        "data_seed": cfg.data_seed,
        "objective": dataclasses.asdict(objective_spec(cfg)),
        "ref_anchor": anchor_hash(cfg.rl.ref.model_dir),
        "n_mini": cfg.rl.n_mini,
        **cfg.resume_identity_extra(),  # a config type may pin more (OPD: the teacher and its knobs)
    }


__all__ = [
    "LATEST_NAME",
    "CheckpointWriter",
    "TrainingState",
    "anchor_hash",
    "apply_retention",
    "check_resume_compatible",
    "checkpoint_step",
    "find_latest_complete",
    "iter_name",
    "load_checkpoint",
    "read_latest_pointer",
    "read_training_state",
    "resolve_resume",
    "resume_identity",
    "save_checkpoint",
    "verify_checkpoint",
    "wait_for_pending_save",
]
