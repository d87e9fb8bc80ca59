"""The reward registry: names to scorers, custom scorers by import path, and checked scoring.

``score_completions`` is the only way the loop calls a reward: it refuses a sample that lacks a
field the reward requires and a score that is not a finite number, so a broken scorer or a missing
answer can never pass as a legitimate zero.
"""

from __future__ import annotations

import difflib
import importlib
import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from posttrain.errors import RewardError
from posttrain.rewards.base import Reward, RewardInput

# Modules whose import registers the built-in rewards; imported on first use so that this module and
# the built-ins can import each other's names without an import cycle.
_BUILTIN_MODULES = ("posttrain.rewards.builtin", "posttrain.rewards.countdown")
_REGISTRY: dict[str, Reward] = {}
_DEFAULT_REQUIRES = frozenset({"prompt"})


@dataclass
class FunctionReward:
    """A plain function ``RewardInput -> float`` with the ``name`` and ``requires`` of a ``Reward``."""

    name: str
    requires: frozenset[str]
    fn: Callable[[RewardInput], Any]

    def __call__(self, sample: RewardInput) -> float:
        return self.fn(sample)


def _as_requires(value: Any, owner: str) -> frozenset[str]:
    # A bare string is one field name, not a set of characters.
    fields = [value] if isinstance(value, str) else value
    if not isinstance(fields, Iterable) or not all(isinstance(f, str) for f in fields):
        raise ValueError(f"reward {owner!r}: requires must be a set of field names, got {value!r}")
    return frozenset(fields)


def register_reward(
    name: str, *, requires: Iterable[str] = _DEFAULT_REQUIRES
) -> Callable[[Callable[[RewardInput], Any]], FunctionReward]:
    """Decorator: register ``fn`` under ``name`` as a reward that needs the fields ``requires``.

    Registering a name twice fails at import time, so two rewards can never shadow each other.
    """

    def decorate(fn: Callable[[RewardInput], Any]) -> FunctionReward:
        if name in _REGISTRY:
            raise ValueError(f"reward name {name!r} is already registered")
        reward = FunctionReward(name=name, requires=_as_requires(requires, name), fn=fn)
        _REGISTRY[name] = reward
        return reward

    return decorate


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def known_rewards() -> list[str]:
    """The built-in reward names, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def _import_custom(path: str) -> Reward:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"rl.reward: {path!r} is not of the form 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code is a config problem to report
        raise ValueError(f"rl.reward: cannot import module {module_name!r} of {path!r}: {exc!r}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"rl.reward: module {module_name!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    if isinstance(obj, FunctionReward):
        return obj
    if not callable(obj):
        raise ValueError(f"rl.reward: {path!r} is a {type(obj).__name__}, not a function")
    requires = _as_requires(getattr(obj, "requires", _DEFAULT_REQUIRES), path)
    return FunctionReward(name=path, requires=requires, fn=obj)


def get_reward(name: str) -> Reward:
    """Resolve a built-in reward name or a ``module:function`` import path.

    A custom function takes a ``RewardInput`` and returns a float; it may declare the fields it needs
    as a ``requires`` attribute (default ``{"prompt"}``).
    """
    if ":" in name:
        return _import_custom(name)
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"rl.reward: unknown reward {name!r}{hint}; known rewards: {', '.join(known_rewards())}; "
        "or give a custom scorer as 'module:function'"
    )


def reward_requires(name: str) -> frozenset[str]:
    """The fields reward ``name`` needs; cheap for built-ins (no torch), imports a custom module."""
    return get_reward(name).requires


def _field_value(sample: RewardInput, field: str) -> Any:
    if hasattr(sample, field):
        return getattr(sample, field)
    return sample.metadata.get(field)


def _checked_score(value: Any, reward_name: str, label: str) -> float:
    # bool is an int subclass but a True/False "score" is almost always a forgotten float().
    if value is None or isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward {reward_name!r} returned {value!r} ({type(value).__name__}) for {label}; "
            "a reward must return a finite float"
        )
    score = float(value)
    if not math.isfinite(score):
        raise RewardError(f"reward {reward_name!r} returned {score} for {label}; a reward must return a finite float")
    return score


def score_completions(reward: Reward, inputs: list[RewardInput], uids: list[str] | None = None) -> list[float]:
    """Score every input with ``reward``; any missing field, bad score or exception is a ``RewardError``.

    ``uids`` (one per input) name the samples in errors; without them the index is used.
    """
    if uids is not None and len(uids) != len(inputs):
        raise ValueError(f"score_completions got {len(uids)} uids for {len(inputs)} inputs")
    name = getattr(reward, "name", repr(reward))
    requires = getattr(reward, "requires", _DEFAULT_REQUIRES)
    scores: list[float] = []
    for i, sample in enumerate(inputs):
        label = f"sample {uids[i]!r} (index {i})" if uids is not None else f"sample index {i}"
        if not isinstance(sample.completion, str):
            raise RewardError(
                f"reward {name!r}: {label} has a malformed completion {sample.completion!r} (expected text)"
            )
        for field in sorted(requires):
            if _field_value(sample, field) is None:
                hint = (
                    "; set rl.data.response_column to the ground-truth column, or pick a reward that needs none"
                    if field == "ground_truth"
                    else ""
                )
                raise RewardError(
                    f"reward {name!r}: {label} is missing field {field} (the reward requires {sorted(requires)}){hint}"
                )
        try:
            value = reward(sample)
        except Exception as exc:  # re-raised with the reward and sample named; the cause stays chained
            raise RewardError(f"reward {name!r} failed on {label}: {type(exc).__name__}: {exc}") from exc
        scores.append(_checked_score(value, name, label))
    return scores
