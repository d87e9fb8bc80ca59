"""Rows that learn nothing (policy/free_rows.py) and how ranks split their passes around them
(distributed/passes.py; ``SingleProcess.passes``). ``DataParallel.passes``' all-reduce runs on two
gloo ranks in tests/integration/test_fsdp_equivalence.py."""

from __future__ import annotations

import torch

from posttrain.algorithm.loss_types import ObjectiveSpec
from posttrain.distributed.fsdp import SingleProcess
from posttrain.distributed.passes import agreed_passes, pass_kinds
from posttrain.policy.batching import packed_micro_batches
from posttrain.policy.free_rows import free_groups_first, free_rows, packed_free_first
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


def test_free_groups_go_first_whole_and_in_order() -> None:
    free = [False, False, True, True, False, False, True, True, True, False]
    assert free_groups_first([0, 1, 2, 3, 4, 5, 6, 7], free, 2) == [2, 3, 6, 7, 0, 1, 4, 5]
    # a group counts as free only whole: rows 8-9 have one free row, so they stay with the learning ones
    assert free_groups_first([4, 5, 8, 9, 6, 7], free, 2) == [6, 7, 4, 5, 8, 9]
    assert free_groups_first([0, 1, 2, 3], [False] * 4, 2) == [0, 1, 2, 3]


def test_packing_puts_whole_micro_batches_of_free_rows_first() -> None:
    rows = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    lengths = [5, 9, 3, 7, 2, 8, 6, 4, 1, 10]
    free = [False] * 10 + [True, False, True, True, False, True, True, False, True, False]
    micro = packed_free_first(rows, lengths, free, 3)
    # as many micro-batches as packing cuts without free rows (ceil(10 / 3)), every row once
    assert len(micro) == len(packed_micro_batches(lengths, 3)) == 4
    assert sorted(r for m in micro for r in m) == rows
    # six free rows fill two micro-batches, which come first; the rest hold no free row
    assert all(free[r] for m in micro[:2] for r in m) and len(micro[0]) + len(micro[1]) == 6
    assert not any(free[r] for m in micro[2:] for r in m)
    # fewer free rows than a micro-batch: packing's own split
    few = [False] * 10 + [True] + [False] * 9
    assert packed_free_first(rows, lengths, few, 3) == [[rows[j] for j in m] for m in packed_micro_batches(lengths, 3)]


def test_one_process_runs_the_free_rows_apart() -> None:
    micro = [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]]
    free = torch.tensor([True] * 4 + [False] * 4 + [True] * 4)
    assert SingleProcess.passes(micro, free) == [([0, 1, 2, 3], False), ([8, 9, 10, 11], False), ([4, 5, 6, 7], True)]
    assert SingleProcess.passes(micro, None) == [(rows, True) for rows in micro]


def test_each_micro_batch_is_a_split_a_free_one_or_neither() -> None:
    micro = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    free = torch.tensor([True, True, False, False] + [False] * 4 + [True] * 4)
    # a wholly free micro-batch can also split (its last unit rows with autograd), if it has more rows
    assert pass_kinds(micro, free).tolist() == [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    assert pass_kinds(micro, free, unit=4).tolist() == [[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]


def test_ranks_split_a_micro_batch_only_where_every_rank_can() -> None:
    """Two ranks, three micro-batches each: the first both split by kind; the second is all free on
    rank 0 and split on rank 1, so rank 0 runs its last group with autograd; the third is all free
    on both. The minimum of their kinds is what both run."""
    micro = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    rank0 = torch.tensor([True, True, False, False] + [True] * 4 + [True] * 4)
    rank1 = torch.tensor([False, False, True, True] + [True, True, False, False] + [True] * 4)
    agreed = torch.minimum(pass_kinds(micro, rank0, 2), pass_kinds(micro, rank1, 2))
    # the passes without autograd first, each rank its own rows
    assert agreed_passes(micro, rank0, agreed, 2) == [
        ([0, 1], False), ([4, 5], False), (micro[2], False), ([2, 3], True), ([6, 7], True)
    ]  # fmt: skip
    assert agreed_passes(micro, rank1, agreed, 2) == [
        ([2, 3], False), ([4, 5], False), (micro[2], False), ([0, 1], True), ([6, 7], True)
    ]  # fmt: skip
    plan = [learns for _, learns in agreed_passes(micro, rank0, agreed, 2)]  # the same sequence on both ranks
    assert plan == [learns for _, learns in agreed_passes(micro, rank1, agreed, 2)]


def test_a_micro_batch_that_learns_whole_on_one_rank_runs_whole_on_every_rank() -> None:
    micro = [[0, 1, 2, 3]]
    learning, free = torch.zeros(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool)
    for other in (free, torch.tensor([True, True, False, False])):
        agreed = torch.minimum(pass_kinds(micro, learning, 2), pass_kinds(micro, other, 2))
        assert agreed_passes(micro, other, agreed, 2) == [(micro[0], True)]
    # one group alone cannot split, so a wholly free one-group micro-batch meets a split one whole
    one = [[0, 1]]
    agreed = torch.minimum(
        pass_kinds(one, free, 2), pass_kinds([[0, 1, 2, 3]], torch.tensor([True, True, False, False]), 2)
    )
    assert agreed_passes(one, free, agreed, 2) == [(one[0], True)]


def test_only_a_kl_term_keeps_a_zero_advantage_row_learning() -> None:
    assert spec_objective(ObjectiveSpec()).zero_advantage_rows_learn_nothing
    assert spec_objective(ObjectiveSpec(score_centering=True, sc_compose="tis")).zero_advantage_rows_learn_nothing
    assert not spec_objective(ObjectiveSpec(kl_beta=0.1)).zero_advantage_rows_learn_nothing
