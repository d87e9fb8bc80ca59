"""Checkpoints read back: verify one, find the newest complete one, resolve ``rl.resume``, load.

Only a directory whose manifest exists and whose every listed file has the recorded size (and, when
asked, the recorded hash) counts as a checkpoint: a half-written ``.tmp-`` save, a corrupt one or one
that retention pruned is never resumed from (skipped with a warning when searching, refused when
named). How much a load checks is ``Verify`` (``rl.checkpoint_verify``): ``size`` trusts the
manifest, which is written last, after every file was fsync'ed, so a save that did not finish has
none, and checks that every file it lists exists with its recorded size (a truncated or missing
file); ``hash`` also reads every byte and compares its sha256 (a same-size corruption: bit rot, a
file overwritten in place). The library functions default to ``hash``; the loop passes the config's.

Exactness: on CPU a resumed run continues bitwise (weights, optimizer moments and step counts,
schedule, RNG, data cursor and sampling-call counter are all restored). On GPUs the state is
restored just as exactly, but nondeterministic kernels (atomics in attention / matmul backward)
already make two uninterrupted runs differ, so a resume matches only as closely as those do.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from posttrain.checkpoint import CheckpointError
from posttrain.checkpoint.layout import (
    ALIASES_KEY,
    MODEL_DCP,
    MODEL_FILE,
    OPTIM_DCP,
    OPTIM_FILE,
    SCHED_FILE,
    STATE_NAME,
    TMP_RE,
    TrainingState,
    iter_dirs,
    quiet_dcp,
    state_file,
)
from posttrain.checkpoint.manifest import MANIFEST_NAME, read_manifest, verify_files
from posttrain.distributed.world import rank_and_world

if TYPE_CHECKING:
    from torch import nn

_log = logging.getLogger("posttrain.checkpoint")

Verify = Literal["size", "hash"]
"""How a checkpoint is verified before it is used: sizes against the manifest, or sizes and sha256."""

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


Skipped = list[tuple[Path, str]]
"""``(checkpoint, why it was skipped)``, collected by ``find_latest_complete`` / ``resolve_resume``."""


def find_latest_complete(ckpt_root: Path, *, full: bool = True, skipped: Skipped | None = None) -> Path | None:
    """The newest resumable ``iter_*`` under ``ckpt_root``; None when there is none.

    Candidates are checked newest first by size (fast), the first that passes by hash too
    (``full``). A partial or corrupt one is skipped with a warning naming the problem, an
    unfinished ``.tmp-`` save is reported and ignored, one pruned by retention is skipped; each
    skipped checkpoint is appended to ``skipped`` (when given) with the reason.
    """
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return None
    for tmp in sorted(p for p in ckpt_root.iterdir() if TMP_RE.match(p.name)):
        _log.warning("ignoring %s: an unfinished save (interrupted, or still being written)", tmp)
    for _step, path in iter_dirs(ckpt_root):
        problems = verify_checkpoint(path, full=False)
        if not problems and full:
            problems = verify_checkpoint(path, full=True)
        if problems:
            _log.warning("skipping incomplete or corrupt checkpoint %s: %s", path, "; ".join(problems))
            if skipped is not None:
                skipped.append((path, "incomplete or corrupt: " + "; ".join(problems)))
            continue
        why = _unresumable(path)
        if why:
            _log.info("skipping %s: %s", path, why)
            if skipped is not None:
                skipped.append((path, why))
            continue
        return path
    return None


def describe_fresh_start(skipped: Skipped) -> str:
    """The log line of an ``rl.resume=auto`` run that found nothing to resume from."""
    if not skipped:
        return "rl.resume=auto: no complete checkpoint of this job yet, starting fresh"
    corrupt = [(p, why) for p, why in skipped if why.startswith("incomplete or corrupt")]
    pruned = [(p, why) for p, why in skipped if not why.startswith("incomplete or corrupt")]
    parts = []
    if corrupt:
        parts.append(
            f"{len(corrupt)} corrupt or incomplete checkpoint(s) found and skipped: "
            + "; ".join(
                f"{p} ({why.removeprefix('incomplete or corrupt: ').replace(f'{p}/', '')})" for p, why in corrupt
            )
        )
    if pruned:
        parts.append(
            f"{len(pruned)} checkpoint(s) that retention pruned: " + "; ".join(f"{p} ({why})" for p, why in pruned)
        )
    return f"rl.resume=auto: no resumable checkpoint of this job: {'. '.join(parts)}. Starting fresh"


def resolve_resume(
    resume: str, job_dir: Path, *, skipped: Skipped | None = None, verify: Verify = "hash"
) -> Path | None:
    """What ``rl.resume`` names: ``off`` -> None; ``auto`` -> the newest complete checkpoint of the
    newest attempt under ``job_dir`` that has one (older attempts are searched when the newer ones
    have none), None if none; otherwise an ``iter_*`` path, which must verify (``verify``: sizes, or
    sizes and hashes). ``skipped``: see ``find_latest_complete`` (for ``auto``)."""
    full = verify == "hash"
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
            found = find_latest_complete(attempt / "checkpoints", full=full, skipped=skipped)
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
    problems = verify_checkpoint(path, full=full)
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
        aliases = json.loads((fh.metadata() or {}).get(ALIASES_KEY, "{}"))
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
    with quiet_dcp():
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

    with quiet_dcp():
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
    verify: Verify | bool = "hash",
) -> TrainingState:
    """Restore weights (and optimizer / scheduler state when given) from ``path``; return the
    training state of this rank. Refuses a checkpoint that does not verify (``verify``: ``size``,
    ``hash``; ``True`` is ``hash``, ``False`` checks nothing, for a caller that verified already)
    or was pruned."""
    from posttrain.distributed.fsdp import is_sharded

    path = Path(path)
    problems = verify_checkpoint(path, full=verify in ("hash", True)) if verify is not False else []
    if problems:
        raise CheckpointError(f"refusing to load {path}: " + "; ".join(problems))
    manifest = read_manifest(path)
    pruned = manifest.get("pruned", {})
    for part, needed in (("model", True), ("optimizer", optimizer is not None or scheduler is not None)):
        if needed and part in pruned:
            raise CheckpointError(f"{path}: its {part} state was removed by retention ({pruned[part]})")
    if manifest["checkpoint_format"] == "dcp":
        _load_dcp(path, model, optimizer)
    # A sharded policy (several ranks) loads each tensor by name into its shards; so does one process
    # reading a checkpoint that a sharded run wrote (its optimizer state is keyed by name, not index).
    elif is_sharded(model) or manifest.get("optimizer_layout") == "fqn":
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
    """This rank's training state of a checkpoint, without touching weights: lets a resume check the
    run identity (``posttrain.loop.resume``) before it spends time loading a large model."""
    return _read_state(Path(path), read_manifest(Path(path)))


def _read_state(path: Path, manifest: dict[str, Any]) -> TrainingState:
    rank, world = rank_and_world()
    name = state_file(rank)
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


__all__ = [
    "Verify",
    "describe_fresh_start",
    "find_latest_complete",
    "load_checkpoint",
    "read_training_state",
    "resolve_resume",
    "verify_checkpoint",
]


def verify_main(argv: list[str]) -> int:
    """``python -m posttrain.checkpoint.reader CHECKPOINT...``: every file of each checkpoint against
    its manifest, sizes and sha256 (whatever ``rl.checkpoint_verify`` says); exit status 1 if any fails."""
    if not argv:
        print("usage: python -m posttrain.checkpoint.reader CHECKPOINT...  (iter_* directories)", file=sys.stderr)
        return 2
    status = 0
    for arg in argv:
        problems = verify_checkpoint(Path(arg), full=True)
        print(f"{arg}: " + ("ok (sizes and sha256 match the manifest)" if not problems else "; ".join(problems)))
        status |= bool(problems)
    return status


if __name__ == "__main__":
    sys.exit(verify_main(sys.argv[1:]))
