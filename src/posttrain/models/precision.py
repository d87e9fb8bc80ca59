"""The run's precision: the dtype parameters are stored in and the dtype the forward computes in.

``model.dtype`` is the parameter (storage) dtype: weights, gradients and optimizer state.
``model.compute_dtype`` is the dtype of the forward and backward arithmetic. When the two differ
("mixed": fp32 master weights, bf16 compute) an unsharded module runs its forward under
``torch.autocast`` (``compute_autocast``) and an FSDP2-sharded one through its
``MixedPrecisionPolicy`` (``distributed.fsdp.shard_policy``); the logprob head still upcasts its
logits to fp32. When they are equal nothing is entered at all, so the fp32 CPU path computes
exactly what it did before mixed precision existed.

``auto`` defaults: parameters in fp32 everywhere; compute in bf16 on CUDA when the parameters are
fp32 (tensor cores, half the activation memory) and in the parameter dtype otherwise (CPU bf16
matmuls are slow). ``precision_conflict`` imports no torch, so the preflight can call it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

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
        """Whether the forward runs in a narrower dtype than the parameters (autocast / FSDP2 policy)."""
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
def compute_autocast(precision: Precision, device: torch.device) -> Iterator[None]:
    """``torch.autocast`` to the compute dtype when ``precision`` is mixed; otherwise enter nothing."""
    if not precision.mixed:
        yield
        return
    import torch

    with torch.autocast(device.type, dtype=precision.compute_dtype):
        yield
