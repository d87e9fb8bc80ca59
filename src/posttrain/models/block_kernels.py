"""The RMSNorm of a fused-kernel policy as two Triton kernels tiled for the update's many rows.

``model.fused_kernels`` (``models/fused_kernels.py``) patches a policy with Liger-Kernel's Triton
RMSNorm, SwiGLU and RoPE. Liger's RMSNorm backward, for a hidden size above 256, runs one program per
SM, each walking its share of the rows one row at a time (``_rms_norm_backward_kernel``): for a
micro-batch of 19,200 tokens that is ~145 dependent row loads per program, so the kernel waits on
memory latency rather than bandwidth. The kernels here compute the same function in the same
precision, a tile of rows at a time:

- forward: ``y = w * (x * rstd).to(x.dtype)`` with ``rstd = 1 / sqrt(mean(x^2) + eps)`` in fp32
  (transformers' Llama / Qwen2 / Qwen3 RMSNorm, Liger's ``llama`` casting mode); one program per
  tile of rows, ``rstd`` kept for the backward.
- backward (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", for the gradient):
  ``dx = rstd * (m - mean(m * x) * rstd^2 * x)`` with ``m = dy * w``, and ``dw = sum_rows(dy * xhat)``
  with ``xhat = (x * rstd).to(x.dtype)``; a persistent grid of a few programs per SM, each striding over
  tiles and keeping its ``dw`` partial in fp32 registers; torch sums the partials.

Every product of two bf16 values is formed in fp32, where it is exact, and rounded once to the
input dtype: the bf16 product the module's autograd forms, bit for bit (and Triton's interpreter,
which the CPU tests use, has no bf16 arithmetic).

On an H100 (``benchmarks/block_kernels.py``, 2026-12-06) the backward of W's micro-batch (19,200 x 896,
bf16) took 54 us against Liger's 137 us, the 1.5B shape's (9,600 x 1,536) 49 against 86 us (on an H200:
42 against 130, 40 against 81); the forwards are equal or a little faster. W's update alone took 12 ms
less on the H100 (docs/benchmarks.md, twenty-eighth session). A flat SwiGLU kernel was tried the same
way and was no faster than Liger's, which already runs at the memory's bandwidth: SwiGLU stays Liger's.

``use_rows_rms_norm`` rebinds the ``forward`` of the RMSNorm modules Liger patched, as Liger binds
its own: parameter names and the state dict stay. A call the kernels do not cover (a CPU tensor, a
weight of another dtype than the input, no rows) takes Liger's forward; Liger's Gemma offset and
casting modes stay Liger's. Triton is imported at the first CUDA call; on the CPU the tests run the
kernels in Triton's interpreter (``tests/unit/test_block_kernels.py``), on a GPU
``tests/gpu/test_block_kernels_gpu.py``.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import Tensor, nn

KERNEL_NAMES = frozenset({"rms_norm_rows_fwd", "rms_norm_rows_bwd"})
_TILE = 4096  # elements per tile: rows x the hidden size padded to a power of two
_PROGRAMS_PER_SM = 8  # the backward's persistent grid (H100: 4096 x 8 was the best of seven tilings)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_rows_fwd(  # noqa: PLR0917
        x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, eps, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_COLS)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=1) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        y = (x32 * rstd[:, None]).to(x.dtype).to(tl.float32) * w[None, :]
        tl.store(y_ptr + offsets, y.to(x.dtype), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)

    @triton.jit
    def rms_norm_rows_bwd(  # noqa: PLR0917
        dy_ptr,
        x_ptr,
        w_ptr,
        rstd_ptr,
        dx_ptr,
        dw_partial_ptr,
        n_rows,
        n_cols,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr,
    ):
        program = tl.program_id(0)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_COLS,), dtype=tl.float32)
        for start in range(program * BLOCK_ROWS, n_rows, programs * BLOCK_ROWS):
            rows = start + tl.arange(0, BLOCK_ROWS).to(tl.int64)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows[:, None] * n_cols + cols[None, :]
            dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0)
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            x32 = x.to(tl.float32)
            dy32 = dy.to(tl.float32)
            m = (dy32 * w[None, :]).to(x.dtype).to(tl.float32)
            mx_mean = tl.sum(m * x32, axis=1) / n_cols
            dx = rstd[:, None] * (m - (mx_mean * rstd * rstd)[:, None] * x32)
            tl.store(dx_ptr + offsets, dx.to(x.dtype), mask=mask)
            xhat = (x32 * rstd[:, None]).to(x.dtype).to(tl.float32)
            dw += tl.sum((dy32 * xhat).to(x.dtype).to(tl.float32), axis=0)
        tl.store(dw_partial_ptr + program * n_cols + cols, dw, mask=col_mask)

    return rms_norm_rows_fwd, rms_norm_rows_bwd


def _tiling(n_cols: int) -> tuple[int, int, int]:
    """(rows per tile, padded columns, warps) for a hidden size of ``n_cols``."""
    block_cols = 1 << max(n_cols - 1, 1).bit_length()
    block_rows = max(1, _TILE // block_cols)
    return block_rows, block_cols, 8 if block_rows * block_cols >= 8192 else 4


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _backward_programs(device: torch.device, tiles: int) -> int:
    """The persistent grid: ``_PROGRAMS_PER_SM`` per SM, never more than the tiles (three in Triton's
    interpreter, so the tests' grid-stride loop runs more than once)."""
    per_device = _PROGRAMS_PER_SM * _sm_count(device.index or 0) if device.type == "cuda" else 3
    return max(1, min(tiles, per_device))


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


class RMSNormRows(torch.autograd.Function):
    """``w * (x * rstd).to(x.dtype)`` over the last dimension (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        n_rows, n_cols = x2.shape
        block_rows, block_cols, warps = _tiling(n_cols)
        y = torch.empty_like(x2)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        forward_kernel, _ = _kernels()
        forward_kernel[(_cdiv(n_rows, block_rows),)](
            x2, weight, y, rstd, n_rows, n_cols, eps, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=warps
        )
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, None]:
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = dy.reshape(-1, n_cols).contiguous()
        block_rows, block_cols, warps = _tiling(n_cols)
        programs = _backward_programs(x2.device, _cdiv(n_rows, block_rows))
        dx = torch.empty_like(x2)
        dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x2.device)
        _, backward_kernel = _kernels()
        backward_kernel[(programs,)](
            dy2, x2, weight, rstd, dx, dw_partial, n_rows, n_cols,
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=warps,
        )  # fmt: skip
        return dx.view(dy.shape), dw_partial.sum(0).to(weight.dtype), None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x`` (``[..., H]``) by ``weight`` (``[H]``, the dtype of ``x``) on the kernels."""
    out: Tensor = RMSNormRows.apply(x, weight, eps)
    return out


def _rows_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    """The forward bound to a Liger-patched RMSNorm: the kernels where they apply, Liger's otherwise."""
    weight: Tensor | None = getattr(self, "weight", None)
    if hidden_states.is_cuda and weight is not None and weight.dtype == hidden_states.dtype and hidden_states.numel():
        return rms_norm(hidden_states, weight, float(getattr(self, "variance_epsilon")))  # noqa: B009
    out: Tensor = vars(self)["posttrain_liger_forward"](hidden_states)
    return out


def use_rows_rms_norm(model: nn.Module) -> int:
    """Rebind every RMSNorm of ``model`` that Liger patched in its ``llama`` casting mode without an
    offset to the kernels here; returns how many (a module already on them, counted, is left as is;
    one Liger patched again since gets them again)."""
    count = 0
    for module in model.modules():
        liger_llama = getattr(module, "casting_mode", None) == "llama" and getattr(module, "offset", None) == 0.0
        bound = vars(module).get("forward")
        if not liger_llama or bound is None:
            continue
        if getattr(bound, "__func__", None) is not _rows_forward:
            vars(module)["posttrain_liger_forward"] = bound
            vars(module)["forward"] = types.MethodType(_rows_forward, module)
        count += 1
    return count


def use_liger_rms_norm(model: nn.Module) -> None:
    """Undo ``use_rows_rms_norm``: Liger's own forward again (the benchmarks' before arm)."""
    for module in model.modules():
        if "posttrain_liger_forward" in vars(module):
            vars(module)["forward"] = vars(module)["posttrain_liger_forward"]
