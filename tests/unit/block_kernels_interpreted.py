"""The RMSNorm kernels of ``models/block_kernels.py`` against float64 and against the eager module's
own bf16 arithmetic, in Triton's interpreter: run by ``tests/unit/test_block_kernels.py`` as a process
of its own with ``TRITON_INTERPRET=1`` (set before Triton is first imported). Prints ``ok <case>`` per
case; an assertion fails the process."""

from __future__ import annotations

import torch

from posttrain.models.block_kernels import rms_norm

EPS = 1e-6
# (rows, hidden): several tiles and a partial one, a hidden size that is not a power of two, one row,
# a hidden size above the tile (one row per tile), and more tiles than the interpreter's three
# backward programs (their grid-stride loop runs several times)
CASES = [(37, 96), (5, 200), (1, 64), (3, 5000), (130, 64)]


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' Llama RMSNorm, as its module computes it."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def outputs(fn, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    x, weight = x.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    y = fn(x, weight)
    dx, dw = torch.autograd.grad(y, [x, weight], dy)
    return [y.detach(), dx, dw]


def check_case(rows: int, hidden: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows * hidden)
    x = (torch.randn(2, rows, hidden) * 2).to(dtype)  # a leading batch dimension, as a decoder's [B, T, H]
    weight = (1 + 0.2 * torch.randn(hidden)).to(dtype)
    dy = torch.randn(2, rows, hidden).to(dtype)
    got = outputs(lambda a, w: rms_norm(a, w, EPS), x, weight, dy)
    eager = outputs(eager_rms_norm, x, weight, dy)
    exact = outputs(eager_rms_norm, x.double(), weight.double(), dy.double())
    for name, g, e, want in zip(("y", "dx", "dw"), got, eager, exact, strict=True):
        assert g.shape == want.shape and g.dtype == dtype, (name, g.shape, g.dtype)
        scale = want.abs().max().item()
        ours, theirs = (g.double() - want).abs().max().item(), (e.double() - want).abs().max().item()
        if dtype == torch.float32:
            assert ours <= 1e-5 * scale, (name, ours, scale)
        else:  # as close to float64 as the eager module's own bf16 rounding, within one more rounding
            assert ours <= theirs + 2**-7 * scale, (name, ours, theirs, scale)
            assert ours <= 2**-6 * scale, (name, ours, scale)
    print(f"ok {rows}x{hidden} {dtype}")


if __name__ == "__main__":
    for rows, hidden in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            check_case(rows, hidden, dtype)
