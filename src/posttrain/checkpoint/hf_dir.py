"""A checkpoint as a Hugging Face model directory: the weights file and the side files beside it.

A ``consolidated`` checkpoint directory loads as is with ``AutoModelForCausalLM.from_pretrained``
and in vLLM (``LLM(model=<iter_* dir>)``), so ``posttrain export-hf`` is optional:

* ``model.safetensors`` holds each tied weight once under its first name (``lm_head.weight`` tied to
  ``model.embed_tokens.weight`` is stored as the latter, as ``save_pretrained`` does; the loaders
  re-tie it from ``tie_word_embeddings``), the parameter names of the model class, and the header
  metadata ``format: pt`` (which older transformers require) plus ``posttrain_aliases`` (the tied
  names, for posttrain's own strict load);
* ``config.json`` states the dtype the weights are stored in (a model loaded in bfloat16 and trained
  with fp32 master weights is stored in float32 and says so, so that a plain load reproduces it) and
  names the model class in ``architectures`` (vLLM picks its implementation from it);
* ``generation_config.json`` and the tokenizer files when there are any.

The other files of the checkpoint (``optimizer.pt``, ``scheduler.pt``, ``training_state*.json``,
``manifest.json``) are ignored by both loaders. Checkpoints written before this layout kept the side
files under ``hf/``, as a LoRA policy's adapter checkpoint still does (its weights file holds the
adapter alone); ``posttrain export-hf`` reads them there.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.checkpoint.layout import ALIASES_KEY, HF_DIR
from posttrain.checkpoint.manifest import list_files

if TYPE_CHECKING:
    import torch
    from torch import nn


def write_model_file(tensors: dict[str, torch.Tensor], aliases: dict[str, str], path: Path) -> None:
    """``tensors`` as a safetensors file with the metadata the loaders read, byte-for-byte the same for
    the same tensors (see ``_sort_header_metadata``)."""
    from safetensors.torch import save_file

    metadata = {"format": "pt", ALIASES_KEY: json.dumps(aliases, sort_keys=True)}
    save_file(tensors, str(path), metadata=metadata)
    _sort_header_metadata(path)


def _sort_header_metadata(path: Path) -> None:
    """Rewrite the header's metadata keys in sorted order, in place.

    safetensors serialises the metadata from a hash map, so with two keys the same tensors could be
    written as different bytes (and different manifest hashes) from one save to the next. Reordering
    keys does not change the header's length, so the data offsets stay valid; should the re-encoding
    differ in length from what safetensors wrote (an escaping this code does not reproduce), the file
    is left as written: still valid, only not byte-stable.
    """
    with open(path, "r+b") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        raw = fh.read(length)
        header = json.loads(raw)
        meta = header.get("__metadata__")
        if not isinstance(meta, dict) or len(meta) < 2:
            return
        header["__metadata__"] = dict(sorted(meta.items()))
        encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        body = raw.rstrip(b" ")  # safetensors pads the header with spaces to a multiple of 8 bytes
        if len(encoded) != len(body) or encoded == body:
            return
        fh.seek(8)
        fh.write(encoded)


def _architecture(model: nn.Module) -> str:
    """The model's class name, not FSDP2's wrapper subclass (``FSDPLlamaForCausalLM``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def write_side_files(model: nn.Module, tokenizer: Any, root: Path, *, dtype: str | None) -> list[str]:
    """The Hugging Face side files (whatever exists: config, generation config, tokenizer); returns
    the manifest's ``hf`` part. Nothing for a model without a Hugging Face config.

    A transformers model's go beside the weights, ``config.json`` stating ``dtype`` (the stored
    weights' dtype, when they have one), so that the checkpoint is a model directory. Any other
    module with a ``config.save_pretrained`` (a LoRA policy's adapter view, whose weights file holds
    the adapter alone and must not pass for a whole model) keeps them under ``hf/``, as before.
    """
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return []
    if not isinstance(model, PreTrainedModel):
        where = root / HF_DIR
        _save_side_files(config, model, tokenizer, where)
        return [HF_DIR]
    before = set(list_files(root))
    config = copy.deepcopy(config)  # the live model's config stays as it is
    if dtype is not None:
        config.dtype = dtype
    if not getattr(config, "architectures", None):
        config.architectures = [_architecture(model)]
    _save_side_files(config, model, tokenizer, root)
    return sorted(set(list_files(root)) - before)


def _save_side_files(config: Any, model: nn.Module, tokenizer: Any, where: Path) -> None:
    config.save_pretrained(where)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(where)
    if tokenizer is not None:
        tokenizer.save_pretrained(where)


def meta_dir(ckpt: Path) -> Path | None:
    """Where a checkpoint's ``config.json`` and tokenizer are: the checkpoint itself, ``hf/`` for one
    written before the side files moved beside the weights, None when it stores none."""
    for where in (ckpt, ckpt / HF_DIR):
        if (where / "config.json").is_file():
            return where
    return None
