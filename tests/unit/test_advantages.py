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
