"""The reward registry: names to scorers, custom scorers by import path, ground-truth checks.

``score_completions`` (``posttrain.rewards.scoring``, re-exported here) is the only way the loop
calls a reward. A reward may declare ``check_ground_truth(value) -> str | None``: the problem with
a ground-truth value it cannot use (``None`` when usable), so the preflight can refuse such a row
by file and line before any model loads instead of steps into the run.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.importing import import_object
from posttrain.rewards.base import Reward, RewardInput
from posttrain.rewards.combined import WeightedRewards, reward_names
from posttrain.rewards.scoring import DEFAULT_REWARD_TIMEOUT_S, describe_value, score_completions

GroundTruthCheck = Callable[[Any], "str | None"]
"""``check_ground_truth(value)``: why ``value`` is not a ground truth the reward can use, or None."""

# Modules whose import registers the built-in rewards; imported on first use so that this module and
# the built-ins can import each other's names without an import cycle.
_BUILTIN_MODULES = ("posttrain.rewards.builtin", "posttrain.rewards.countdown")
_REGISTRY: dict[str, Reward] = {}
_DEFAULT_REQUIRES = frozenset({"prompt"})


@dataclass
class FunctionReward:
    """A plain function ``RewardInput -> float`` with the ``name`` and ``requires`` of a ``Reward``.

    ``check_ground_truth`` (optional) vets a ground-truth value up front; ``batched``: ``fn`` takes
    the list of inputs and returns one score per input; ``timeout_s``: seconds one call may take
    (``rl.reward_timeout_s``; None: ``DEFAULT_REWARD_TIMEOUT_S``).
    """

    name: str
    requires: frozenset[str]
    fn: Callable[[Any], Any]
    check_ground_truth: GroundTruthCheck | None = None
    batched: bool = False
    timeout_s: float | None = None

    def __call__(self, sample: Any) -> Any:
        return self.fn(sample)


def _as_requires(value: Any, owner: str) -> frozenset[str]:
    # A bare string is one field name, not a set of characters.
    fields = [value] if isinstance(value, str) else value
    if not isinstance(fields, Iterable) or not all(isinstance(f, str) for f in fields):
        raise ValueError(f"reward {owner!r}: requires must be a set of field names, got {value!r}")
    return frozenset(fields)


def register_reward(
    name: str,
    *,
    requires: Iterable[str] = _DEFAULT_REQUIRES,
    check_ground_truth: GroundTruthCheck | None = None,
    batched: bool = False,
) -> Callable[[Callable[[RewardInput], Any]], FunctionReward]:
    """Decorator: register ``fn`` under ``name`` as a reward that needs the fields ``requires``
    (``check_ground_truth`` and ``batched``: see ``FunctionReward``).

    Registering a name twice fails at import time, so two rewards can never shadow each other.
    """

    def decorate(fn: Callable[[RewardInput], Any]) -> FunctionReward:
        if name in _REGISTRY:
            raise ValueError(f"reward name {name!r} is already registered")
        reward = FunctionReward(
            name=name,
            requires=_as_requires(requires, name),
            fn=fn,
            check_ground_truth=check_ground_truth,
            batched=batched,
        )
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
    obj = import_object(path, what="rl.reward", must_be_callable=True)
    if isinstance(obj, FunctionReward):
        return obj
    requires = _as_requires(getattr(obj, "requires", _DEFAULT_REQUIRES), path)
    check = getattr(obj, "check_ground_truth", None)
    if check is not None and not callable(check):
        raise ValueError(f"rl.reward={path}: check_ground_truth must be a function value -> str | None, got {check!r}")
    return FunctionReward(
        name=path, requires=requires, fn=obj, check_ground_truth=check, batched=bool(getattr(obj, "batched", False))
    )


def get_reward(
    name: str | Sequence[str], *, timeout_s: float | None = None, weights: Sequence[float] | None = None
) -> Reward:
    """Resolve a built-in reward name or a ``module:function`` import path; a list of them (or any
    ``weights``, ``rl.reward_weights``) gives a ``WeightedRewards`` of the parts (no weights: 1 each).

    A custom function takes a ``RewardInput`` and returns a float; it may declare the fields it needs
    as a ``requires`` attribute (default ``{"prompt"}``), a ``check_ground_truth(value) -> str | None``
    attribute, and ``batched = True`` (it then takes the list of inputs and returns a list of scores).
    ``timeout_s`` (``rl.reward_timeout_s``) bounds each call (``with_timeout``).
    """
    if isinstance(name, str) and not weights:
        reward = _resolve(name)
        return reward if timeout_s is None else with_timeout(reward, timeout_s)
    names = reward_names(name)
    scales = [float(w) for w in weights] if weights else [1.0] * len(names)
    if len(scales) != len(names):
        raise ValueError(
            f"rl.reward_weights has {len(scales)} weights for {len(names)} rewards ({', '.join(names)}); "
            "give one weight per reward, in the same order"
        )
    parts = tuple(get_reward(n, timeout_s=timeout_s) for n in names)
    return WeightedRewards(parts=parts, weights=tuple(scales))


def with_timeout(reward: Reward, timeout_s: float) -> Reward:
    """A copy of ``reward`` whose calls ``score_completions`` bounds by ``timeout_s`` seconds (0: none);
    the registered reward itself is left unchanged (a ``WeightedRewards``: each part)."""
    if isinstance(reward, WeightedRewards):
        return WeightedRewards(parts=tuple(with_timeout(p, timeout_s) for p in reward.parts), weights=reward.weights)
    if isinstance(reward, FunctionReward):
        return dataclasses.replace(reward, timeout_s=timeout_s)
    return FunctionReward(
        name=getattr(reward, "name", repr(reward)),
        requires=getattr(reward, "requires", _DEFAULT_REQUIRES),
        fn=reward,
        check_ground_truth=getattr(reward, "check_ground_truth", None),
        batched=bool(getattr(reward, "batched", False)),
        timeout_s=timeout_s,
    )


def ground_truth_problem(reward: Reward, value: Any) -> str | None:
    """What ``reward.check_ground_truth`` says about ``value`` (None: usable, or the reward declares no check)."""
    check = getattr(reward, "check_ground_truth", None)
    if check is None:
        return None
    try:
        problem = check(value)
    except Exception as exc:  # a user's check that raises counts as a refusal, with its reason
        return f"reward {getattr(reward, 'name', reward)!r}: check_ground_truth raised {type(exc).__name__}: {exc}"
    return None if problem is None else str(problem)


def _resolve(name: str) -> Reward:
    if ":" in name:
        return _import_custom(name)
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    if "," in name:  # several rewards written as one string: they are a list
        hint = f" (several rewards are a list: rl.reward=[{name.replace(' ', '')}])"
    raise ValueError(
        f"rl.reward: unknown reward {name!r}{hint}; known rewards: {', '.join(known_rewards())}; "
        "or give a custom scorer as 'module:function'"
    )


def reward_requires(name: str | Sequence[str]) -> frozenset[str]:
    """The fields reward ``name`` needs (a list: every part's); cheap for built-ins (no torch),
    imports a custom module."""
    return get_reward(name).requires


__all__ = [
    "DEFAULT_REWARD_TIMEOUT_S",
    "FunctionReward",
    "WeightedRewards",
    "describe_value",
    "get_reward",
    "ground_truth_problem",
    "known_rewards",
    "register_reward",
    "reward_requires",
    "score_completions",
    "with_timeout",
]
