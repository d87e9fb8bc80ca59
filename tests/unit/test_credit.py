"""OPD advantage-mode credit: A(t) = A_reward + kl_penalty_coef * A_teacher(t), prefix zeroed."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithm import opd_token_advantages

F64 = torch.float64


def test_hand_computed_advantages_and_means() -> None:
    # completions of 3, 0 and 2 tokens; the first token of each carries no teacher credit
    adv_N, means = opd_token_advantages(
        torch.tensor([0.5, -1.0, 2.0]),
        torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=F64),
        torch.tensor([3, 0, 2]),
        0.5,
        1,
    )
    # credit after the prefix: [0, 2, 3 | 0, 5]; reward broadcast: [0.5, 0.5, 0.5 | 2, 2]
    assert adv_N.dtype == F64
    assert adv_N.tolist() == [0.5, 1.5, 2.0, 2.0, 4.5]
    assert float(means["advantage_mean"]) == pytest.approx(10.5 / 5)
    assert float(means["teacher_credit_mean"]) == pytest.approx(10.0 / 3)  # three counted tokens


def test_no_prefix_and_zero_coefficient() -> None:
    reward_B, credit_N, lengths_B = (
        torch.tensor([1.0, -1.0]),
        torch.tensor([2.0, -4.0, 8.0], dtype=F64),
        torch.tensor([1, 2]),
    )
    adv_N, means = opd_token_advantages(reward_B, credit_N, lengths_B, 1.0, 0)
    assert adv_N.tolist() == [3.0, -5.0, 7.0]
    assert float(means["teacher_credit_mean"]) == pytest.approx(2.0)
    adv_N, means = opd_token_advantages(reward_B, credit_N, lengths_B, 0.0, 0)
    assert adv_N.tolist() == [1.0, -1.0, -1.0]  # the reward advantage alone
    assert float(means["teacher_credit_mean"]) == pytest.approx(2.0)  # reported before the coefficient


def test_a_prefix_longer_than_every_completion_and_an_empty_batch_give_zero_means() -> None:
    adv_N, means = opd_token_advantages(
        torch.tensor([0.25, 0.75]), torch.tensor([9.0, 9.0, 9.0], dtype=F64), torch.tensor([2, 1]), 1.0, 5
    )
    assert adv_N.tolist() == [0.25, 0.25, 0.75]
    assert float(means["teacher_credit_mean"]) == 0.0
    adv_N, means = opd_token_advantages(
        torch.zeros(0), torch.zeros(0, dtype=F64), torch.zeros(0, dtype=torch.long), 1.0, 0
    )
    assert adv_N.shape == (0,)
    assert float(means["advantage_mean"]) == 0.0 and float(means["teacher_credit_mean"]) == 0.0


def test_matches_a_per_completion_loop() -> None:
    gen = torch.Generator().manual_seed(3)
    lengths = [4, 0, 1, 7, 3]
    reward_B = torch.randn(len(lengths), generator=gen)
    credit_N = torch.randn(sum(lengths), generator=gen, dtype=F64)
    adv_N, means = opd_token_advantages(reward_B, credit_N, torch.tensor(lengths), 0.3, 2)
    expected, credits, offset = [], [], 0
    for b, n in enumerate(lengths):
        for t in range(n):
            c = float(credit_N[offset + t]) if t >= 2 else 0.0
            credits += [c] if t >= 2 else []
            expected.append(float(reward_B[b]) + 0.3 * c)
        offset += n
    assert adv_N.tolist() == pytest.approx(expected, abs=1e-12)
    assert float(means["advantage_mean"]) == pytest.approx(sum(expected) / len(expected), abs=1e-12)
    assert float(means["teacher_credit_mean"]) == pytest.approx(sum(credits) / len(credits), abs=1e-12)
