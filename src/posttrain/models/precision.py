"""The run's precision: the dtype parameters are stored in and the dtype the forward computes in.

``model.dtype`` is the parameter (storage) dtype: weights, gradients and optimizer state.
``model.compute_dtype`` is the dtype of the forward and backward arithmetic. When the two differ
("mixed": fp32 master weights, bf16 compute) an FSDP2-sharded module computes through its
``MixedPrecisionPolicy`` (``distributed.fsdp.shard_policy``: parameters cast to bf16 once per
gather, the whole forward in bf16, gradients reduced in fp32), and an unsharded one computes the
same way through ``compute_weights``: each parameter read as one bf16 copy, whose gradient comes
back to the fp32 parameter in fp32 (the update casts once per mini-batch, and every micro-batch's
forward and backward reads the same copies). Not ``torch.autocast``: autocast leaves the
embeddings, norms and residual stream in fp32 (only matrix products drop to bf16); on an H200 the
0.4B update took 0.878 s under it, 0.823 s on the copies and 0.802 s with pure bf16 weights, with
4 GiB more peak memory under autocast (docs/benchmarks.md, "Issue 18, fifth session").
The logprob head still upcasts its logits to fp32. When the two dtypes are equal nothing is
entered at all, so the fp32 CPU path computes exactly what it did before mixed precision existed.

``auto`` defaults: parameters in fp32 everywhere; compute in bf16 on CUDA when the parameters are
fp32 (tensor cores, half the activation memory) and in the parameter dtype otherwise (CPU bf16
matmuls are slow). ``precision_conflict`` imports no torch, so the preflight can call it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import torch
    from torch import nn

_CANONICAL = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_CANONICAL |= {"float16": "float16", "fp16": "float16"}


def _param_name(dtype: str) -> str:
    return "float32" if dtype == "auto" else _CANONICAL.get(dtype, dtype)


def precision_conflict(dtype: str, compute_dtype: str) -> str | None:
    """Why ``model.dtype`` / ``model.compute_dtype`` cannot go together (None when they can).

    Autocast only lowers precision, so compute may not be wider than the parameters; fp16 compute
    over fp32 parameters needs loss scaling, which posttrain does not do; bf16 and fp16 do not mix.
    """
    param = _param_name(dtype)
    compute = _CANONICAL.get(compute_dtype, compute_dtype)
    if compute_dtype == "auto" or compute == param or (param == "float32" and compute == "bfloat16"):
        return None
    if param == "float32" and compute == "float16":
        return (
            f"model.compute_dtype={compute_dtype} with model.dtype={dtype} (float32 parameters) needs loss "
            "scaling, which posttrain does not do; use model.compute_dtype=bfloat16"
        )
    return (
        f"model.compute_dtype={compute_dtype} with model.dtype={dtype} ({param} parameters): compute can only "
        f"be the parameter dtype or, over float32 parameters, bfloat16; set model.compute_dtype=auto "
        f"(computes in {param}) or model.dtype=float32"
    )


@dataclass(frozen=True)
class Precision:
    """The resolved pair: ``param_dtype`` stores weights, grads and optimizer state; the forward
    computes in ``compute_dtype``."""

    param_dtype: torch.dtype
    compute_dtype: torch.dtype

    @property
    def mixed(self) -> bool:
        """Whether the forward runs in a narrower dtype than the parameters (bf16 copies / FSDP2 policy)."""
        return self.param_dtype != self.compute_dtype

    @property
    def compute_name(self) -> str:
        """``compute_dtype`` as vLLM and ``model.dtype`` spell it (``bfloat16``)."""
        return str(self.compute_dtype).removeprefix("torch.")


def resolve_precision(dtype: str, compute_dtype: str, device: torch.device) -> Precision:
    """``model.dtype`` and ``model.compute_dtype`` on ``device`` (see the module docstring)."""
    import torch

    from posttrain.errors import ConfigError

    for key, value in (("model.dtype", dtype), ("model.compute_dtype", compute_dtype)):
        if value != "auto" and value not in _CANONICAL:
            raise ConfigError([f"{key}: unknown dtype {value!r}; use auto, float32, bfloat16 or float16"])
    conflict = precision_conflict(dtype, compute_dtype)
    if conflict is not None:
        raise ConfigError([conflict])
    param: torch.dtype = getattr(torch, _param_name(dtype))
    if compute_dtype != "auto":
        compute: torch.dtype = getattr(torch, _CANONICAL[compute_dtype])
    elif param == torch.float32 and device.type == "cuda":
        compute = torch.bfloat16
    else:
        compute = param
    return Precision(param, compute)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32``."""
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def compute_weights(model: nn.Module, precision: Precision) -> Iterator[None]:
    """Inside, every floating parameter of ``model`` in ``precision.param_dtype`` reads as a copy in
    ``precision.compute_dtype``; nothing is entered when ``precision`` is not mixed.

    One cast per parameter per entry (tied parameters share one copy), made under the caller's grad
    mode: with gradients on, the copy's backward returns the gradient to the fp32 parameter in fp32,
    where micro-batches accumulate, as FSDP2's reduce dtype does. Several backwards may return through
    one entry's copies (the cast keeps no tensor for its backward): the trainer enters once per
    mini-batch. A backward that recomputes the forward (gradient checkpointing) must run inside the
    same entry, so it reads the same copies.
    Entries nest: an inner one finds the parameters already cast and changes nothing. The
    parameters themselves, their ``state_dict`` and the optimizer never see the copies."""
    if not precision.mixed:
        yield
        return

    def cast(_module: nn.Module, _name: str, param: torch.Tensor) -> torch.Tensor | None:
        if param.dtype != precision.param_dtype or not param.is_floating_point():
            return None
        return param.to(precision.compute_dtype)

    with parameters_read_as(model, cast):
        yield


@contextlib.contextmanager
def parameters_read_as(
    model: nn.Module, copy_of: Callable[[nn.Module, str, torch.Tensor], torch.Tensor | None]
) -> Iterator[None]:
    """Inside, each parameter slot of ``model`` for which ``copy_of(module, name, tensor)`` returns a
    tensor reads as that tensor; ``None`` leaves the slot as it is. A parameter gets one copy, which
    every slot holding it (tied weights) shares; a slot already swapped by an enclosing entry is passed
    as the copy it holds. On exit, also after an exception, every slot holds its parameter again: the
    parameters, their ``state_dict`` and the optimizer never see the copies. The one home of the swap
    behind ``compute_weights`` and the CPU decode's column-major weights (``models/cpu_decode_layout.py``)."""
    copies: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in model.modules():
            # typed as Parameters; a plain tensor there reads through Module.__getattr__ alike
            slots: dict[str, Any] = module._parameters
            for name, param in slots.items():
                if param is None:
                    continue
                copy = copies.get(id(param))
                if copy is None:  # asked per slot until a copy is made: a tied weight may qualify in one module only
                    made = copy_of(module, name, param)
                    if made is None:
                        continue
                    copy = copies[id(param)] = made
                swapped.append((slots, name, param))
                slots[name] = copy
        yield
    finally:
        for slots, name, param in reversed(swapped):
            slots[name] = param
