"""Grouped-query attention without copying the keys and values, in a CPU forward without autograd.

transformers' SDPA path repeats every key/value head for its query heads (``repeat_kv``: a copy of
the whole cache, per layer, per forward) unless no attention mask is passed, because CUDA's fused
kernels take no mask with grouped heads. torch's CPU kernel does take one
(``scaled_dot_product_attention(..., enable_gqa=True)``) and its forward computes exactly the same
numbers: the same dot products in the same order (``tests/unit/test_cpu_attention.py`` checks it
bitwise). Its backward does not: it sums the grouped heads' key/value gradients in another order,
so the change is limited to forwards without autograd, which are bitwise the same. Masked attention
without autograd is what the transformers rollout engine runs at every decode step (left-padded
prompts), so on the CPU default job the copies were a measurable share of the rollout.

``use_grouped_sdpa_on_cpu`` changes transformers' one decision for CPU tensors outside autograd
only; everything else keeps transformers' own answer. Idempotent; a transformers without that
helper is left as is.
"""

from __future__ import annotations

from typing import Any

__all__ = ["use_grouped_sdpa_on_cpu"]

_PATCHED_FLAG = "_posttrain_cpu_gqa"


def use_grouped_sdpa_on_cpu() -> bool:
    """Let SDPA take grouped key/value heads directly in CPU forwards without autograd; returns whether
    it is in effect."""
    import torch

    try:
        from transformers.integrations import sdpa_attention
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        return False
    original = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if original is None or not _torch_has_enable_gqa(torch):
        return False
    if getattr(original, _PATCHED_FLAG, False):
        return True

    def use_gqa_in_sdpa(attention_mask: Any, key: Any, *args: Any, **kwargs: Any) -> bool:
        if key.device.type == "cpu" and not torch.is_grad_enabled():
            return True
        return bool(original(attention_mask, key, *args, **kwargs))

    setattr(use_gqa_in_sdpa, _PATCHED_FLAG, True)
    sdpa_attention.use_gqa_in_sdpa = use_gqa_in_sdpa
    return True


def _torch_has_enable_gqa(torch: Any) -> bool:
    """``enable_gqa`` arrived in torch 2.5."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)
