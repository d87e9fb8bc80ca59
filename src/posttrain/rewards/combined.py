"""Several rewards as one: ``rl.reward`` as a list, summed with ``rl.reward_weights``.

``WeightedRewards`` holds the parts and their weights and is itself a ``Reward`` (its ``requires``
is the union of the parts', its ground-truth check asks every part), so code that takes one reward
(the preflight's row checks, ``score_completions``) takes it too. ``score_parts`` is how the loop
scores: every part goes through ``score_completions`` on its own, so the null-is-not-zero rule, the
input checks and ``rl.reward_timeout_s`` hold for each part, and an error names the part. The
weighted sum starts from the first weighted part (not from 0.0), so one reward of weight 1 gives
exactly its own scores.

Metric keys: each part is logged as ``train/reward/<key>_mean`` where ``<key>`` is ``metric_key(name)``:
every character other than a letter, digit or underscore becomes ``_`` (``my.mod:score`` ->
``my_mod_score``), so a key never holds the ``/`` or ``.`` that sinks read as nesting.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.rewards.base import Reward, RewardInput
from posttrain.rewards.scoring import score_completions

_NOT_KEY = re.compile(r"[^A-Za-z0-9_]")


def metric_key(name: str) -> str:
    """``name`` as a metric-key segment: anything but ``[A-Za-z0-9_]`` becomes ``_``."""
    return _NOT_KEY.sub("_", name)


def reward_names(value: str | Sequence[str]) -> list[str]:
    """``rl.reward`` as a list of names (one name is a list of one)."""
    return [value] if isinstance(value, str) else list(value)


@dataclass
class WeightedRewards:
    """The parts of a combined reward, their weights, and the ``Reward`` surface of their sum."""

    parts: tuple[Reward, ...]
    weights: tuple[float, ...]
    name: str = field(init=False)
    """The parts' names joined by ``+``."""
    requires: frozenset[str] = field(init=False)
    """Every field any part requires."""

    def __post_init__(self) -> None:
        if len(self.parts) != len(self.weights):
            raise ValueError(f"{len(self.parts)} rewards but {len(self.weights)} weights (rl.reward_weights)")
        self.name = "+".join(part_name(p) for p in self.parts)
        self.requires = frozenset().union(*(getattr(p, "requires", frozenset({"prompt"})) for p in self.parts))

    def check_ground_truth(self, value: Any) -> str | None:
        """The first part's objection to ``value`` (named by the part), or None."""
        from posttrain.rewards.registry import ground_truth_problem

        for part in self.parts:
            problem = ground_truth_problem(part, value)
            if problem is not None:
                return problem
        return None

    def __call__(self, sample: RewardInput) -> float:
        """The weighted score of one sample, each part checked (``score_parts`` for a batch)."""
        return score_parts(self, [sample])[0][0]


def part_name(reward: Reward) -> str:
    return str(getattr(reward, "name", repr(reward)))


def score_parts(
    reward: Reward, inputs: list[RewardInput], uids: list[str] | None = None
) -> tuple[list[float], dict[str, list[float]]]:
    """``(weighted scores, {metric_key(part name): that part's scores})`` of ``inputs``.

    A plain reward is one part of weight 1 whose scores are returned as they are.
    """
    if not isinstance(reward, WeightedRewards):
        scores = score_completions(reward, inputs, uids)
        return scores, {metric_key(part_name(reward)): scores}
    per_part: dict[str, list[float]] = {}
    total: list[float] | None = None
    for part, weight in zip(reward.parts, reward.weights, strict=True):
        scores = score_completions(part, inputs, uids)
        per_part[metric_key(part_name(part))] = scores
        weighted = [weight * s for s in scores]
        total = weighted if total is None else [t + w for t, w in zip(total, weighted, strict=True)]
    return total or [], per_part


__all__ = ["WeightedRewards", "metric_key", "part_name", "reward_names", "score_parts"]
