"""How received weights reach an in-process vLLM model: written in place, or through vLLM's reload.

vLLM's ``reload_weights`` (checkpoint format) is the general path: it puts each layer back on the
meta device, loads the new tensors into fresh storage, redoes the layer's post-load processing
(repacking on CPU, quantization, expert layouts) and copies the result into the tensors the CUDA
graphs captured. For a plain dense model on CUDA none of that processing does anything
(``UnquantizedLinearMethod`` and ``UnquantizedEmbeddingMethod`` process weights only on the CPU
platform, vLLM 0.24), so the model's own ``load_weights`` (its weight loaders shard and fuse the
Hugging Face tensors straight into the existing parameters) gives the same weights with one copy per
tensor and no allocation. Its Python per tensor is the rest of the small step's sync, which the copy
plan (``rollout/vllm_copy_plan.py``) replaces from the second sync on.

``loads_in_place`` decides, once per engine, whether a model is such a plain model; anything else
(quantized layers, fused experts, a vision tower, an unknown quantization method) keeps the reload.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

# vLLM's quantization methods whose post-load processing is a no-op off the CPU platform.
PLAIN_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})


def loads_in_place(model: torch.nn.Module, *, cuda: bool) -> bool:
    """Whether writing checkpoint tensors with ``model.load_weights`` leaves ``model`` exactly as
    ``reload_weights`` would: on CUDA, a model whose every quantization method is a plain one and that
    has no fused-expert layer and no multimodal tower."""
    if not cuda:  # the CPU build repacks linear weights after loading (and drops the originals)
        return False
    if hasattr(model, "get_language_model") or hasattr(model, "visual"):  # vision-language wrappers
        return False
    for module in model.modules():
        if "MoE" in type(module).__name__:  # FusedMoE and its kin lay experts out after loading
            return False
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in PLAIN_METHODS:
            return False
    return True


def load_in_place(pairs: Sequence[tuple[str, torch.Tensor]]) -> Callable[[torch.nn.Module], list[str]]:
    """A function for ``LLM.apply_model``: loads ``pairs`` (Hugging Face names) into the model it is
    given through the model's own weight loaders; returns the names of the parameters it did not
    write (so the caller refuses a partial transfer)."""

    def apply(model: torch.nn.Module) -> list[str]:
        loader: Callable[..., set[str] | None] = model.load_weights  # type: ignore[assignment]
        with torch.no_grad():
            written = loader(iter(pairs))
        if written is None:  # a model class whose load_weights reports nothing: cannot be checked
            return []
        return sorted({name for name, _ in model.named_parameters()} - set(written))

    return apply


def checkpoint_tensor_names(model_dir: str) -> set[str]:
    """Names of the tensors in ``model_dir``'s safetensors files: what a complete transfer covers
    (empty when the checkpoint is not in safetensors, and then nothing is checked)."""
    names: set[str] = set()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names
