"""The informative-group quota: resolution from the config, the split over data cells, selection."""

from __future__ import annotations

import math

import pytest

from posttrain.algorithm.quota import (
    GroupStamp,
    informative_quota_per_cell,
    is_informative,
    prompts_per_data_cell,
    select_groups,
)
from posttrain.config.schema import RLConfig


@pytest.mark.parametrize(
    ("layout", "spelling", "expected"),
    [
        ((32, 4), (None, 1.0), (8, 8)),  # full DAPO on b32g4
        ((256, 4), (None, 0.5), (64, 32)),  # half of b256g4
        ((256, 4), (None, 1.0), (64, 64)),  # the same share is full DAPO on any layout
        ((32, 4), (None, 0.3), (8, 3)),  # ceil(2.4)
        ((24, 4), (None, 0.5), (6, 3)),  # exact
        ((256, 4), (None, 0.01), (64, 1)),  # ceil(0.64): a share never resolves to off
        ((400, 4), (None, 0.07), (100, 7)),  # 0.07 * 100 is 7.000000000000001 in floats; still 7
        ((256, 4), (8, None), (64, 8)),  # a literal does not scale with the batch
        ((32, 4), (None, None), (8, 0)),  # off
        ((32, 4), (0, None), (8, 0)),  # literal 0 is off as well
    ],
)
def test_resolved_quota_for_layouts(
    layout: tuple[int, int], spelling: tuple[int | None, float | None], expected: tuple[int, int]
) -> None:
    """``layout`` is (batch_per_replica, group_size), ``spelling`` (literal, frac), ``expected``
    (groups_per_step, resolved quota)."""
    rl = RLConfig(
        batch_per_replica=layout[0],
        group_size=layout[1],
        min_informative_groups=spelling[0],
        min_informative_groups_frac=spelling[1],
    )
    assert (rl.groups_per_step, rl.effective_min_informative_groups) == expected


def test_resolved_share_is_the_exact_ceiling_for_every_percent() -> None:
    # ceil(p/100 * g) in exact integer arithmetic, for every whole percent and batch up to 128 groups.
    for percent in range(1, 101):
        for groups in range(1, 129):
            rl = RLConfig(batch_per_replica=groups, group_size=1, min_informative_groups_frac=percent / 100)
            assert rl.effective_min_informative_groups == -(-percent * groups // 100), (percent, groups)


@pytest.mark.parametrize(
    ("quota", "cells", "shares"),
    [
        (5, 3, [2, 2, 1]),
        (1, 8, [1, 0, 0, 0, 0, 0, 0, 0]),  # one group means one group on eight replicas too
        (8, 1, [8]),
        (8, 4, [2, 2, 2, 2]),
        (7, 4, [2, 2, 2, 1]),
        (0, 3, [0, 0, 0]),
    ],
)
def test_quota_split_is_exact(quota: int, cells: int, shares: list[int]) -> None:
    assert informative_quota_per_cell(quota, cells) == shares
    assert sum(shares) == quota


def test_quota_split_sums_and_is_balanced_everywhere() -> None:
    for quota in range(0, 40):
        for cells in range(1, 9):
            shares = informative_quota_per_cell(quota, cells)
            assert sum(shares) == quota
            assert max(shares) - min(shares) <= 1
            assert shares == sorted(shares, reverse=True)  # the first N mod R cells owe one more


def test_quota_split_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="at least one data cell"):
        informative_quota_per_cell(3, 0)
    with pytest.raises(ValueError, match="cannot be negative"):
        informative_quota_per_cell(-1, 2)


def test_prompts_per_data_cell() -> None:
    assert prompts_per_data_cell(8, 1) == 8
    assert prompts_per_data_cell(12, 3) == 4
    with pytest.raises(ValueError, match="groups_per_step=10 must be a positive multiple of the number of data cells"):
        prompts_per_data_cell(10, 4)
    with pytest.raises(ValueError, match="positive multiple"):
        prompts_per_data_cell(2, 4)


def test_informative_is_strictly_above_threshold() -> None:
    assert is_informative(1.0) and not is_informative(0.0)
    assert not is_informative(0.5, threshold=0.5) and is_informative(0.51, threshold=0.5)


def _stamps(spreads: str) -> list[GroupStamp]:
    """One stamp per character, in draw order: 'i' informative (spread 1), 't' tied (spread 0)."""
    return [GroupStamp(draw_round=0, order=k, spread=1.0 if ch == "i" else 0.0) for k, ch in enumerate(spreads)]


def test_selection_takes_informative_first_then_first_seen() -> None:
    sel = select_groups(_stamps("tititt"), per_cell_need=2, per_cell_capacity=4)
    assert sel.chosen == [1, 3, 0, 2]
    assert (sel.informative, sel.shortfall) == (2, 0)


def test_selection_caps_informative_at_capacity_and_reports_shortfall() -> None:
    sel = select_groups(_stamps("iiiiii"), per_cell_need=3, per_cell_capacity=4)
    assert sel.chosen == [0, 1, 2, 3] and sel.informative == 4 and sel.shortfall == 0
    sel = select_groups(_stamps("ttittt"), per_cell_need=3, per_cell_capacity=4)
    assert sel.chosen == [2, 0, 1, 3] and sel.informative == 1 and sel.shortfall == 2


def test_selection_follows_draw_order_not_list_order() -> None:
    # Round 1's groups listed before round 0's: draw order (round, order) decides.
    stamps = [
        GroupStamp(draw_round=1, order=4, spread=1.0),
        GroupStamp(draw_round=1, order=5, spread=0.0),
        GroupStamp(draw_round=0, order=1, spread=0.0),
        GroupStamp(draw_round=0, order=0, spread=2.0),
    ]
    assert select_groups(stamps, per_cell_need=2, per_cell_capacity=3).chosen == [3, 0, 2]


def test_selection_threshold_compares_the_stamp() -> None:
    stamps = [GroupStamp(0, k, s) for k, s in enumerate([0.2, 0.9, 0.5, 0.0])]
    assert select_groups(stamps, 1, 2, threshold=0.5).chosen == [1, 0]
    assert select_groups(stamps, 1, 2, threshold=0.0).chosen == [0, 1]


def test_selection_of_a_prefix_then_the_rest_equals_selection_of_all() -> None:
    # The driver prunes between rounds; that is only sound if selection is stable under later draws.
    import random

    rng = random.Random(0)
    for _ in range(300):
        n, cap = rng.randint(0, 20), rng.randint(0, 6)
        stamps = [GroupStamp(k // 3, k, float(rng.random() < 0.3)) for k in range(n)]
        cut = rng.randint(0, n)
        first = select_groups(stamps[:cut], 0, cap).chosen
        held = [stamps[i] for i in first] + stamps[cut:]
        again = [held[i] for i in select_groups(held, 0, cap).chosen]
        assert again == [stamps[i] for i in select_groups(stamps, 0, cap).chosen]


def test_full_share_equals_capacity() -> None:
    # A quota of groups_per_step is every cell's full capacity however the cells split it.
    for cells in (1, 2, 4, 8):
        groups = 8 * cells
        assert informative_quota_per_cell(groups, cells) == [groups // cells] * cells
    assert (
        math.ceil(1.0 * 64)
        == RLConfig(
            batch_per_replica=256, group_size=4, min_informative_groups_frac=1.0
        ).effective_min_informative_groups
    )
