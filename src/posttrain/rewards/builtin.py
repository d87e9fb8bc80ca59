"""The rule rewards: ``arithmetic``, ``exact_match``, ``gsm8k``, ``nonempty`` and ``constant``.

Each returns 1.0 or 0.0 for a well-formed completion (a completion with no answer in it is a real
failed attempt and scores 0.0) and raises ``RewardError`` when the *ground truth* is unusable,
because that is a data fault, not something the policy did. Each reward that reads a ground truth
also declares ``check_ground_truth``, the same test run on a bare value, so the preflight refuses
such rows by file and line before the run starts.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from posttrain.errors import RewardError
from posttrain.rewards.base import RewardInput
from posttrain.rewards.registry import register_reward
from posttrain.rewards.scoring import describe_value

_NEEDS_ANSWER = frozenset({"prompt", "ground_truth"})
_MINUS = "-\u2212"  # ASCII hyphen-minus and the Unicode minus sign

# A number: an optional minus that is not the binary minus of "8-2" (so it may not follow a word
# character or a dot), then either thousands groups "1,234,567" or plain digits, then decimals.
_NUMBER_RE = re.compile(rf"(?:(?<![\w.])[{_MINUS}])?(?:\d{{1,3}}(?:,\d{{3}})+(?!\d)|\d+)(?:\.\d+)?")
# After "####" GSM8K answers are plain numbers once commas are dropped.
_GSM8K_NUMBER_RE = re.compile(rf"[{_MINUS}]?\d+(?:\.\d+)?")
_PLAIN_NUMBER_RE = re.compile(rf"[{_MINUS}]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _to_decimal(text: str) -> Decimal:
    return Decimal(text.replace(",", "").replace("\u2212", "-"))


def _ground_truth(sample: RewardInput, reward: str) -> Any:
    if sample.ground_truth is None:
        raise RewardError(
            f"reward {reward!r} needs a ground truth but the sample has none (missing field ground_truth)"
        )
    return sample.ground_truth


def numeric_ground_truth(value: Any, reward: str) -> Decimal:
    """A ground truth given as int, float or numeric string, as an exact ``Decimal``."""
    number: Decimal | None = None
    if isinstance(value, bool):
        number = None  # True/False is never a numeric answer
    elif isinstance(value, numbers.Integral):
        number = Decimal(int(value))
    elif isinstance(value, numbers.Real) and math.isfinite(float(value)):
        # repr gives the shortest decimal that round-trips, so 0.1 stays 0.1, not 0.1000000000000000055.
        number = Decimal(repr(float(value)))
    elif isinstance(value, str):
        text = value.strip().replace(",", "")
        if _PLAIN_NUMBER_RE.fullmatch(text):
            try:
                number = _to_decimal(text)
            except InvalidOperation:
                number = None
    if number is None:
        raise RewardError(
            f"reward {reward!r}: ground truth {describe_value(value)} ({type(value).__name__}) is not a number; "
            'give an int, a finite float or a numeric string such as "12"'
        )
    return number


def _problem(check: Callable[[Any], object]) -> Callable[[Any], str | None]:
    """``check_ground_truth`` from a parser that raises ``RewardError`` on an unusable value."""

    def check_ground_truth(value: Any) -> str | None:
        try:
            check(value)
        except RewardError as exc:
            return str(exc)
        return None

    return check_ground_truth


def last_number(text: str) -> Decimal | None:
    """The last number written in ``text`` (thousands commas dropped), or None when there is none."""
    matches = _NUMBER_RE.findall(text)
    return _to_decimal(matches[-1]) if matches else None


def first_number(text: str) -> Decimal | None:
    """The first number written in ``text`` (thousands commas dropped), or None when there is none."""
    match = _NUMBER_RE.search(text)
    return _to_decimal(match.group(0)) if match else None


@register_reward(
    "arithmetic", requires=_NEEDS_ANSWER, check_ground_truth=_problem(lambda v: numeric_ground_truth(v, "arithmetic"))
)
def arithmetic(sample: RewardInput) -> float:
    """1.0 when the last number in the completion equals the ground truth numerically (the answer
    a completion ends on, after any working)."""
    truth = numeric_ground_truth(_ground_truth(sample, "arithmetic"), "arithmetic")
    answer = last_number(sample.completion)
    return 1.0 if answer is not None and answer == truth else 0.0


@register_reward(
    "arithmetic_first",
    requires=_NEEDS_ANSWER,
    check_ground_truth=_problem(lambda v: numeric_ground_truth(v, "arithmetic_first")),
)
def arithmetic_first(sample: RewardInput) -> float:
    """1.0 when the first number in the completion equals the ground truth numerically: the answer
    given up front, as "Reply with only the number" asks (restating "13 + 14 = 27" scores 0)."""
    truth = numeric_ground_truth(_ground_truth(sample, "arithmetic_first"), "arithmetic_first")
    answer = first_number(sample.completion)
    return 1.0 if answer is not None and answer == truth else 0.0


def _collapse(text: str) -> str:
    return " ".join(text.split())


def exact_match_truth(value: Any) -> str:
    """The text an ``exact_match`` ground truth stands for; ``RewardError`` for values that are no
    answer text: containers, bools, non-finite floats, and blank strings (which would reward an empty
    completion)."""
    if isinstance(value, (bool, list, tuple, dict, set)) or value is None:
        raise RewardError(
            f"reward 'exact_match': ground truth {describe_value(value)} ({type(value).__name__}) is not an answer "
            "text; give a string or a number"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise RewardError(f"reward 'exact_match': ground truth {value} is not a finite number")
    text = _collapse(str(value))
    if not text:
        raise RewardError(
            "reward 'exact_match': ground truth is a blank string, which only an empty completion would match"
        )
    return text


@register_reward("exact_match", requires=_NEEDS_ANSWER, check_ground_truth=_problem(exact_match_truth))
def exact_match(sample: RewardInput) -> float:
    """1.0 when the completion equals the ground truth up to surrounding and repeated whitespace."""
    truth = exact_match_truth(_ground_truth(sample, "exact_match"))
    return 1.0 if _collapse(sample.completion) == truth else 0.0


def gsm8k_final_answer(text: str) -> Decimal | None:
    """The number after the last ``####`` in ``text`` (commas and a trailing period ignored)."""
    marker = text.rfind("####")
    if marker < 0:
        return None
    match = _GSM8K_NUMBER_RE.search(text[marker + 4 :].replace(",", ""))
    return _to_decimal(match.group()) if match else None


def gsm8k_truth(raw: Any) -> Decimal:
    """The reference number of a ``gsm8k`` ground truth: the number itself or a full GSM8K solution
    ending in ``#### N``; ``RewardError`` when there is none."""
    if isinstance(raw, str) and "####" in raw:
        truth = gsm8k_final_answer(raw)
        if truth is None:
            raise RewardError(f"reward 'gsm8k': ground truth has no number after '####': {raw[-80:]!r}")
        return truth
    return numeric_ground_truth(raw, "gsm8k")


@register_reward("gsm8k", requires=_NEEDS_ANSWER, check_ground_truth=_problem(gsm8k_truth))
def gsm8k(sample: RewardInput) -> float:
    """1.0 when the number after the completion's last ``####`` equals the reference answer.

    The reference may be the number itself or a full GSM8K solution ending in ``#### N``.
    """
    truth = gsm8k_truth(_ground_truth(sample, "gsm8k"))
    answer = gsm8k_final_answer(sample.completion)
    return 1.0 if answer is not None and answer == truth else 0.0


@register_reward("nonempty")
def nonempty(sample: RewardInput) -> float:
    """1.0 for any completion with a non-whitespace character (a connectivity check, not an objective)."""
    return 1.0 if sample.completion.strip() else 0.0


@register_reward("constant")
def constant(sample: RewardInput) -> float:
    """Always 0.0: for pure distillation, where the teacher supplies all the credit."""
    return 0.0
