"""A checkpoint's on-disk layout: directory and file names, the latest pointer, the training state.

Formats (``rl.checkpoint_format``):

* ``consolidated``: ``model.safetensors`` (tied weights stored once, the aliases in the file's
  metadata), ``optimizer.pt`` (``optimizer.state_dict()``), ``scheduler.pt``. One process writes.
  An FSDP2-sharded policy (several ranks) is gathered to rank 0 first, which writes the full
  weights and the full optimizer state keyed by parameter name (``optimizer_layout: fqn`` in the
  manifest; loaded with ``set_optimizer_state_dict``); every rank still writes its own training state.
  For a transformers model the directory is a Hugging Face model directory that
  ``from_pretrained`` and vLLM load as is (``posttrain.checkpoint.hf_dir``).
* ``dcp``: ``model_dcp/`` and ``optim_dcp/`` written with ``torch.distributed.checkpoint`` (every
  rank writes its own shards; in a single process it works without a process group). Model and
  optimizer are separate DCP directories so retention can drop one without the other.

Both also hold ``training_state.json`` (counters, data cursor, engine state, RNG, run identity;
rank r > 0 of a multi-rank job adds ``training_state.rank<r>.json`` for its own RNG and cursors)
and, for Hugging Face models, their side files (``config.json``, ``generation_config.json``, the
tokenizer) beside the weights, so that ``posttrain export-hf`` needs nothing but the checkpoint.
Checkpoints written before that layout, and a LoRA policy's adapter checkpoints, keep the side
files under ``hf/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from posttrain.checkpoint import CheckpointError
from posttrain.checkpoint.manifest import fsync_dir

Format = Literal["consolidated", "dcp"]
LATEST_NAME = "latest_checkpoint.txt"
STATE_NAME = "training_state.json"
MODEL_FILE, MODEL_DCP = "model.safetensors", "model_dcp"
OPTIM_FILE, OPTIM_DCP = "optimizer.pt", "optim_dcp"
SCHED_FILE = "scheduler.pt"
HF_DIR = "hf"
ITER_RE = re.compile(r"^iter_(\d+)$")
TMP_RE = re.compile(r"^iter_(\d+)\.tmp-\d+$")
ALIASES_KEY = "posttrain_aliases"
"""The one ``model.safetensors`` metadata key: the tied names stored once, as ``{alias: target}``."""


# -- names ----------------------------------------------------------------------------------------


def iter_name(step: int) -> str:
    """The directory name of the checkpoint after ``step`` collected batches."""
    return f"iter_{step:09d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of an ``iter_*`` directory name, else None."""
    match = ITER_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def state_file(rank: int) -> str:
    """The training-state file of policy rank ``rank`` (rank 0's is the one every reader can use)."""
    return STATE_NAME if rank == 0 else f"training_state.rank{rank:05d}.json"


def iter_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``iter_*`` directory, newest first."""
    if not ckpt_root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in ckpt_root.iterdir() if p.is_dir()]
    return sorted(((s, p) for s, p in found if s is not None), reverse=True)


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns on every call that it runs without a process group: intended here, so silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


# -- the latest pointer -----------------------------------------------------------------------------


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


# -- the training state -----------------------------------------------------------------------------


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
                json.dumps(value, default=json_default)
            except (TypeError, ValueError) as exc:
                raise CheckpointError(
                    f"TrainingState.{name} is not JSON-serialisable ({exc}); state dicts must hold plain "
                    "numbers, strings, lists and dicts"
                ) from None
        return json.dumps(tree, default=json_default, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrainingState:
        """The inverse of ``to_json`` (unknown keys are refused, a missing ``extra`` is empty)."""
        tree = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(tree) - names)
        if unknown:
            raise CheckpointError(f"training state has unknown fields {unknown}: written by a newer posttrain?")
        return cls(**tree)


def json_default(value: Any) -> Any:
    """``json.dumps``'s ``default`` for training states: NumPy scalars and 0-d tensors become Python
    numbers; anything else is refused."""
    shape = getattr(value, "shape", None)
    if callable(getattr(value, "item", None)) and shape is not None and len(shape) == 0:
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
