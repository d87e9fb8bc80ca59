"""``posttrain export-hf CHECKPOINT OUT_DIR``: a checkpoint as a separate Hugging Face model directory.

Optional for ``consolidated`` checkpoints of Hugging Face models: their ``iter_*`` directory loads
as is (``posttrain.checkpoint.hf_dir``). Export is for a ``dcp`` checkpoint, a checkpoint without a
stored config (``base_model_dir``), or a directory of just the model files to hand on. The output
(``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer files) loads
with ``AutoModelForCausalLM.from_pretrained`` and in vLLM. The config and tokenizer come from the
checkpoint (beside the weights; under ``hf/`` in checkpoints written before that layout), which
``CheckpointWriter`` writes for Hugging Face models (the tokenizer when the loop passes it);
``base_model_dir`` supplies them for a checkpoint without them (or adds a tokenizer that was not stored).
Every file is verified by size and sha256 first, whatever ``rl.checkpoint_verify`` says.

The weights go through a freshly built model (``from_config``) and ``save_pretrained``: both
checkpoint formats load the same way ``load_checkpoint`` does, a mismatch between weights and
config fails loudly instead of writing a directory that loads wrong, and tied weights, names and
file metadata come out the way transformers itself writes them.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from posttrain.checkpoint import CheckpointError
from posttrain.checkpoint.hf_dir import meta_dir
from posttrain.checkpoint.manifest import MANIFEST_NAME, read_manifest
from posttrain.checkpoint.reader import find_latest_complete, load_checkpoint, verify_checkpoint

_log = logging.getLogger("posttrain.checkpoint")

_NOT_SIDE_FILES = ("config.json", "adapter_config.json")  # the adapter's config describes no merged model
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".index.json")


def _resolve_checkpoint(path: Path) -> Path:
    """An ``iter_*`` directory as given, or the newest complete one under a checkpoints/run directory."""
    if (path / MANIFEST_NAME).is_file():
        return path
    for root in (path, path / "checkpoints"):
        newest = find_latest_complete(root) if root.is_dir() else None
        if newest is not None:
            _log.info("exporting %s, the newest complete checkpoint under %s", newest, path)
            return newest
    raise CheckpointError(f"{path}: neither a checkpoint (no {MANIFEST_NAME}) nor a directory holding one")


def _meta_dir(ckpt: Path, base_model_dir: str | None) -> Path:
    """Where config.json and the tokenizer come from."""
    stored = meta_dir(ckpt)
    if stored is not None:
        return stored
    if base_model_dir is None:
        raise CheckpointError(
            f"{ckpt} stores no Hugging Face config (config.json): it was not saved from a transformers "
            "model; pass base_model_dir (--base-model-dir) pointing at the model it was trained from"
        )
    base = Path(base_model_dir).expanduser()
    if not (base / "config.json").is_file():
        raise CheckpointError(f"base_model_dir={base_model_dir!r} holds no config.json")
    return base


def _copy_side_files(src: Path, dst: Path, *, overwrite: bool) -> list[str]:
    """Tokenizer files, generation config, chat template...: everything but weights and config.json."""
    copied = []
    for file in sorted(src.iterdir()):
        if not file.is_file() or file.name in _NOT_SIDE_FILES or file.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if overwrite or not (dst / file.name).exists():
            shutil.copy2(file, dst / file.name)
            copied.append(file.name)
    return copied


def export_hf(checkpoint: Path, out_dir: Path, *, base_model_dir: str | None = None) -> Path:
    """Write ``out_dir`` as a Hugging Face model directory holding ``checkpoint``'s weights.

    ``checkpoint`` is an ``iter_*`` directory (or a ``checkpoints/`` / run directory: its newest
    complete checkpoint). ``out_dir`` must not exist or be empty; it appears complete or not at all.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = _resolve_checkpoint(Path(checkpoint))
    problems = verify_checkpoint(ckpt, full=True)
    if problems:
        raise CheckpointError(f"refusing to export {ckpt}: " + "; ".join(problems))
    manifest = read_manifest(ckpt)
    if "model" in manifest.get("pruned", {}):
        raise CheckpointError(f"{ckpt}: its weights were removed by retention ({manifest['pruned']['model']})")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not empty; remove it or choose another output directory")
    meta = _meta_dir(ckpt, base_model_dir)
    dtype = manifest.get("model_dtype")
    if (meta / "adapter_config.json").is_file():  # a LoRA checkpoint: the adapter merged into its base
        from posttrain.models.lora import adapter_policy, checkpoint_module

        policy = adapter_policy(meta, base_model_dir, getattr(torch, dtype) if dtype else None)
        load_checkpoint(ckpt, checkpoint_module(policy), verify=False)
        model = policy.merge_and_unload()
    else:
        config = AutoConfig.from_pretrained(str(meta), local_files_only=True)
        model = AutoModelForCausalLM.from_config(config)
        if dtype:
            model.to(getattr(torch, dtype))
        load_checkpoint(ckpt, model, verify=False)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        _copy_side_files(meta, tmp, overwrite=True)
        if base_model_dir is not None and meta != Path(base_model_dir).expanduser():
            _copy_side_files(Path(base_model_dir).expanduser(), tmp, overwrite=False)  # e.g. a tokenizer
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not any(out.glob("tokenizer*")):
        _log.warning("%s has no tokenizer files: pass base_model_dir to add the tokenizer", out)
    return out


def export_main(argv: Sequence[str]) -> int:
    """``posttrain export-hf CHECKPOINT OUT_DIR [--base-model-dir DIR]``."""
    import argparse

    from posttrain.errors import PosttrainError

    parser = argparse.ArgumentParser(
        prog="posttrain export-hf", description="Write a checkpoint as a Hugging Face model directory."
    )
    parser.add_argument("checkpoint", help="an iter_* directory, or a checkpoints/ or run directory (newest)")
    parser.add_argument("out_dir", help="new output directory")
    parser.add_argument("--base-model-dir", default=None, help="config/tokenizer source for checkpoints without hf/")
    args = parser.parse_args(list(argv))
    try:
        path = export_hf(Path(args.checkpoint), Path(args.out_dir), base_model_dir=args.base_model_dir)
    except (PosttrainError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(export_main(sys.argv[1:]))
