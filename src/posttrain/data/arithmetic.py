"""The built-in arithmetic prompt generator (the default task when ``rl.data`` names no source).

Sample ``i`` is drawn from an RNG seeded with ``(seed, i)`` alone, so the stream is endless, any
sample can be regenerated on its own, and the cursor is just the next index.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Sequence

from posttrain.data.base import PromptSample, SeededStream
from posttrain.data.jsonl import apply_system_prompt
from posttrain.errors import DataError

ALLOWED_OPS = ("+", "-", "*")
TEMPLATE_FIELDS = frozenset({"a", "op", "b"})


def arithmetic_problems(min_operand: int, max_operand: int, ops: Sequence[str], template: str) -> list[str]:
    """Every problem with these generator settings (empty when they are valid)."""
    problems: list[str] = []
    if min_operand > max_operand:
        problems.append(f"rl.data.arithmetic_min ({min_operand}) is larger than rl.data.arithmetic_max ({max_operand})")
    if not ops:
        problems.append(f"rl.data.arithmetic_ops is empty; pick some of {list(ALLOWED_OPS)}")
    bad_ops = [op for op in ops if op not in ALLOWED_OPS]
    if bad_ops:
        problems.append(f"rl.data.arithmetic_ops has unknown operators {bad_ops}; allowed: {list(ALLOWED_OPS)}")
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        problems.append(f"rl.data.arithmetic_template is not a valid format string ({exc}): {template!r}")
    else:
        unknown = sorted(fields - TEMPLATE_FIELDS)
        if unknown:
            problems.append(
                f"rl.data.arithmetic_template uses unknown fields {unknown}; only {{a}}, {{op}} and {{b}} "
                f"are filled in: {template!r}"
            )
    return problems


# Largest width or precision the arithmetic template may ask for: formatting it must stay cheap.
TEMPLATE_MAX_WIDTH = 1000


def _too_wide(digits: str) -> bool:
    # Length first: int() of a few thousand digits is slow, and past 4300 refused.
    return len(digits.lstrip("0")) > len(str(TEMPLATE_MAX_WIDTH)) or int(digits) > TEMPLATE_MAX_WIDTH


def template_format_problem(template: str, op: str, a: int, b: int) -> str | None:
    """Why formatting ``template`` with ints ``a``, ``b`` and the operator string ``op`` fails, or
    None: a format spec that does not fit them (``{op:d}``, ``{a:s}``, ``{a!z}``) would otherwise
    fail at the first draw after the model loaded. Widths and nested fields are refused before
    anything is formatted: ``{a:>1000000000}`` would build a gigabyte string. A template that is not
    a format string at all is ``arithmetic_problems``' to report (None here)."""
    try:
        specs = [spec or "" for _, name, spec, _ in string.Formatter().parse(template) if name is not None]
    except ValueError:
        return None
    if any("{" in spec for spec in specs):
        return "a format spec holds a nested {field}; write plain specs such as {a:>3}"
    if any(_too_wide(n) for spec in specs for n in re.findall(r"\d+", spec)):
        return f"a format spec asks for a width or precision above {TEMPLATE_MAX_WIDTH}"
    try:
        template.format(a=a, op=op, b=b)
    except Exception as exc:  # str.format raises ValueError, TypeError, KeyError, IndexError, ...
        return f"formatting it with a={a}, op={op!r}, b={b} raised {exc!r}"
    return None


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


class ArithmeticSource(SeededStream):
    """Endless ``a op b`` questions whose ground truth is the integer answer."""

    cursor_name = "arithmetic"

    def __init__(
        self,
        seed: int = 0,
        *,
        min_operand: int = 1,
        max_operand: int = 20,
        ops: Sequence[str] = ("+",),
        template: str = "What is {a} {op} {b}? Reply with only the number.",
        system_prompt: str | None = None,
    ) -> None:
        problems = arithmetic_problems(min_operand, max_operand, ops, template)
        if problems:
            raise DataError("; ".join(problems))
        self.seed = seed
        self.min_operand = min_operand
        self.max_operand = max_operand
        self.ops = tuple(ops)
        self.template = template
        self.system_prompt = system_prompt

    def sample(self, index: int) -> PromptSample:
        """Sample ``index`` of this seed's stream (independent of the cursor)."""
        # A string seed is hashed with SHA-512 by `random`, so it is stable across processes and
        # Python versions (unlike hash()), and distinct (seed, index) pairs give unrelated streams.
        rng = random.Random(f"posttrain-arith:{self.seed}:{index}")
        a = rng.randint(self.min_operand, self.max_operand)
        b = rng.randint(self.min_operand, self.max_operand)
        op = rng.choice(self.ops)
        question = self.template.format(a=a, op=op, b=b)
        return PromptSample(
            prompt=apply_system_prompt(question, self.system_prompt),
            ground_truth=_apply(a, op, b),
            uid=f"arith:{index}",
            metadata={"a": a, "op": op, "b": b},
        )
