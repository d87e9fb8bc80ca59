"""Run lifecycle: checkpoints (save, verify, resume, retention), RNG state, provenance, HF export, stop signals.

Layout of one attempt's checkpoints (``<run dir>/checkpoints/``)::

    iter_000000010/            one complete checkpoint (collected batch 10)
      model.safetensors        consolidated weights            | model_dcp/  (rl.checkpoint_format=dcp)
      optimizer.pt             optimizer state                 | optim_dcp/
      scheduler.pt             LR-schedule state
      training_state.json      counters, data cursor, engine state, RNG, run identity
      config.json, ...         generation_config.json, tokenizer files (HF models only): with them a
                               consolidated checkpoint is a model directory transformers and vLLM load
      manifest.json            written LAST: every file's size and sha256
    iter_000000020.tmp-4242/   a save in progress (or interrupted): never resumed from
    latest_checkpoint.txt      names the newest complete iter_* directory, rewritten after each save

Modules, one job each: ``layout`` (names, the latest pointer, ``TrainingState``), ``manifest``
(the file list written last, hashing), ``snapshot`` (what a save captures before it returns),
``writer`` (payload, publish, async saves, retention: ``CheckpointWriter``), ``hf_dir`` (the
Hugging Face files), ``reader`` (verify, find the newest complete one, resolve ``rl.resume``,
load), ``rng``, ``provenance``, ``export`` (``posttrain export-hf``) and ``graceful_stop``
(SIGTERM / SIGINT). What a resume must keep unchanged (the run identity) is the loop's policy:
``posttrain.loop.resume``; this package stores that identity without interpreting it.

This package module imports nothing heavy: ``provenance`` is stdlib-only so that stamping a run and
``python -m posttrain.checkpoint.provenance`` never import torch. The names below are re-exported
lazily from the submodules that define them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.errors import PosttrainError

if TYPE_CHECKING:  # the lazy names, for type checkers
    from posttrain.checkpoint.export import export_hf
    from posttrain.checkpoint.graceful_stop import GracefulStop
    from posttrain.checkpoint.layout import TrainingState
    from posttrain.checkpoint.provenance import collect_provenance, hash_tree, write_provenance
    from posttrain.checkpoint.reader import (
        find_latest_complete,
        load_checkpoint,
        read_training_state,
        resolve_resume,
        verify_checkpoint,
    )
    from posttrain.checkpoint.rng import capture_rng, restore_rng
    from posttrain.checkpoint.writer import CheckpointWriter


class CheckpointError(PosttrainError):
    """A checkpoint cannot be written, is incomplete or corrupt, or does not fit the current run."""


_LAZY = {
    "TrainingState": "layout",
    "CheckpointWriter": "writer",
    "find_latest_complete": "reader",
    "verify_checkpoint": "reader",
    "load_checkpoint": "reader",
    "read_training_state": "reader",
    "resolve_resume": "reader",
    "capture_rng": "rng",
    "restore_rng": "rng",
    "collect_provenance": "provenance",
    "write_provenance": "provenance",
    "hash_tree": "provenance",
    "export_hf": "export",
    "GracefulStop": "graceful_stop",
}

__all__ = [  # noqa: RUF022 (grouped by submodule, like _LAZY)
    "CheckpointError",
    "TrainingState",
    "CheckpointWriter",
    "find_latest_complete",
    "verify_checkpoint",
    "load_checkpoint",
    "read_training_state",
    "resolve_resume",
    "capture_rng",
    "restore_rng",
    "collect_provenance",
    "write_provenance",
    "hash_tree",
    "export_hf",
    "GracefulStop",
]


def __getattr__(name: str) -> Any:
    """Import the defining submodule on first use (keeps ``import posttrain.checkpoint`` cheap)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'posttrain.checkpoint' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"posttrain.checkpoint.{module}"), name)
