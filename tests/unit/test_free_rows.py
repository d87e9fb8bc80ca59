"""Rows that learn nothing (policy/free_rows.py) and how a rank splits its passes around them
(``SingleProcess.passes`` / ``DataParallel.passes``)."""

from __future__ import annotations

import torch

from posttrain.algorithm.loss_types import ObjectiveSpec
from posttrain.distributed.fsdp import DataParallel, SingleProcess
from posttrain.policy.free_rows import free_rows
from posttrain.policy.objective import spec_objective
from posttrain.policy.train_batch import TokenAdvantages


def test_a_group_is_free_only_when_every_member_has_zero_advantage() -> None:
    adv = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert free_rows(adv, None, 4).tolist() == [True] * 4 + [False] * 4 + [True] * 4
    assert free_rows(adv, None, 1).tolist() == (adv == 0).tolist()  # no groups: row by row
    assert free_rows(adv[:6], None, 4).tolist() == (adv[:6] == 0).tolist()  # not whole groups: row by row


def test_per_token_advantages_must_all_be_zero_too() -> None:
    adv = torch.zeros(4)
    credit = TokenAdvantages(values=[[0.0, 0.0], [0.0], [0.0, 0.5], [0.0, 0.0, 0.0]])
    assert free_rows(adv, credit, 2).tolist() == [True, True, False, False]


def test_one_process_runs_the_free_rows_apart_and_sharded_ranks_do_not() -> None:
    micro = [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]]
    free = torch.tensor([True] * 4 + [False] * 4 + [True] * 4)
    assert SingleProcess.passes(micro, free) == [([4, 5, 6, 7], True), ([0, 1, 2, 3], False), ([8, 9, 10, 11], False)]
    assert SingleProcess.passes(micro, None) == [(rows, True) for rows in micro]
    assert DataParallel.passes(micro, free) == [(rows, True) for rows in micro]  # every rank the same passes


def test_only_a_kl_term_keeps_a_zero_advantage_row_learning() -> None:
    assert spec_objective(ObjectiveSpec()).zero_advantage_rows_learn_nothing
    assert spec_objective(ObjectiveSpec(score_centering=True, sc_compose="tis")).zero_advantage_rows_learn_nothing
    assert not spec_objective(ObjectiveSpec(kl_beta=0.1)).zero_advantage_rows_learn_nothing
