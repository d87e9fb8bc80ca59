"""The DAPO dynamic-sampling driver against a real reward whose outcomes are scripted per prompt.

Each data cell reads a deterministic prompt stream. A script gives, per prompt, how many of the
``G`` completions answer correctly; the fake engine writes those completions as text, the real
``exact_match`` reward scores them through ``score_completions``, and the group's reward spread is
stamped from the scores. Only the engine is scripted: the reward, the spread and the driver are real.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass, field

import pytest
import torch

from posttrain.algorithm.advantages import group_advantages, group_reward_spread
from posttrain.config.loading import build_config
from posttrain.errors import PosttrainError, TrainingError
from posttrain.loop.dynamic_sampling import (
    DynamicSamplingBudgetError,
    DynamicSamplingResult,
    ScoredGroup,
    collect_dynamic,
    collect_dynamic_for,
    dynamic_sampling_log_line,
)
from posttrain.preflight.grpo import grpo_preflight as preflight
from posttrain.rewards.base import RewardInput
from posttrain.rewards.registry import get_reward, score_completions

G = 4
ANSWER, WRONG = "42", "41"
EXACT_MATCH = get_reward("exact_match")


class Payload:
    """What the loop would train on; a plain class so tests can hold weak references to it."""

    def __init__(self, uid: str, completions: list[str], rewards_G: torch.Tensor) -> None:
        self.uid = uid
        self.completions = completions
        self.rewards_G = rewards_G
        self.advantages_G = group_advantages(rewards_G[None], unbiased=False)[0]


@dataclass
class ScriptedWorld:
    """A draw function: per cell a prompt cursor; per prompt a digit = completions that answer right.

    Digits ``1..G-1`` give a mixed (informative) group, ``0`` and ``G`` a tied one; prompts past the
    end of a script are tied (all wrong). Spaces in a script are only for reading (round breaks).
    """

    scripts: list[str]
    cursors: list[int] = field(default_factory=list)
    dispatches: list[list[int]] = field(default_factory=list)
    live: weakref.WeakSet[Payload] = field(default_factory=weakref.WeakSet)
    max_live_at_dispatch: int = 0
    last_handed_out: list[ScoredGroup] = field(default_factory=list)
    handed_out: list[weakref.ref[ScoredGroup]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.scripts = [s.replace(" ", "") for s in self.scripts]
        self.cursors = [0] * len(self.scripts)

    def __call__(self, counts: list[int]) -> list[list[ScoredGroup]]:
        self.dispatches.append(list(counts))
        self.max_live_at_dispatch = max(self.max_live_at_dispatch, len(self.live))
        out = [[self._group(cell) for _ in range(n)] for cell, n in enumerate(counts)]
        self.last_handed_out = [g for groups in out for g in groups]
        self.handed_out += [weakref.ref(g) for g in self.last_handed_out]
        return out

    def _group(self, cell: int) -> ScoredGroup:
        index = self.cursors[cell]
        self.cursors[cell] += 1
        script = self.scripts[cell]
        right = int(script[index]) if index < len(script) else 0
        completions = [ANSWER] * right + [WRONG] * (G - right)
        prompt = f"cell {cell} prompt {index}: what is 6 x 7?"
        inputs = [RewardInput(prompt=prompt, completion=c, ground_truth=ANSWER) for c in completions]
        uids = [f"c{cell}p{index}#{k}" for k in range(G)]
        rewards_G = torch.tensor(score_completions(EXACT_MATCH, inputs, uids))
        payload = Payload(f"c{cell}p{index}", completions, rewards_G)
        self.live.add(payload)
        return ScoredGroup(spread=float(group_reward_spread(rewards_G[None])[0]), payload=payload)


def run(
    scripts: list[str],
    *,
    per_cell: int,
    quota: int,
    budget: int,
    dispatch: str = "per_round",
    mode: str = "all_cells",
    on_exhausted: str = "proceed",
) -> tuple[ScriptedWorld, DynamicSamplingResult]:
    world = ScriptedWorld(scripts)
    result = collect_dynamic(
        world,
        groups_per_step=per_cell * len(scripts),
        group_size=G,
        num_cells=len(scripts),
        quota=quota,
        max_extra_rounds=budget,
        on_budget_exhausted=on_exhausted,  # type: ignore[arg-type]
        refill_dispatch=dispatch,  # type: ignore[arg-type]
        refill_mode=mode,  # type: ignore[arg-type]
    )
    return world, result


def uids(result: DynamicSamplingResult) -> list[str]:
    return [g.payload.uid for g in result.groups]


def cell_uids(result: DynamicSamplingResult, cell: int) -> list[str]:
    return [g.payload.uid for g in result.groups if g.cell == cell]


def metric(result: DynamicSamplingResult, name: str) -> float:
    return result.metrics[f"train/grpo_dynamic_sampling_{name}"]


# --- the basics: off, selection, accounting ---------------------------------------------------------


def test_quota_zero_returns_the_base_draw_unchanged() -> None:
    world, result = run(["0240"], per_cell=4, quota=0, budget=3)
    assert uids(result) == ["c0p0", "c0p1", "c0p2", "c0p3"]  # draw order, no reordering
    assert world.dispatches == [[4]]
    assert result.rounds_drawn_per_cell == [1]
    assert result.metrics == {
        "train/grpo_dynamic_sampling_extra_rollouts": 0.0,
        "train/grpo_dynamic_sampling_dropped_trajectories": 0.0,
        "train/grpo_dynamic_sampling_refill_dispatches": 0.0,
        "train/grpo_dynamic_sampling_shortfall": 0.0,
        "train/grpo_informative_group_count": 1.0,  # only "2" is mixed; "4" ties at 1.0
    }


def test_real_reward_stamps_the_spread() -> None:
    _, result = run(["0134"], per_cell=4, quota=0, budget=0)
    assert [g.spread for g in result.groups] == [0.0, 1.0, 1.0, 0.0]
    assert result.groups[1].payload.rewards_G.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_selection_is_informative_first_then_first_seen_without_refill() -> None:
    world, result = run(["0303"], per_cell=4, quota=2, budget=3)
    assert uids(result) == ["c0p1", "c0p3", "c0p0", "c0p2"]
    assert world.dispatches == [[4]]
    assert metric(result, "refill_dispatches") == 0 and metric(result, "dropped_trajectories") == 0


def test_refill_selection_stamps_and_accounting() -> None:
    world, result = run(["0202 3000"], per_cell=4, quota=3, budget=4)
    assert world.dispatches == [[4], [4]]
    assert uids(result) == ["c0p1", "c0p3", "c0p4", "c0p0"]
    assert [(g.cell, g.draw_round, g.order) for g in result.groups] == [(0, 0, 1), (0, 0, 3), (0, 1, 4), (0, 0, 0)]
    assert result.rounds_drawn_per_cell == [2]
    assert metric(result, "extra_rollouts") == 1
    assert metric(result, "refill_dispatches") == 1
    assert metric(result, "dropped_trajectories") == 4 * G  # p2, p5, p6, p7
    assert result.metrics["train/grpo_informative_group_count"] == 3
    # Groups dropped from round 1 lost their payload even though the draw side still holds the records.
    dropped = [g for g in world.last_handed_out if g.order in (5, 6, 7)]
    assert len(dropped) == 3 and all(g.payload is None for g in dropped)
    assert sorted(p.uid for p in world.live) == sorted(uids(result))


def test_quota_is_split_exactly_across_cells() -> None:
    # quota 5 over 3 cells owes [2, 2, 1]: cell 2's single informative group meets its share, cell 1's
    # does not until round 1.
    world, result = run(["33", "20 20", "10"], per_cell=2, quota=5, budget=3)
    assert world.dispatches == [[2, 2, 2], [2, 2, 2]]
    assert [cell_uids(result, c) for c in range(3)] == [["c0p0", "c0p1"], ["c1p0", "c1p2"], ["c2p0", "c2p1"]]
    assert result.rounds_drawn_per_cell == [2, 2, 2]
    assert metric(result, "shortfall") == 0
    # Cell order in the trained set: cell 0's groups, then cell 1's, then cell 2's.
    assert [g.cell for g in result.groups] == [0, 0, 1, 1, 2, 2]


# --- budget exhaustion ------------------------------------------------------------------------------


def test_raise_at_budget_exhaustion_says_what_to_change() -> None:
    world = ScriptedWorld(["0100 0000 0000 1111"])
    with pytest.raises(DynamicSamplingBudgetError) as info:
        collect_dynamic(
            world,
            groups_per_step=4,
            group_size=G,
            num_cells=1,
            quota=3,
            max_extra_rounds=2,
            on_budget_exhausted="raise",
            refill_dispatch="per_round",
        )
    err = info.value
    assert isinstance(err, TrainingError) and isinstance(err, PosttrainError)
    assert (err.found, err.quota, err.extra_rounds) == (1, 3, 2)
    message = str(err)
    for needle in (
        "found 1 informative groups",
        "against the quota of 3",
        "in 12 drawn groups after 2 extra rounds",
        "rl.dynamic_sampling_max_extra_rollouts=2",
        "Raise rl.dynamic_sampling_max_extra_rollouts",
        "lower the quota (rl.min_informative_groups_frac or rl.min_informative_groups)",
        "rl.dynamic_sampling_on_budget_exhausted=proceed",
        "fix the reward (rl.reward)",
    ):
        assert needle in message, message
    assert world.dispatches == [[4], [4], [4]]
    assert len(world.live) == 0  # an abandoned step keeps nothing


def test_raise_names_the_short_cells() -> None:
    with pytest.raises(DynamicSamplingBudgetError, match=r"short data cells: cell 1: 0 of 1\)"):
        run(["10", "00"], per_cell=2, quota=2, budget=1, on_exhausted="raise")


def test_proceed_fills_with_tied_groups_and_logs_the_shortfall() -> None:
    world, result = run(["0100 0000 0000 1111"], per_cell=4, quota=3, budget=2)
    assert uids(result) == ["c0p1", "c0p0", "c0p2", "c0p3"]
    assert metric(result, "shortfall") == 2
    assert result.metrics["train/grpo_informative_group_count"] == 1
    assert metric(result, "extra_rollouts") == 2 and metric(result, "refill_dispatches") == 2
    assert metric(result, "dropped_trajectories") == (12 - 4) * G
    assert world.cursors == [12]


def test_zero_budget_decides_right_after_the_base_draw() -> None:
    world, result = run(["1000"], per_cell=4, quota=2, budget=0)
    assert world.dispatches == [[4]] and metric(result, "shortfall") == 1
    with pytest.raises(DynamicSamplingBudgetError, match="after 0 extra rounds"):
        run(["1000"], per_cell=4, quota=2, budget=0, on_exhausted="raise")


# --- dispatch modes ---------------------------------------------------------------------------------


def test_per_round_versus_whole_budget_dispatch_counts() -> None:
    script = ["1000 0000 0000 1000"]
    world, per = run(script, per_cell=4, quota=2, budget=5)
    assert world.dispatches == [[4], [4], [4], [4]]
    assert metric(per, "refill_dispatches") == 3 and metric(per, "extra_rollouts") == 3
    world, whole = run(script, per_cell=4, quota=2, budget=5, dispatch="whole_budget")
    assert world.dispatches == [[4], [20]]  # budget x prompts_per_data_cell in ONE call
    assert metric(whole, "refill_dispatches") == 1 and metric(whole, "extra_rollouts") == 5
    assert whole.rounds_drawn_per_cell == [6]
    assert uids(per) == uids(whole) == ["c0p0", "c0p12", "c0p1", "c0p2"]
    # Rounds of a wide call are stamped by position: prompt 12 is round 3 of the wide call.
    assert [g.draw_round for g in whole.groups] == [0, 3, 0, 0]


def test_modes_agree_when_no_refill_is_needed() -> None:
    for mode in ("all_cells", "short_cells"):
        w1, per = run(["3130", "0300"], per_cell=4, quota=3, budget=4, mode=mode)
        w2, whole = run(["3130", "0300"], per_cell=4, quota=3, budget=4, mode=mode, dispatch="whole_budget")
        assert w1.dispatches == w2.dispatches == [[4, 4]]
        assert uids(per) == uids(whole)
        assert per.rounds_drawn_per_cell == whole.rounds_drawn_per_cell == [1, 1]


def test_modes_agree_when_the_budget_is_exhausted_under_both() -> None:
    script = ["0100 0000 2000 0000"]
    _, per = run(script, per_cell=4, quota=3, budget=3)
    _, whole = run(script, per_cell=4, quota=3, budget=3, dispatch="whole_budget")
    assert uids(per) == uids(whole) == ["c0p1", "c0p8", "c0p0", "c0p2"]
    assert per.rounds_drawn_per_cell == whole.rounds_drawn_per_cell == [4]
    assert metric(per, "shortfall") == metric(whole, "shortfall") == 1


def test_modes_agree_on_the_trained_set_under_full_dapo_but_not_on_the_cursor() -> None:
    script = ["1010 0110 1111 1111"]  # quota 4 = the whole capacity: met after round 1
    w1, per = run(script, per_cell=4, quota=4, budget=4)
    w2, whole = run(script, per_cell=4, quota=4, budget=4, dispatch="whole_budget")
    assert uids(per) == uids(whole) == ["c0p0", "c0p2", "c0p5", "c0p6"]
    k = 1
    assert per.rounds_drawn_per_cell == [1 + k] and whole.rounds_drawn_per_cell == [1 + 4]
    assert whole.rounds_drawn_per_cell[0] - per.rounds_drawn_per_cell[0] == 4 - k
    assert w1.cursors == [8] and w2.cursors == [20]


def test_below_full_dapo_whole_budget_replaces_tied_filler() -> None:
    # Quota 2 of capacity 4: per_round stops after round 1 with two tied fillers; whole_budget also
    # draws rounds 2 and 3, whose informative groups displace that filler.
    script = ["1000 1000 1100 0000"]
    _, per = run(script, per_cell=4, quota=2, budget=3)
    _, whole = run(script, per_cell=4, quota=2, budget=3, dispatch="whole_budget")
    assert uids(per) == ["c0p0", "c0p4", "c0p1", "c0p2"]
    assert uids(whole) == ["c0p0", "c0p4", "c0p8", "c0p9"]
    assert per.metrics["train/grpo_informative_group_count"] == 2
    assert whole.metrics["train/grpo_informative_group_count"] == 4
    assert whole.rounds_drawn_per_cell[0] - per.rounds_drawn_per_cell[0] == 3 - 1


# --- short_cells ------------------------------------------------------------------------------------


def test_short_cells_participation() -> None:
    # Full DAPO, shares [2, 2, 2]: cell 0 is satisfied by the base draw, cell 1 after round 1, cell 2
    # after round 2.
    scripts = ["11", "10 10 00 00", "00 00 11 00"]
    w, per_all = run(scripts, per_cell=2, quota=6, budget=3)
    assert w.dispatches == [[2, 2, 2], [2, 2, 2], [2, 2, 2]]
    w, per_short = run(scripts, per_cell=2, quota=6, budget=3, mode="short_cells")
    assert w.dispatches == [[2, 2, 2], [0, 2, 2], [0, 0, 2]]  # satisfied cells idle, re-counted per round
    assert per_short.rounds_drawn_per_cell == [1, 2, 3]
    assert metric(per_short, "refill_dispatches") == 2 and metric(per_short, "extra_rollouts") == 2
    w, whole_short = run(scripts, per_cell=2, quota=6, budget=3, mode="short_cells", dispatch="whole_budget")
    # The participating set is fixed before the wide call: cell 1 (satisfied midway) still draws every
    # round, cell 0 (satisfied before) stays idle.
    assert w.dispatches == [[2, 2, 2], [0, 6, 6]]
    assert whole_short.rounds_drawn_per_cell == [1, 4, 4]
    expected = ["c0p0", "c0p1", "c1p0", "c1p2", "c2p4", "c2p5"]
    assert uids(per_all) == uids(per_short) == uids(whole_short) == expected
    # Cursor: whole_budget advances each participating cell by budget - k_cell rounds more.
    k = [r - 1 for r in per_short.rounds_drawn_per_cell]
    assert [
        w_r - p_r for w_r, p_r in zip(whole_short.rounds_drawn_per_cell, per_short.rounds_drawn_per_cell, strict=True)
    ] == [0, 3 - k[1], 3 - k[2]]


# --- an independent reference and the spec's equalities over random scripts ---------------------------


def reference(scripts: list[str], *, per_cell: int, quota: int, budget: int, dispatch: str, mode: str) -> tuple:
    """A direct reading of the spec: returns (dispatches, rounds per cell, trained uids per cell)."""
    cells = len(scripts)
    shares = [quota // cells + (1 if c < quota % cells else 0) for c in range(cells)]

    def informative(c: int, i: int) -> bool:
        return i < len(scripts[c]) and scripts[c][i] not in ("0", str(G))

    rounds = [1] * cells

    def short() -> list[bool]:
        return [sum(informative(c, i) for i in range(rounds[c] * per_cell)) < shares[c] for c in range(cells)]

    dispatches = [[per_cell] * cells]
    if quota and any(short()) and budget:
        if dispatch == "per_round":
            for _ in range(budget):
                if not any(now := short()):
                    break
                part = now if mode == "short_cells" else [True] * cells
                dispatches.append([per_cell * p for p in part])
                rounds = [r + p for r, p in zip(rounds, part, strict=True)]
        else:
            part = short() if mode == "short_cells" else [True] * cells
            dispatches.append([budget * per_cell * p for p in part])
            rounds = [r + budget * p for r, p in zip(rounds, part, strict=True)]
    trained = []
    for c in range(cells):
        drawn = list(range(rounds[c] * per_cell))
        if quota:
            drawn = sorted(drawn, key=lambda i, c=c: (not informative(c, i), i))[:per_cell]
        trained.append([f"c{c}p{i}" for i in drawn])
    return dispatches, rounds, trained


def random_case(rng: random.Random) -> tuple[list[str], int, int, int]:
    cells, per_cell, budget = rng.randint(1, 3), rng.randint(1, 4), rng.randint(0, 4)
    rate = rng.choice([0.05, 0.2, 0.5])
    length = (budget + 1) * per_cell
    scripts = [
        "".join(str(rng.randint(1, G - 1)) if rng.random() < rate else rng.choice("0" + str(G)) for _ in range(length))
        for _ in range(cells)
    ]
    quota = rng.choice([0, 1, rng.randint(1, cells * per_cell), cells * per_cell])
    return scripts, per_cell, quota, budget


def test_driver_matches_reference_and_spec_equalities_on_random_scripts() -> None:
    rng = random.Random(1234)
    for _ in range(250):
        scripts, per_cell, quota, budget = random_case(rng)
        for mode in ("all_cells", "short_cells"):
            got = {}
            for dispatch in ("per_round", "whole_budget"):
                world, result = run(
                    scripts, per_cell=per_cell, quota=quota, budget=budget, dispatch=dispatch, mode=mode
                )
                ref_dispatches, ref_rounds, ref_trained = reference(
                    scripts, per_cell=per_cell, quota=quota, budget=budget, dispatch=dispatch, mode=mode
                )
                assert world.dispatches == ref_dispatches
                assert result.rounds_drawn_per_cell == ref_rounds
                assert [cell_uids(result, c) for c in range(len(scripts))] == ref_trained
                assert len(result.groups) == per_cell * len(scripts)
                assert metric(result, "refill_dispatches") == len(ref_dispatches) - 1
                drawn = sum(sum(d) for d in ref_dispatches)
                assert metric(result, "dropped_trajectories") == (drawn - per_cell * len(scripts)) * G
                got[dispatch] = result
            check_spec_equalities(
                got["per_round"], got["whole_budget"], cells=len(scripts), per_cell=per_cell, quota=quota, budget=budget
            )


def check_spec_equalities(
    per: DynamicSamplingResult, whole: DynamicSamplingResult, *, cells: int, per_cell: int, quota: int, budget: int
) -> None:
    """The guarantees of the spec's "Refill dispatch" paragraph, cell by cell (k = per_round's rounds)."""
    refilled = metric(per, "refill_dispatches") > 0
    assert refilled == (metric(whole, "refill_dispatches") > 0)
    full = quota == cells * per_cell
    for c in range(cells):
        k = per.rounds_drawn_per_cell[c] - 1
        participating = whole.rounds_drawn_per_cell[c] > 1
        same_set = cell_uids(per, c) == cell_uids(whole, c)
        if not refilled or not participating:
            assert same_set and per.rounds_drawn_per_cell[c] == whole.rounds_drawn_per_cell[c]
            continue
        assert whole.rounds_drawn_per_cell[c] == 1 + budget
        assert whole.rounds_drawn_per_cell[c] - per.rounds_drawn_per_cell[c] == budget - k
        if k == budget or full:
            assert same_set
            continue
        # Below full DAPO with an early stop: whole_budget only swaps tied filler for informative groups
        # from rounds per_round never drew.
        per_groups = {g.payload.uid: g for g in per.groups if g.cell == c}
        whole_groups = {g.payload.uid: g for g in whole.groups if g.cell == c}
        assert all(per_groups[u].spread == 0 for u in per_groups.keys() - whole_groups.keys())
        assert all(
            whole_groups[u].spread > 0 and whole_groups[u].draw_round > k
            for u in whole_groups.keys() - per_groups.keys()
        )


# --- memory -----------------------------------------------------------------------------------------


def test_no_growth_in_retained_trajectories_over_many_steps() -> None:
    rng = random.Random(7)
    cells, per_cell, budget, steps = 2, 8, 6, 120
    length = steps * (budget + 1) * per_cell
    scripts = ["".join("2" if rng.random() < 0.2 else "0" for _ in range(length)) for _ in range(cells)]
    for dispatch in ("per_round", "whole_budget"):
        world = ScriptedWorld(scripts)
        result = None
        dropped = 0.0
        for _ in range(steps):
            result = collect_dynamic(
                world,
                groups_per_step=cells * per_cell,
                group_size=G,
                num_cells=cells,
                quota=cells * per_cell,
                max_extra_rounds=budget,
                on_budget_exhausted="proceed",
                refill_dispatch=dispatch,  # type: ignore[arg-type]
            )
            dropped += metric(result, "dropped_trajectories")
            # Only the trained set of the step just collected is alive (the previous one was released
            # when `result` was rebound): no growth whatever was drawn and dropped.
            assert len(world.live) == cells * per_cell
            assert {p.uid for p in world.live} == set(uids(result))
        world.last_handed_out = []
        # Not even the group records outlive the step unless trained on.
        assert sum(r() is not None for r in world.handed_out) == cells * per_cell
        assert dropped > 10 * steps * cells * per_cell * G / 4  # heavy dropping really happened
        if dispatch == "per_round":
            # Between rounds a step holds at most its current selection (plus the previous result).
            assert world.max_live_at_dispatch <= 2 * cells * per_cell
        del result
        assert len(world.live) == 0


# --- config plumbing --------------------------------------------------------------------------------


def test_preflight_rejects_both_spellings_and_guards_a_tiny_literal() -> None:
    both = preflight(build_config(None, ["rl.min_informative_groups=2", "rl.min_informative_groups_frac=0.5"]))
    assert any("rl.min_informative_groups and rl.min_informative_groups_frac are both set" in e for e in both.errors), (
        both.errors
    )
    layout = ["rl.batch_per_replica=64", "rl.group_size=4"]  # groups_per_step = 16
    tiny = preflight(build_config(None, [*layout, "rl.min_informative_groups=2"]))
    assert tiny.errors == []
    (guard,) = [w for w in tiny.warnings if "min_informative_groups" in w]
    for needle in ("rl.min_informative_groups=2", "groups_per_step=16", "rl.min_informative_groups_frac"):
        assert needle in guard, guard
    refused = preflight(build_config(None, [*layout, "rl.min_informative_groups=2", "rl.recipe_guard_severity=error"]))
    assert any(e.startswith("recipe guard") and "groups_per_step=16" in e for e in refused.errors)
    for fine in (["rl.min_informative_groups=8"], ["rl.min_informative_groups_frac=0.1"]):
        findings = preflight(build_config(None, [*layout, *fine, "rl.recipe_guard_severity=error"]))
        assert findings.errors == [] and not any("min_informative_groups" in w for w in findings.warnings)


def test_groups_of_one_completion_are_guarded_and_never_meet_a_quota() -> None:
    """rl.group_size=1 gives every GRPO advantage 0: a recipe-guard warning (an error under
    recipe_guard_severity=error), and an error with dynamic sampling, whose quota can never be met."""
    layout = ["rl.batch_per_replica=4", "rl.group_size=1"]
    warned = preflight(build_config(None, layout))
    assert warned.errors == []
    (guard,) = [w for w in warned.warnings if "rl.group_size=1" in w]
    assert guard.startswith("recipe guard") and "advantage is 0" in guard, guard
    refused = preflight(build_config(None, [*layout, "rl.recipe_guard_severity=error"]))
    assert any(e.startswith("recipe guard: rl.group_size=1") for e in refused.errors), refused.errors
    quota = preflight(build_config(None, [*layout, "rl.min_informative_groups_frac=1.0"]))
    assert any("quota can never be met" in e and "rl.group_size=1" in e for e in quota.errors), quota.errors
    two = preflight(build_config(None, ["rl.batch_per_replica=4", "rl.group_size=2", "rl.recipe_guard_severity=error"]))
    assert not any("group_size" in m for m in [*two.errors, *two.warnings])


def test_config_drives_the_driver_and_the_log_line() -> None:
    cfg = build_config(
        None,
        [
            "rl.batch_per_replica=16",
            "rl.group_size=4",
            "rl.min_informative_groups_frac=0.5",
            "rl.dynamic_sampling_max_extra_rollouts=2",
            "rl.dynamic_sampling_refill_dispatch=whole_budget",
            "rl.dynamic_sampling_refill_mode=short_cells",
        ],
    )
    assert preflight(cfg).errors == []
    line = dynamic_sampling_log_line(cfg.rl)
    assert line is not None
    assert "quota 2 informative groups of groups_per_step=4" in line and "whole_budget/short_cells" in line
    world = ScriptedWorld(["1000 0000 1000"])
    result = collect_dynamic_for(cfg.rl, world)
    assert world.dispatches == [[4], [8]]
    assert uids(result) == ["c0p0", "c0p8", "c0p1", "c0p2"]
    assert dynamic_sampling_log_line(build_config(None, []).rl) is None


def test_bad_driver_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="groups_per_step=6 must be a positive multiple"):
        collect_dynamic(
            ScriptedWorld(["0"]),
            groups_per_step=6,
            group_size=G,
            num_cells=4,
            quota=1,
            max_extra_rounds=1,
            on_budget_exhausted="raise",
            refill_dispatch="per_round",
        )
    with pytest.raises(ValueError, match="quota=9 must lie in"):
        run(["0000"], per_cell=4, quota=9, budget=1)
    with pytest.raises(ValueError, match="refill_dispatch='wide'"):
        run(["0000"], per_cell=4, quota=1, budget=1, dispatch="wide")
