"""The informative-group quota of DAPO dynamic sampling: how it splits over data cells, and which
groups of a cell are trained on.

DAPO (arXiv 2503.14476, §3.2) trains only on groups whose rewards do not all tie, because a tied
group has zero advantage for every member. ``rl.min_informative_groups`` (or its share spelling,
resolved once in ``RLConfig.effective_min_informative_groups``) is a *global* count: it is split
exactly over the ``R`` data cells so that the same quota means the same number of groups on one data
replica or eight. The reward stage stamps each complete group's reward spread; the decision here only
compares that stamp with a threshold, so it is per group and independent of how groups are spread
over cells.

Pure bookkeeping on plain numbers: no tensors, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def informative_quota_per_cell(quota: int, num_cells: int) -> list[int]:
    """Split the global ``quota`` over ``num_cells`` cells exactly.

    Every cell owes ``quota // R`` groups and the first ``quota % R`` cells owe one more, so the
    shares sum to ``quota`` (e.g. quota 5 over 3 cells is ``[2, 2, 1]``).
    """
    if num_cells < 1:
        raise ValueError(f"num_cells={num_cells}: there must be at least one data cell")
    if quota < 0:
        raise ValueError(f"quota={quota}: the informative-group quota cannot be negative")
    base, extra = divmod(quota, num_cells)
    return [base + (1 if cell < extra else 0) for cell in range(num_cells)]


def prompts_per_data_cell(groups_per_step: int, num_cells: int) -> int:
    """Prompts (groups) one data cell draws per round: its even share of ``groups_per_step``."""
    if num_cells < 1 or groups_per_step < num_cells or groups_per_step % num_cells:
        raise ValueError(
            f"groups_per_step={groups_per_step} must be a positive multiple of the number of data cells "
            f"({num_cells}): each cell draws an equal share of the batch's prompts"
        )
    return groups_per_step // num_cells


def is_informative(spread: float, threshold: float = 0.0) -> bool:
    """A group is informative when its stamped reward spread exceeds ``threshold`` (strictly)."""
    return spread > threshold


@dataclass(frozen=True)
class GroupStamp:
    """What selection needs to know about one complete group of a cell.

    ``draw_round`` is 0 for the base draw and 1.. for refill rounds; ``order`` is the group's
    first-seen position within its cell. Together they give the draw order.
    """

    draw_round: int
    order: int
    spread: float


@dataclass(frozen=True)
class CellSelection:
    """The groups one cell trains on.

    ``chosen`` indexes the input stamps in selection order (informative first, then tied filler,
    each in draw order); ``informative`` counts the informative groups among them; ``shortfall`` is
    how many informative groups the cell still lacks against its need (0 when it met it).
    """

    chosen: list[int]
    informative: int
    shortfall: int


def select_groups(
    stamps: Sequence[GroupStamp], per_cell_need: int, per_cell_capacity: int, threshold: float = 0.0
) -> CellSelection:
    """Choose at most ``per_cell_capacity`` groups of ONE data cell.

    Informative groups come first, then tied groups, each in draw order (round, then first-seen
    order), and the first ``per_cell_capacity`` of that sequence are kept. Because every later draw
    sorts after every earlier one, selecting from a prefix of the draws and then from the kept set
    plus new draws gives the same result as selecting from all draws at once; the driver relies on
    this to release dropped groups between rounds.
    """
    if per_cell_capacity < 0 or per_cell_need < 0:
        raise ValueError(f"per_cell_need={per_cell_need} and per_cell_capacity={per_cell_capacity} must be >= 0")
    by_draw = sorted(range(len(stamps)), key=lambda i: (stamps[i].draw_round, stamps[i].order))
    informative = [i for i in by_draw if is_informative(stamps[i].spread, threshold)]
    tied = [i for i in by_draw if not is_informative(stamps[i].spread, threshold)]
    chosen = (informative + tied)[:per_cell_capacity]
    kept_informative = min(len(informative), per_cell_capacity)
    return CellSelection(
        chosen=chosen,
        informative=kept_informative,
        shortfall=max(0, per_cell_need - kept_informative),
    )
