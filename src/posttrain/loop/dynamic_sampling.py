"""The DAPO dynamic-sampling driver: draw, refill and select one step's training groups.

With ``rl.min_informative_groups > 0`` (resolved once in ``RLConfig.effective_min_informative_groups``)
a step keeps drawing whole prompt rounds until every data cell holds its share of the informative
quota (``algorithm.quota.informative_quota_per_cell``), then trains on ``groups_per_step`` groups:
per cell, informative first, then tied filler, each in draw order. Everything else is dropped and
its payload released at once, so a run that refills on every step retains nothing it discards.

Rounds and dispatches are two different axes (spec "Dynamic sampling (DAPO)"):

- a *round* is one more draw of ``prompts_per_data_cell`` prompts on each participating cell;
  ``max_extra_rounds`` (``rl.dynamic_sampling_max_extra_rollouts``) caps them per step;
- a *dispatch* is one call of the draw function (one ``rollout.generate``). ``per_round`` issues one
  round per dispatch and re-counts between rounds; ``whole_budget`` issues every extra round in ONE
  dispatch once the base draw leaves a cell short.
- ``refill_mode`` says which cells participate: ``all_cells``, or ``short_cells`` (under
  ``per_round`` the cells short before each round; under ``whole_budget`` the cells short before the
  wide call, which then receive every round even if satisfied midway).

Guarantees that follow (tested in ``tests/unit/test_dynamic_sampling.py``), for a draw stream that is
the same prompt sequence per cell under both dispatch modes: the trained set is identical when no
refill was needed, when ``per_round`` also spent the whole budget, and at full DAPO (every cell's
share equals its capacity); below full DAPO ``whole_budget`` may replace tied filler with informative
groups from rounds ``per_round`` never drew. A cell's cursor advance is identical iff no refill was
needed or ``per_round`` spent the budget on it; otherwise ``whole_budget`` advances it by
``budget - k`` rounds more (``k`` = the extra rounds that cell drew under ``per_round``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.algorithm.quota import (
    GroupStamp,
    informative_quota_per_cell,
    is_informative,
    prompts_per_data_cell,
    select_groups,
)
from posttrain.config.schema import RLConfig
from posttrain.errors import TrainingError

OnBudgetExhausted = Literal["raise", "proceed"]
RefillDispatch = Literal["per_round", "whole_budget"]
RefillMode = Literal["all_cells", "short_cells"]

METRIC_EXTRA_ROLLOUTS = "train/grpo_dynamic_sampling_extra_rollouts"
METRIC_DROPPED = "train/grpo_dynamic_sampling_dropped_trajectories"
METRIC_DISPATCHES = "train/grpo_dynamic_sampling_refill_dispatches"
METRIC_SHORTFALL = "train/grpo_dynamic_sampling_shortfall"
METRIC_INFORMATIVE = "train/grpo_informative_group_count"


@dataclass(kw_only=True)
class ScoredGroup:
    """One prompt's complete group, already rewarded.

    A draw function sets ``spread`` (``max - min`` of the group's rewards, stamped by the reward stage
    while it holds the group) and ``payload`` (whatever the loop trains on: prompt, completions,
    rewards, advantages). ``cell``, ``draw_round`` and ``order`` are stamped by ``collect_dynamic`` as
    the groups come back, because only the driver knows which round of a wide dispatch a group
    belongs to; whatever the draw function put there is overwritten.
    """

    cell: int = -1
    """Data cell that drew the group."""
    draw_round: int = -1
    """0 for the base draw, 1.. for refill rounds."""
    order: int = -1
    """First-seen order within the cell, counted across rounds."""
    spread: float
    """Reward spread of the group; informative when it exceeds the threshold."""
    payload: Any
    """What the loop needs to train on the group; set to ``None`` when the group is dropped."""


DrawFn = Callable[[list[int]], list[list[ScoredGroup]]]
"""Given the prompts each cell draws (length ``R``; 0 for an idle cell), perform ONE generate dispatch
and return the scored groups per cell, each cell's groups in the order its data cursor yielded them."""


@dataclass
class DynamicSamplingResult:
    """One step's trained set and its accounting."""

    groups: list[ScoredGroup]
    """The trained set: cell 0's groups in selection order, then cell 1's, ...; ``groups_per_step``
    groups, ``prompts_per_data_cell`` per cell."""
    metrics: dict[str, float]
    """Extra rounds, dropped trajectories, refill dispatches, the shortfall summed over cells, and the
    informative-group count of the trained set."""
    rounds_drawn_per_cell: list[int]
    """Rounds each cell's data cursor advanced (1 for the base draw plus its extra rounds)."""


@dataclass
class _StepState:
    """The groups a step holds between dispatches, with the counters its metrics need."""

    num_cells: int
    per_cell: int
    group_size: int
    threshold: float
    kept: list[list[ScoredGroup]] = field(default_factory=list)
    informative_seen: list[int] = field(default_factory=list)
    rounds_drawn: list[int] = field(default_factory=list)
    drawn_groups: int = 0
    dropped_groups: int = 0
    refill_dispatches: int = 0

    def __post_init__(self) -> None:
        self.kept = [[] for _ in range(self.num_cells)]
        self.informative_seen = [0] * self.num_cells
        self.rounds_drawn = [0] * self.num_cells

    def dispatch(self, draw: DrawFn, rounds_per_cell: list[int], first_round: int) -> None:
        """One draw call: cell ``c`` draws ``rounds_per_cell[c]`` rounds starting at ``first_round``."""
        counts = [rounds * self.per_cell for rounds in rounds_per_cell]
        returned = draw(list(counts))
        if len(returned) != self.num_cells:
            raise ValueError(f"the draw function returned {len(returned)} cells for {self.num_cells} data cells")
        for cell, (groups, count) in enumerate(zip(returned, counts, strict=True)):
            if len(groups) != count:
                raise ValueError(f"the draw function returned {len(groups)} groups on cell {cell}, asked for {count}")
            order = self.rounds_drawn[cell] * self.per_cell  # groups this cell drew before
            for j, group in enumerate(groups):
                group.cell, group.draw_round, group.order = cell, first_round + j // self.per_cell, order + j
                self.informative_seen[cell] += is_informative(group.spread, self.threshold)
            self.kept[cell].extend(groups)
            self.rounds_drawn[cell] += rounds_per_cell[cell]
            self.drawn_groups += count

    def prune(self, shares: list[int]) -> int:
        """Keep each cell's current selection only, release the rest; returns the summed shortfall.

        Selection is stable under later draws (they sort after everything held), so what is released
        here could never have been trained on.
        """
        shortfall = 0
        for cell, share in enumerate(shares):
            pool = self.kept[cell]
            stamps = [GroupStamp(g.draw_round, g.order, g.spread) for g in pool]
            selection = select_groups(stamps, share, self.per_cell, self.threshold)
            chosen = set(selection.chosen)
            for i, group in enumerate(pool):
                if i not in chosen:
                    group.payload = None  # the record may outlive the step elsewhere; its bulk must not
                    self.dropped_groups += 1
            self.kept[cell] = [pool[i] for i in selection.chosen]
            shortfall += selection.shortfall
        return shortfall

    def short_cells(self, shares: list[int]) -> list[bool]:
        """Whether each cell still holds fewer informative groups than its share."""
        return [seen < share for seen, share in zip(self.informative_seen, shares, strict=True)]

    def release_all(self) -> None:
        """Drop every held payload (the step is abandoned)."""
        for pool in self.kept:
            for group in pool:
                group.payload = None
        self.kept = [[] for _ in range(self.num_cells)]

    def result(self, shortfall: int) -> DynamicSamplingResult:
        groups = [g for pool in self.kept for g in pool]
        metrics = {
            METRIC_EXTRA_ROLLOUTS: float(max(self.rounds_drawn) - 1),
            METRIC_DROPPED: float(self.dropped_groups * self.group_size),
            METRIC_DISPATCHES: float(self.refill_dispatches),
            METRIC_SHORTFALL: float(shortfall),
            METRIC_INFORMATIVE: float(sum(is_informative(g.spread, self.threshold) for g in groups)),
        }
        return DynamicSamplingResult(groups=groups, metrics=metrics, rounds_drawn_per_cell=list(self.rounds_drawn))


def collect_dynamic(
    draw: DrawFn,
    *,
    groups_per_step: int,
    group_size: int,
    num_cells: int,
    quota: int,
    max_extra_rounds: int,
    on_budget_exhausted: OnBudgetExhausted,
    refill_dispatch: RefillDispatch,
    refill_mode: RefillMode = "all_cells",
    threshold: float = 0.0,
) -> DynamicSamplingResult:
    """Collect one step's ``groups_per_step`` groups, refilling until every cell meets its quota share.

    ``quota`` is the global informative-group count (``RLConfig.effective_min_informative_groups``);
    0 returns the base draw unchanged, in draw order. Raises ``DynamicSamplingBudgetError`` when the
    budget is spent with a cell still short and ``on_budget_exhausted == "raise"``.
    """
    _check_arguments(
        groups_per_step=groups_per_step,
        group_size=group_size,
        quota=quota,
        max_extra_rounds=max_extra_rounds,
        on_budget_exhausted=on_budget_exhausted,
        refill_dispatch=refill_dispatch,
        refill_mode=refill_mode,
    )
    state = _StepState(num_cells, prompts_per_data_cell(groups_per_step, num_cells), group_size, threshold)
    state.dispatch(draw, [1] * num_cells, first_round=0)
    if quota == 0:
        return state.result(shortfall=0)
    shares = informative_quota_per_cell(quota, num_cells)
    state.prune(shares)
    short = state.short_cells(shares)
    if any(short) and max_extra_rounds > 0:
        if refill_dispatch == "per_round":
            _refill_per_round(state, draw, shares, max_extra_rounds, refill_mode)
        else:
            participating = short if refill_mode == "short_cells" else [True] * num_cells
            state.dispatch(draw, [max_extra_rounds if p else 0 for p in participating], first_round=1)
            state.refill_dispatches += 1
    shortfall = state.prune(shares)
    if shortfall and on_budget_exhausted == "raise":
        error = DynamicSamplingBudgetError(state, shares, quota, max_extra_rounds, refill_dispatch)
        state.release_all()
        raise error
    return state.result(shortfall)


def _refill_per_round(state: _StepState, draw: DrawFn, shares: list[int], budget: int, refill_mode: RefillMode) -> None:
    """One round per dispatch, re-counting between rounds; stops when no cell is short."""
    for round_index in range(1, budget + 1):
        short = state.short_cells(shares)
        if not any(short):
            return
        participating = short if refill_mode == "short_cells" else [True] * state.num_cells
        state.dispatch(draw, [1 if p else 0 for p in participating], first_round=round_index)
        state.refill_dispatches += 1
        state.prune(shares)


def _check_arguments(
    *,
    groups_per_step: int,
    group_size: int,
    quota: int,
    max_extra_rounds: int,
    on_budget_exhausted: str,
    refill_dispatch: str,
    refill_mode: str,
) -> None:
    """Programming errors of the caller (config values were validated at preflight)."""
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    if not 0 <= quota <= groups_per_step:
        raise ValueError(f"quota={quota} must lie in [0, groups_per_step={groups_per_step}]")
    if max_extra_rounds < 0:
        raise ValueError(f"max_extra_rounds={max_extra_rounds} must be >= 0")
    for name, value, allowed in (
        ("on_budget_exhausted", on_budget_exhausted, ("raise", "proceed")),
        ("refill_dispatch", refill_dispatch, ("per_round", "whole_budget")),
        ("refill_mode", refill_mode, ("all_cells", "short_cells")),
    ):
        if value not in allowed:
            raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")


class DynamicSamplingBudgetError(TrainingError):
    """The extra-round budget is spent and a data cell still lacks its informative-group share."""

    def __init__(self, state: _StepState, shares: list[int], quota: int, budget: int, refill_dispatch: str) -> None:
        self.found = sum(min(seen, state.per_cell) for seen in state.informative_seen)
        self.quota = quota
        self.extra_rounds = max(state.rounds_drawn) - 1
        short = [
            f"cell {c}: {seen} of {share}"
            for c, (seen, share) in enumerate(zip(state.informative_seen, shares, strict=True))
            if seen < share
        ]
        cells = f" (short data cells: {'; '.join(short)})" if len(shares) > 1 else ""
        super().__init__(
            f"dynamic sampling found {self.found} informative groups (reward spread > {state.threshold:g}) "
            f"against the quota of {quota} (rl.min_informative_groups / rl.min_informative_groups_frac "
            f"resolved) in {state.drawn_groups} drawn groups after {self.extra_rounds} extra rounds "
            f"(rl.dynamic_sampling_max_extra_rollouts={budget}, rl.dynamic_sampling_refill_dispatch="
            f"{refill_dispatch}){cells}. Raise rl.dynamic_sampling_max_extra_rollouts, lower the quota "
            "(rl.min_informative_groups_frac or rl.min_informative_groups), set "
            "rl.dynamic_sampling_on_budget_exhausted=proceed to train on tied filler, or fix the reward "
            "(rl.reward) if it cannot tell this policy's completions apart"
        )


def collect_dynamic_for(
    rl: RLConfig, draw: DrawFn, *, num_cells: int = 1, threshold: float = 0.0
) -> DynamicSamplingResult:
    """``collect_dynamic`` with every knob read from the ``rl`` section."""
    return collect_dynamic(
        draw,
        groups_per_step=rl.groups_per_step,
        group_size=rl.group_size,
        num_cells=num_cells,
        quota=rl.effective_min_informative_groups,
        max_extra_rounds=rl.dynamic_sampling_max_extra_rollouts,
        on_budget_exhausted=rl.dynamic_sampling_on_budget_exhausted,
        refill_dispatch=rl.dynamic_sampling_refill_dispatch,
        refill_mode=rl.dynamic_sampling_refill_mode,
        threshold=threshold,
    )


def dynamic_sampling_log_line(rl: RLConfig, num_cells: int = 1) -> str | None:
    """The run-log line stating the resolved quota and ``groups_per_step``; ``None`` when off."""
    quota = rl.effective_min_informative_groups
    if quota == 0:
        return None
    spelled = (
        f"rl.min_informative_groups_frac={rl.min_informative_groups_frac:g}"
        if rl.min_informative_groups_frac is not None
        else f"rl.min_informative_groups={rl.min_informative_groups}"
    )
    shares = informative_quota_per_cell(quota, num_cells)
    return (
        f"dynamic sampling ON: quota {quota} informative groups of groups_per_step={rl.groups_per_step} "
        f"({spelled}; per data cell {shares}), at most {rl.dynamic_sampling_max_extra_rollouts} extra rounds "
        f"per step, refill {rl.dynamic_sampling_refill_dispatch}/{rl.dynamic_sampling_refill_mode}, "
        f"on budget exhausted: {rl.dynamic_sampling_on_budget_exhausted}"
    )
