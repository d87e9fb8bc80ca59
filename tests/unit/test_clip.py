"""Gradient clipping (``distributed.fsdp.clip_to_total_norm``): bit for bit what torch's
``clip_grad_norm_`` leaves, also when it skips the scaling pass, and a non-finite norm left visible."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from posttrain.distributed.fsdp import SingleProcess


def _params(scale: float, seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(7, 5), (5,), (3, 3, 2)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    return params


@pytest.mark.parametrize(("scale", "max_norm"), [(0.01, 1.0), (10.0, 1.0), (1.0, math.inf), (1.0, 3.9)])
def test_clip_matches_torch_bit_for_bit(scale: float, max_norm: float) -> None:
    ours, theirs = _params(scale), _params(scale)
    norm = SingleProcess.clip_grad_norm(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert norm == float(expected)
    for a, b in zip(ours, theirs):
        assert a.grad is not None and b.grad is not None
        assert torch.equal(a.grad, b.grad)
    if scale == 10.0:  # clipped: the norm after is max_norm
        after = torch.nn.utils.get_total_norm([p.grad for p in ours if p.grad is not None])
        assert float(after) == pytest.approx(max_norm, rel=1e-5)


def test_non_finite_norm_leaves_the_gradients_as_they_were() -> None:
    """torch would multiply every gradient by a NaN coefficient, hiding which parameter was bad."""
    params = _params(1.0)
    assert params[1].grad is not None
    params[1].grad[2] = float("nan")
    before = [p.grad.clone() for p in params if p.grad is not None]
    norm = SingleProcess.clip_grad_norm(params, 1.0)
    assert math.isnan(norm)
    for b, p in zip(before, params):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, b, equal_nan=True)
    assert torch.isfinite(params[0].grad).all()
