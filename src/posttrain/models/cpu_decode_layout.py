"""The CPU decode's weight layouts: the same products, in the layout the processor's library is fast at.

A decode step multiplies a few rows (one per running sequence: 32 at most in the default job) by
every weight. ``nn.Linear`` computes ``x @ W.T`` with ``W`` stored ``[out, in]`` row-major, so MKL's
GEMM reads its second operand transposed ("NT"); at 4-32 rows that kernel took 1.5-10x as long as
the "NN" one over an ``[in, out]`` row-major operand for SmolLM2-135M's five weight shapes (2026-12-07,
Intel Xeon, torch 2.13.0+cpu with MKL 2024.2; ``benchmarks/cpu_small_products.py --layouts``), and
about as long from 64 rows up. A weight stored column-major (``[out, in]`` with strides
``(1, out)``) *is* an ``[in, out]`` row-major tensor seen transposed, so ``F.linear`` hands MKL the NN
case, and the result comes back in the usual row-major layout: nothing downstream changes.

``column_major_linears`` swaps every fp32 ``nn.Linear`` weight of a module for such a copy while
it is entered, as ``precision.compute_weights`` swaps in compute-dtype copies: the parameters, their
``state_dict`` and the optimizer never see the copies. The transformers rollout engine enters it once
per ``generate`` call on a CPU: one transposing copy per weight (about 0.2 s for SmolLM2-135M's 134M
linear weights on that machine, and as much memory again as those weights while the call runs),
against about 0.5-1.5 s less in the call's products. The products are the same up to rounding
(MKL's two kernels sum in different orders), so the draws differ from a row-major run's.

Whether it pays depends on the processor (``rollout.cpu_weight_layout``): on a 2-core AMD EPYC with AVX2
(2026-12-07, the same torch and MKL) no product was more than 1.3x faster column-major, the head's
(576 x 49,152) 1.1-1.5x *slower* at 4-64 rows, and the default job's rollout call 6-7 % slower (slower in 17
of 18 interleaved pairs; ``docs/benchmarks.md``, thirty-sixth session). ``auto``
therefore decodes column-major only on an Intel CPU with torch's MKL: a rule of the machine, not of a
timing, so a run and its resume on one machine take the same draws.

On that AMD EPYC oneDNN's linear over a weight packed in its own blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, then ``_linear_pointwise``: the pair torch's inductor uses for
a frozen CPU linear) was 1.1-2.3x as fast as MKL's for the layers' larger products at 4-64 rows and 1.9-2.7x
for the head's, the small key/value products a few microseconds slower (2026-12-07,
``benchmarks/cpu_small_products.py --layouts``); the default job's rollout call was 15-26 % faster with a
0.2 s packing per call included (faster in 20 of 20 interleaved pairs), the whole job 13 %. A packed weight
is not a tensor ``F.linear`` can read, so ``onednn_packed_linears`` gives each fp32 CPU ``nn.Linear`` a
``forward`` of its own while it is entered (hooks and wrappers that call the module, LoRA's among them,
still run) and takes it away on exit. ``auto`` packs on a CPU that is not an Intel one with MKL, when this
torch has the two operators (``onednn_packing``); not measured on an Intel CPU, where column-major stays.

The update's forward products are the same kind of product at more rows (94-256 a pass in the default job),
where oneDNN over a packed weight was 1.1-1.4x as fast as MKL's on that AMD EPYC. ``packed_update_linears``
gives each such linear a ``forward`` through ``PackedLinear``, an autograd function whose forward multiplies over
the packed copy and whose backward computes the input's and the weight's gradients from the plain weight as
``F.linear``'s backward does (the same MKL products). Both contexts take their copies from ``packed_copy``, which
keeps each until its weight changes, so the update reuses the copies the rollout's decode made of the same
weights: on that AMD EPYC the default job's train phase 5.80 -> 5.25 s, faster in 9 of 9 interleaved pairs
(``benchmarks/cpu_decode_interleaved.py --vary update``); packing afresh for the update instead (0.26 s) left
about half of that (docs/benchmarks.md, thirty-eighth session). ``model.cpu_packed_update`` chooses
(``update_packing_choice``): ``auto`` where ``rollout.cpu_weight_layout``'s ``auto`` packs.
"""

from __future__ import annotations

import functools
import platform
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import increment_version

from posttrain.models.precision import parameters_read_as

__all__ = [
    "LAYOUTS",
    "NO_PACKING",
    "UPDATE_COMPILED",
    "UPDATE_NO_PACKING",
    "PackedLinear",
    "column_major_copy",
    "column_major_linears",
    "cpu_vendor",
    "decode_layout_choice",
    "onednn_packed_linears",
    "onednn_packing",
    "pack_weight",
    "packed_copy",
    "packed_linear",
    "packed_update_choice",
    "packed_update_linears",
    "update_packing_choice",
    "weights_written",
]

LAYOUTS = ("auto", "row_major", "column_major", "onednn_packed")
"""``rollout.cpu_weight_layout``'s values (the config's ``Literal`` names the same four)."""

NO_PACKING = (
    "rollout.cpu_weight_layout=onednn_packed: this torch has no oneDNN linear packing "
    "(torch.ops.mkldnn._reorder_linear_weight); set auto, row_major or column_major"
)
"""Why an explicit ``onednn_packed`` is refused where torch cannot pack (the preflight's error and the engine's)."""

_COPY_ROWS = 256
"""Rows of the weight per transposing copy: in blocks the copy stays in cache and runs about twice as
fast as one whole-matrix copy (0.19-0.21 s against 0.30-0.44 s for SmolLM2-135M's linear weights on
the 2026-12-07 machine; 64 to 1,024 rows all did about as well)."""


def column_major_copy(weight: torch.Tensor) -> torch.Tensor:
    """A copy of the 2-D ``weight`` with strides ``(1, rows)``: the same values, stored transposed."""
    copy = torch.empty_strided(weight.shape, (1, weight.shape[0]), dtype=weight.dtype, device=weight.device)
    for start in range(0, weight.shape[0], _COPY_ROWS):
        copy[start : start + _COPY_ROWS].copy_(weight[start : start + _COPY_ROWS])
    return copy


def column_major_linears(model: nn.Module) -> AbstractContextManager[None]:
    """Inside, every fp32 CPU ``nn.Linear`` weight of ``model`` (a plain tensor, not a sharded one)
    reads as a column-major copy (tied weights share one copy); the parameters are back when it
    exits. Enter it under ``torch.no_grad`` or ``torch.inference_mode``: the copies are for sampling,
    not for training."""
    return parameters_read_as(model, _column_major_weight)


def _column_major_weight(module: nn.Module, name: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The column-major copy of a plain fp32 CPU ``nn.Linear`` weight; None for any other slot."""
    if name != "weight" or _decode_weight(module) is not weight:
        return None
    return column_major_copy(weight)


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...) from ``/proc/cpuinfo``; where
    there is none (not Linux), ``platform.processor()``, or ``unknown``."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    named = (line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id") and ":" in line)
    return next(named, "") or platform.processor() or "unknown"


def _decode_weight(module: nn.Module) -> torch.Tensor | None:
    """``module``'s weight if it is a plain fp32 CPU ``nn.Linear`` weight (what both copies are made of), else None."""
    if not isinstance(module, nn.Linear):
        return None
    weight = module.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if not _plain(weight):
        return None
    return weight


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is held in a plain ``torch.Tensor``: a sharded (DTensor) or other subclass parameter is
    not packed, since its full value is gathered into fresh storage each forward, which a kept copy cannot follow."""
    return type(tensor.data) is torch.Tensor


def onednn_packed_linears(model: nn.Module) -> AbstractContextManager[None]:
    """Inside, every fp32 CPU ``nn.Linear`` of ``model`` (a plain weight, no ``forward`` of its own already)
    computes with oneDNN over a packed copy of its weight (tied weights share one copy); on exit, also after
    an exception, each is the plain module again and the parameters were never touched. Enter it under
    ``torch.no_grad`` or ``torch.inference_mode``: the packed product has no backward."""
    return _packed_forwards(
        model, lambda _module, packed, bias: functools.partial(packed_linear, packed=packed, bias=bias)
    )


def packed_update_linears(model: nn.Module) -> AbstractContextManager[None]:
    """``onednn_packed_linears`` for training: each linear's forward goes through ``PackedLinear`` where autograd
    records it, so gradients reach the input, the weight and the bias as through ``F.linear``. The copies are
    of the weights on entry: leave it before an optimizer step changes them. Entered again inside (a nested
    forward), it leaves the linears it finds patched alone."""
    return _packed_forwards(model, lambda module, packed, _bias: functools.partial(_update_forward, module, packed))


_MakeForward = Callable[[nn.Module, torch.Tensor, torch.Tensor | None], Callable[..., torch.Tensor]]
"""``(module, its packed weight, its bias) -> the forward it gets``."""


@contextmanager
def _packed_forwards(model: nn.Module, make_forward: _MakeForward) -> Iterator[None]:
    """Every plain fp32 CPU ``nn.Linear`` of ``model`` without a ``forward`` of its own gets
    ``make_forward(module, packed weight, bias)`` (tied weights packed once) until the exit, also an exceptional one."""
    patched: list[nn.Module] = []
    try:
        for module in model.modules():
            weight = _decode_weight(module)
            if weight is None or "forward" in module.__dict__:
                continue
            bias = module.bias if isinstance(module.bias, torch.Tensor) else None
            module.forward = make_forward(module, packed_copy(weight), bias)
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward


class PackedLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose forward multiplies over ``packed = pack_weight(weight)`` (oneDNN) and
    whose backward is ``F.linear``'s: ``grad_x = grad @ W``, ``grad_W = grad^T x``, ``grad_b = sum(grad)``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return packed_linear(x, packed=packed, bias=bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad_rows.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = grad_rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def _update_forward(module: nn.Module, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A patched linear's forward in the update: through ``PackedLinear`` where autograd records, else plain."""
    weight = module.weight
    bias = module.bias if isinstance(module.bias, torch.Tensor) else None
    records = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if records:
        return PackedLinear.apply(x, weight, bias, packed)
    return packed_linear(x, packed=packed, bias=bias)


_PACKED: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}
"""``packed_copy``'s copies: ``id(weight) -> (the weight, weakly; its version counter then; the packed copy)``."""


def packed_copy(weight: torch.Tensor) -> torch.Tensor:
    """``pack_weight(weight)``, made once and kept while ``weight`` is unchanged: until its version counter, which
    every in-place write bumps, moves, or the weight is freed. So the rollout's decode and the update that follows
    it on the same weights share one packing (0.26 s a step for the default job's 135M). torch's fused AdamW
    writes without bumping the counter (torch 2.13), so the trainer bumps it after each optimizer step
    (``weights_written``); a write through ``.data`` would not bump it either, and no path of the
    policy writes so."""
    if weight.is_inference():  # no version counter to key on: packed afresh each time
        return pack_weight(weight)
    key, version = id(weight), weight._version
    entry = _PACKED.get(key)
    if entry is not None and entry[0]() is weight and entry[1] == version:
        return entry[2]
    with torch.no_grad():
        packed = pack_weight(weight.detach())

    def forget(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
        if _PACKED.get(key, (None,))[0] is ref:
            del _PACKED[key]

    _PACKED[key] = (weakref.ref(weight, forget), version, packed)
    return packed


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A 2-D fp32 CPU ``[out, in]`` weight packed in oneDNN's blocked layout, for ``packed_linear`` only."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def packed_linear(x: torch.Tensor, *, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` over ``packed = pack_weight(W)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def onednn_packing() -> bool:
    """Whether this torch packs and multiplies linear weights with oneDNN on the CPU: its two operators
    exist and a small product over a packed weight equals ``F.linear``'s."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        numbers = torch.Generator().manual_seed(0)  # not the global generator: the probe leaves the draws alone
        weight, x = torch.randn(48, 40, generator=numbers), torch.randn(3, 40, generator=numbers)
        with torch.no_grad():
            return bool(torch.allclose(packed_linear(x, packed=pack_weight(weight)), x @ weight.T, atol=1e-4))
    except (AttributeError, RuntimeError):  # an operator this build lacks
        return False


def decode_layout_choice(
    setting: str, *, vendor: str | None = None, mkl: bool | None = None, onednn: bool | None = None
) -> tuple[str, str]:
    """``rollout.cpu_weight_layout`` resolved: the layout (``row_major``, ``column_major`` or ``onednn_packed``)
    the transformers engine decodes with on a CPU, and why (for the log). ``auto`` is column-major on an Intel
    CPU (``vendor``: this machine's unless given) with torch's MKL (``mkl``: whether this torch has it, unless
    given), else oneDNN-packed where this torch packs (``onednn``: ``onednn_packing()`` unless given), else
    row-major. ``onednn_packed`` set where torch cannot pack, or any setting not in ``LAYOUTS``, is refused (a
    ValueError), not read as ``row_major``."""
    if setting not in LAYOUTS:
        raise ValueError(f"rollout.cpu_weight_layout must be one of {', '.join(LAYOUTS)}, got {setting!r}")
    packs = onednn_packing if onednn is None else lambda: onednn  # probed only where the answer matters
    if setting == "onednn_packed" and not packs():
        raise ValueError(NO_PACKING)
    if setting != "auto":
        return setting, f"rollout.cpu_weight_layout={setting}"
    vendor = cpu_vendor() if vendor is None else vendor
    mkl = torch.backends.mkl.is_available() if mkl is None else mkl
    if vendor == "GenuineIntel" and mkl:
        return "column_major", "rollout.cpu_weight_layout=auto: column_major (an Intel CPU with MKL)"
    why = "torch has no MKL" if vendor == "GenuineIntel" else f"the CPU is {vendor}, not Intel"
    if packs():
        return "onednn_packed", f"rollout.cpu_weight_layout=auto: onednn_packed ({why})"
    return "row_major", f"rollout.cpu_weight_layout=auto: row_major ({why}; this torch has no oneDNN packing)"


UPDATE_NO_PACKING = (
    "model.cpu_packed_update=true: this torch has no oneDNN linear packing "
    "(torch.ops.mkldnn._reorder_linear_weight); set auto or false"
)
"""Why an explicit ``model.cpu_packed_update=true`` is refused where torch cannot pack."""

UPDATE_COMPILED = (
    "model.cpu_packed_update=true: not with model.compile (dynamo would trace the packed forwards); set one false"
)
"""Why an explicit ``model.cpu_packed_update=true`` is refused beside ``model.compile``."""


def update_packing_choice(
    setting: bool | str,
    *,
    cpu_fp32: bool,
    compiled: bool,
    sharded: bool = False,
    vendor: str | None = None,
    mkl: bool | None = None,
    onednn: bool | None = None,
) -> tuple[bool, str]:
    """``model.cpu_packed_update`` resolved: whether the update's linears multiply over packed weights
    (``packed_update_linears``), and why (for the log). Only for a policy computing in fp32 on a CPU
    (``cpu_fp32``) and not compiled (dynamo would trace the patched forwards); there ``auto`` packs where
    ``decode_layout_choice("auto")`` does (a CPU that is not an Intel one with MKL, when torch packs) and
    ``true`` packs, refused (a ValueError) where torch cannot. An FSDP-sharded policy (``sharded``) never packs:
    its layers' full weights are gathered into fresh storage for each forward, which a kept copy cannot follow."""
    head = f"model.cpu_packed_update={str(setting).lower()}"
    if not cpu_fp32 or setting is False:
        return False, f"{head}: off" + ("" if setting is False else " (not an fp32 CPU policy)")
    if sharded:
        return False, f"{head}: off (an FSDP-sharded policy)"
    if setting is True:
        if compiled:
            raise ValueError(UPDATE_COMPILED)
        if not (onednn_packing() if onednn is None else onednn):
            raise ValueError(UPDATE_NO_PACKING)
        return True, f"{head}: on"
    if compiled:
        return False, f"{head}: off (model.compile)"
    layout, why = decode_layout_choice("auto", vendor=vendor, mkl=mkl, onednn=onednn)
    reason = why[why.index("(") + 1 : -1]
    return layout == "onednn_packed", f"{head}: {'on' if layout == 'onednn_packed' else 'off'} ({reason})"


def packed_update_choice(model: nn.Module, model_cfg: Any, mixed: bool) -> tuple[bool, str]:
    """``update_packing_choice`` for the policy ``model`` under its config section (``model.cpu_packed_update``,
    ``model.compile``): an fp32 CPU policy when its parameters are fp32 on the CPU and the run is not ``mixed``;
    sharded when a parameter is a DTensor (or another tensor subclass)."""
    params = list(model.parameters())
    cpu_fp32 = bool(params) and params[0].device.type == "cpu" and params[0].dtype == torch.float32 and not mixed
    sharded = not all(_plain(p) for p in params)
    return update_packing_choice(
        model_cfg.cpu_packed_update, cpu_fp32=cpu_fp32, compiled=model_cfg.compile, sharded=sharded
    )


def weights_written(params: Sequence[torch.Tensor]) -> None:
    """Tell ``packed_copy``'s cache that ``params`` were just written (an optimizer step): bump their version
    counters, which torch 2.13's fused AdamW leaves as they were. Only CPU tensors: no copy of another is packed."""
    on_cpu = [p for p in params if p.device.type == "cpu"]
    if on_cpu:
        increment_version(on_cpu)
