"""Run lifecycle: checkpoints (save, verify, resume, retention), RNG state, provenance, HF export, signals.

Layout of one attempt's checkpoints (``<run dir>/checkpoints/``)::

    iter_000000010/            one complete checkpoint (collected batch 10)
      model.safetensors        consolidated weights            | model_dcp/  (rl.checkpoint_format=dcp)
      optimizer.pt             optimizer state                 | optim_dcp/
      scheduler.pt             LR-schedule state
      training_state.json      counters, data cursor, engine state, RNG, run identity
      hf/                      config.json, generation_config.json, tokenizer files (HF models only)
      manifest.json            written LAST: every file's size and sha256
    iter_000000020.tmp-4242/   a save in progress (or interrupted): never resumed from
    latest_checkpoint.txt      names the newest complete iter_* directory, rewritten after each save

This package module imports nothing heavy: ``provenance`` is stdlib-only so that stamping a run and
``python -m posttrain.checkpoint.provenance`` never import torch. The names below are re-exported
lazily from the submodules that define them.
"""

from __future__ import annotations

from typing import Any

from posttrain.errors import PosttrainError


class CheckpointError(PosttrainError):
    """A checkpoint cannot be written, is incomplete or corrupt, or does not fit the current run."""


_LAZY = {
    "TrainingState": "store",
    "CheckpointWriter": "store",
    "save_checkpoint": "store",
    "wait_for_pending_save": "store",
    "find_latest_complete": "store",
    "verify_checkpoint": "store",
    "load_checkpoint": "store",
    "read_training_state": "store",
    "check_resume_compatible": "store",
    "resolve_resume": "store",
    "anchor_hash": "store",
    "resume_identity": "store",
    "capture_rng": "rng",
    "restore_rng": "rng",
    "collect_provenance": "provenance",
    "write_provenance": "provenance",
    "hash_tree": "provenance",
    "export_hf": "export",
    "GracefulStop": "signals",
}

__all__ = [  # noqa: RUF022 (grouped by submodule, like _LAZY)
    "CheckpointError",
    "TrainingState",
    "CheckpointWriter",
    "save_checkpoint",
    "wait_for_pending_save",
    "find_latest_complete",
    "verify_checkpoint",
    "load_checkpoint",
    "read_training_state",
    "check_resume_compatible",
    "resolve_resume",
    "anchor_hash",
    "resume_identity",
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
