"""Group-relative advantages, reward spread and the informative-group flag, against hand values."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithm.advantages import group_advantages, group_reward_spread, informative_groups


def test_standardised_advantages_hand_values() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0]])
    adv = group_advantages(rewards, unbiased=False, eps=0.0)
    # Group 1: mean 0.5, sample variance 4 * 0.25 / 3 = 1/3.
    s1 = math.sqrt(1.0 / 3.0)
    # Group 2: mean 1.5, sample variance (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3.
    s2 = math.sqrt(5.0 / 3.0)
    expected = torch.tensor([[0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1], [-1.5 / s2, -0.5 / s2, 0.5 / s2, 1.5 / s2]])
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)


def test_eps_is_added_to_the_std() -> None:
    rewards = torch.tensor([[0.0, 2.0]])  # mean 1, sample std sqrt(2)
    adv = group_advantages(rewards, unbiased=False, eps=0.5)
    expected = torch.tensor([[-1.0, 1.0]]) / (math.sqrt(2.0) + 0.5)
    torch.testing.assert_close(adv, expected)


def test_unbiased_advantage_is_only_centred() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0]])
    adv = group_advantages(rewards, unbiased=True)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-1.5, -0.5, 0.5, 1.5]])
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("unbiased", [False, True])
def test_tied_group_has_exactly_zero_advantage(unbiased: bool) -> None:
    rewards = torch.tensor([[0.7, 0.7, 0.7], [0.0, 1.0, 1.0]])
    adv = group_advantages(rewards, unbiased=unbiased)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[0], torch.zeros(3))
    assert not torch.equal(adv[1], torch.zeros(3))


@pytest.mark.parametrize("unbiased", [False, True])
def test_group_of_one_has_zero_advantage_and_no_nan(unbiased: bool) -> None:
    rewards = torch.tensor([[3.0], [-5.0]])
    adv = group_advantages(rewards, unbiased=unbiased)
    assert torch.equal(adv, torch.zeros(2, 1))


def test_integer_rewards_are_promoted_to_float() -> None:
    adv = group_advantages(torch.tensor([[0, 1]]), unbiased=True)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 0.5]]))


def test_non_matrix_rewards_are_rejected() -> None:
    with pytest.raises(ValueError, match="2-D"):
        group_advantages(torch.tensor([1.0, 2.0]), unbiased=False)


def test_spread_and_informative_groups() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.5], [2.0, 2.0, 2.0], [0.0, 0.1, 0.05]])
    torch.testing.assert_close(group_reward_spread(rewards), torch.tensor([1.0, 0.0, 0.1]))
    assert informative_groups(rewards).tolist() == [True, False, True]
    assert informative_groups(rewards, threshold=0.5).tolist() == [True, False, False]
    assert informative_groups(torch.tensor([[4.0]])).tolist() == [False]


# ----------------------------------------------------------------------------------------------
# Ties that the arithmetic does not round back (issue 15)
# ----------------------------------------------------------------------------------------------


def _formula_before_issue_15(rewards_NG: torch.Tensor, *, unbiased: bool, eps: float = 1e-6) -> torch.Tensor:
    """The advantage arithmetic as it was before tied groups were zeroed exactly: every untied group
    must still come out of ``group_advantages`` with these very bits."""
    r_NG = rewards_NG.to(torch.promote_types(rewards_NG.dtype, torch.float32))
    centred_NG = r_NG - r_NG.mean(dim=1, keepdim=True)
    if unbiased:
        return centred_NG
    if r_NG.shape[1] < 2:
        std_N1 = torch.zeros_like(r_NG[:, :1])
    else:
        std_N1 = r_NG.std(dim=1, keepdim=True, correction=1)
    return centred_NG / (std_N1 + eps)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (so that -0.0 and 0.0, or two NaNs, are told apart / matched exactly)."""
    return x.view(torch.int64 if x.dtype == torch.float64 else torch.int32)


TIED_VALUES = [(0.9, 3), (123.456, 12), (0.1, 3), (0.7, 6), (1.1, 6), (1 / 3, 7), (-2.3, 5), (1e-3, 10)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("unbiased", [False, True])
def test_ties_of_non_dyadic_rewards_are_exactly_zero(unbiased: bool, dtype: torch.dtype) -> None:
    for value, n in TIED_VALUES:
        rewards = torch.full((1, n), value, dtype=dtype)
        adv = group_advantages(rewards, unbiased=unbiased)
        assert adv.dtype == dtype
        assert _bits(adv).eq(0).all(), (value, n, dtype, adv)  # +0.0, not -0.0 nor 1e-8
    # The issue's values: the plain formula gave 0.0555 and -0.90 here in float32.
    old = _formula_before_issue_15(torch.full((1, 3), 0.9), unbiased=False)
    assert old[0, 0].item() == pytest.approx(0.0555, abs=1e-3)
    old = _formula_before_issue_15(torch.full((1, 12), 123.456), unbiased=False)
    assert old[0, 0].item() == pytest.approx(-0.90, abs=1e-2)


@pytest.mark.parametrize("unbiased", [False, True])
def test_mixed_tied_and_untied_groups(unbiased: bool) -> None:
    rewards = torch.tensor(
        [
            [0.9] * 12,  # tied (the plain formula gives 0.056 / 6e-8 here in float32)
            [0.9] * 11 + [0.3],  # eleven tie, one differs: informative
            [123.456] * 12,  # tied (-0.90 / -1.5e-5)
            [0.0, 1.0] * 6,
        ]
    )
    adv = group_advantages(rewards, unbiased=unbiased)
    assert _bits(adv[0]).eq(0).all() and _bits(adv[2]).eq(0).all()
    assert _bits(adv[[1, 3]]).equal(_bits(_formula_before_issue_15(rewards[[1, 3]], unbiased=unbiased)))
    assert (adv[1] != 0).all() and (adv[3] != 0).all()
    assert informative_groups(rewards).tolist() == [False, True, False, True]
    assert group_reward_spread(rewards)[[0, 2]].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("unbiased", [False, True])
def test_near_ties_are_not_ties(unbiased: bool, dtype: torch.dtype) -> None:
    # One member one ulp above the others: a real (tiny) spread, so the group stays informative
    # and keeps the plain formula's nonzero advantages.
    base = torch.full((1, 5), 0.9, dtype=dtype)
    rewards = base.clone()
    rewards[0, 2] = torch.nextafter(base[0, 2], torch.tensor(2.0, dtype=dtype))
    adv = group_advantages(rewards, unbiased=unbiased)
    assert (adv != 0).any()
    assert _bits(adv).equal(_bits(_formula_before_issue_15(rewards, unbiased=unbiased)))
    assert informative_groups(rewards).tolist() == [True]
    assert (group_reward_spread(rewards) > 0).all()
    # A gap of 1e-5, far above the rounding of the mean: the larger member gets the top advantage.
    rewards[0, 2] = 0.9 + 1e-5
    adv = group_advantages(rewards, unbiased=unbiased)
    assert adv[0, 2] > 0 and (adv[0, [0, 1, 3, 4]] < 0).all()


@pytest.mark.parametrize("unbiased", [False, True])
def test_groups_of_one_and_non_finite_rewards(unbiased: bool) -> None:
    rewards = torch.tensor([[0.9], [123.456], [-0.1]])
    assert _bits(group_advantages(rewards, unbiased=unbiased)).eq(0).all()
    assert informative_groups(rewards).tolist() == [False, False, False]
    # A NaN or infinite reward never counts as a tie: the formula's NaN stays visible.
    bad = torch.tensor([[math.nan, math.nan], [math.inf, math.inf]])
    assert torch.isnan(group_advantages(bad, unbiased=unbiased)).all()
    assert informative_groups(bad).tolist() == [False, False]


@pytest.mark.parametrize("unbiased", [False, True])
def test_untied_groups_keep_the_formula_bit_for_bit(unbiased: bool) -> None:
    """0/1 and dyadic rewards (the built-in rewards) and random float rewards that do not tie:
    identical bits to the plain formula, so runs with such rewards are unchanged."""
    g = torch.Generator().manual_seed(15)
    for group_size in (2, 3, 4, 7, 8, 16):
        # Mostly-correct 0/1 rewards (p = 0.8) plus an all-0 and an all-1 group: tied groups are in.
        binary = (torch.rand(64, group_size, generator=g) < 0.8).float()
        binary = torch.cat([binary, torch.zeros(1, group_size), torch.ones(1, group_size)])
        dyadic = torch.randint(-8, 9, (64, group_size), generator=g).float() / 4
        floats = torch.rand(64, group_size, generator=g) * 10 - 3
        for rewards in (binary, dyadic, floats, floats.double()):
            adv = group_advantages(rewards, unbiased=unbiased)
            old = _formula_before_issue_15(rewards, unbiased=unbiased)
            assert _bits(adv).equal(_bits(old)), (group_size, rewards.dtype)
            # ...and the tied groups among them (0/1 groups often tie) are exactly zero either way.
            tied = ~informative_groups(rewards)
            assert _bits(adv[tied]).eq(0).all()
    with_eps = torch.rand(32, 4, generator=g)
    assert _bits(group_advantages(with_eps, unbiased=unbiased, eps=0.25)).equal(
        _bits(_formula_before_issue_15(with_eps, unbiased=unbiased, eps=0.25))
    )


def test_informative_groups_agree_with_the_zeroed_groups() -> None:
    """A group is zeroed exactly when it is not informative, on ties the arithmetic misses too."""
    g = torch.Generator().manual_seed(3)
    values = torch.tensor([0.9, 0.1, 123.456, 1 / 3, 0.7])
    rewards = values[torch.randint(0, 5, (200, 3), generator=g)]
    adv = group_advantages(rewards, unbiased=False)
    zeroed = (adv == 0).all(dim=1)
    assert zeroed.equal(~informative_groups(rewards))
    assert zeroed.any() and (~zeroed).any()
