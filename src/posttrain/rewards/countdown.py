"""The ``countdown`` rule reward: reach the target using each given number exactly once.

The completion's equation is parsed with ``ast`` and evaluated over exact fractions by a tiny
interpreter that knows only ``+ - * /``, parentheses and integer literals, so model output is
never executed and ``7 / 2 * 2`` is exactly 7.
"""

from __future__ import annotations

import ast
import json
import numbers
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from posttrain.errors import RewardError
from posttrain.rewards.base import RewardInput
from posttrain.rewards.registry import register_reward

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# Characters an equation may contain; anything else (letters, "**", "_", ".") is not an equation.
_EQUATION_CHARS_RE = re.compile(r"[\d\s+\-*/()]+")
# Far longer than any real Countdown equation; bounds the parser's work on adversarial output.
_MAX_EQUATION_CHARS = 300
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


@dataclass(frozen=True)
class CountdownTask:
    """The numbers to use (each exactly once) and the value to reach."""

    nums: tuple[int, ...]
    target: int


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def parse_countdown_truth(value: Any) -> CountdownTask:
    """Read ``{"nums": [ints], "target": int}`` (or its JSON string); anything else is a ``RewardError``."""
    raw = value
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RewardError(f"reward 'countdown': ground truth is a string but not JSON: {value!r}") from exc
    if not isinstance(raw, dict) or "nums" not in raw or "target" not in raw:
        raise RewardError(f"reward 'countdown': ground truth must be {{'nums': [ints], 'target': int}}, got {value!r}")
    nums_raw, target = raw["nums"], _as_int(raw["target"])
    nums = [_as_int(n) for n in nums_raw] if isinstance(nums_raw, (list, tuple)) else []
    if not nums or any(n is None for n in nums):
        raise RewardError(f"reward 'countdown': ground truth 'nums' must be a non-empty list of ints, got {nums_raw!r}")
    if target is None:
        raise RewardError(f"reward 'countdown': ground truth 'target' must be an int, got {raw['target']!r}")
    return CountdownTask(nums=tuple(n for n in nums if n is not None), target=target)


def extract_equation(completion: str) -> str | None:
    """The last ``<answer>...</answer>`` block, else the last line with a digit; None if neither."""
    blocks = _ANSWER_RE.findall(completion)
    if blocks:
        text = blocks[-1]
    else:
        lines = [line for line in completion.splitlines() if any(ch.isdigit() for ch in line)]
        if not lines:
            return None
        text = lines[-1]
    # Models often write "expr = target"; the left side is the equation that is checked.
    return text.split("=", 1)[0].strip()


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an allowed expression tree; records each integer literal in ``used``."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left = _evaluate(node.left, used)
        right = _evaluate(node.right, used)
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"{type(node).__name__} is not allowed in a countdown equation")


def score_equation(equation: str, task: CountdownTask) -> float:
    """1.0 when ``equation`` uses exactly ``task.nums`` and evaluates to ``task.target``, else 0.0."""
    if len(equation) > _MAX_EQUATION_CHARS or not _EQUATION_CHARS_RE.fullmatch(equation):
        return 0.0
    try:
        tree = ast.parse(equation, mode="eval")
        used: list[int] = []
        value = _evaluate(tree.body, used)
    except ZeroDivisionError:
        return 0.0
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return 0.0
    if Counter(used) != Counter(task.nums):
        return 0.0
    return 1.0 if value == task.target else 0.0


def _countdown_truth_problem(value: Any) -> str | None:
    try:
        parse_countdown_truth(value)
    except RewardError as exc:
        return str(exc)
    return None


@register_reward(
    "countdown", requires=frozenset({"prompt", "ground_truth"}), check_ground_truth=_countdown_truth_problem
)
def countdown(sample: RewardInput) -> float:
    """1.0 when the completion's equation uses each number once and reaches the target."""
    if sample.ground_truth is None:
        raise RewardError(
            "reward 'countdown' needs a ground truth but the sample has none (missing field ground_truth)"
        )
    task = parse_countdown_truth(sample.ground_truth)
    equation = extract_equation(sample.completion)
    return 0.0 if equation is None else score_equation(equation, task)
