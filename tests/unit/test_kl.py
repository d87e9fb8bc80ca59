"""The k3 KL estimator and its clamped gradient coefficient, checked value by value and with autograd."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithm.kl import k3_kl, k3_kl_with_clamped_grad


def _grad(fn, logprobs: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    lp = logprobs.clone().requires_grad_(True)
    fn(lp, ref).sum().backward()
    assert lp.grad is not None
    return lp.grad


def test_k3_hand_values() -> None:
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-2.0, -1.0, -0.5]], dtype=torch.float64)
    # z = ref - lp = [-1, 1, 0]; kl = exp(z) - z - 1
    expected = torch.tensor([[math.exp(-1.0), math.e - 2.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(k3_kl(lp, ref), expected)


def test_k3_gradient_is_one_minus_exp_z() -> None:
    lp = torch.tensor([[-0.3, -2.5, -7.0, -0.1]], dtype=torch.float64)
    ref = torch.tensor([[-1.2, -0.4, -0.2, -0.1]], dtype=torch.float64)
    z = ref - lp
    torch.testing.assert_close(_grad(k3_kl, lp, ref), 1.0 - torch.exp(z))


def test_k3_safety_clamp_at_20_nats() -> None:
    lp = torch.tensor([[-50.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -50.0]], dtype=torch.float64)
    kl = k3_kl(lp, ref)
    torch.testing.assert_close(kl, torch.tensor([[math.exp(20.0) - 21.0, math.exp(-20.0) + 19.0]], dtype=torch.float64))
    # Beyond the safety clamp the exact form has no gradient.
    assert torch.equal(_grad(k3_kl, lp, ref), torch.zeros(1, 2, dtype=torch.float64))


def test_reference_gets_no_gradient() -> None:
    lp = torch.tensor([[-1.0]], requires_grad=True)
    ref = torch.tensor([[-2.0]], requires_grad=True)
    k3_kl(lp, ref).sum().backward()
    assert ref.grad is None


@pytest.mark.parametrize("c", [0.5, 1.0, 5.0])
def test_clamped_grad_keeps_the_exact_value(c: float) -> None:
    lp = torch.tensor([[-0.2, -3.0, -9.0, -0.01, -40.0]], dtype=torch.float64)
    ref = torch.tensor([[-4.0, -0.5, -0.2, -0.01, -0.1]], dtype=torch.float64)
    assert torch.equal(k3_kl_with_clamped_grad(lp, ref, c), k3_kl(lp, ref))


def test_clamped_grad_holds_the_boundary_slope() -> None:
    c = 1.0
    # z = ref - lp covers: far below -c, inside, exactly 0, above c, and beyond the 20-nat clamp.
    z = torch.tensor([[-3.0, -0.5, 0.0, 0.7, 2.0, 6.0, 25.0]], dtype=torch.float64)
    lp = torch.full_like(z, -30.0)
    ref = lp + z
    grad = _grad(lambda a, b: k3_kl_with_clamped_grad(a, b, c), lp, ref)
    expected = 1.0 - torch.exp(z.clamp(-c, c))
    torch.testing.assert_close(grad, expected)
    # Inside |z| <= c it is the exact gradient.
    exact = _grad(k3_kl, lp, ref)
    inside = z.abs() <= c
    torch.testing.assert_close(grad[inside], exact[inside])
    # Bounded by exp(c) - 1 everywhere, while the exact coefficient at z = 6 is ~ -402.
    assert grad.abs().max() <= math.exp(c) - 1.0 + 1e-12
    assert exact[0, 5] < -400.0


def test_large_clamp_matches_exact_gradient_inside_safety_clamp() -> None:
    lp = torch.tensor([[-0.2, -3.0, -9.0, -12.0]], dtype=torch.float64)
    ref = torch.tensor([[-4.0, -0.5, -0.2, -0.3]], dtype=torch.float64)
    clamped = _grad(lambda a, b: k3_kl_with_clamped_grad(a, b, 30.0), lp, ref)
    torch.testing.assert_close(clamped, _grad(k3_kl, lp, ref))


def test_clamp_must_be_positive() -> None:
    with pytest.raises(ValueError, match="kl_coeff_clamp"):
        k3_kl_with_clamped_grad(torch.zeros(1, 1), torch.zeros(1, 1), 0.0)
