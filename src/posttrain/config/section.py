"""The base class of every config section and the rules every field obeys.

``Section`` forbids unknown keys, takes each field's docstring as its description, validates on
assignment (so a recipe setting a bad value fails on that line), and adds two rules for every field
of every section: numbers are finite and integers fit a signed 64-bit integer.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SEED_BOUND = 2**63
"""Seeds lie in ``[0, 2**63)``: ``torch.manual_seed`` takes at most ``2**64 - 1`` and negative values
down to ``-2**63`` (reinterpreted), NumPy only non-negative ones; the loop adds small offsets (a data
cell, an epoch) to a seed, which stays within 64 bits from this bound."""


def _int64_problem(value: object) -> str | None:
    """Why ``value`` (an int, or a list / tuple / dict holding some) does not fit a signed 64-bit integer."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if INT64_MIN <= value <= INT64_MAX:
            return None
        return "every integer setting must fit a signed 64-bit integer ([-2**63, 2**63 - 1])"
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
    return next((p for p in map(_int64_problem, items) if p is not None), None)


class Section(BaseModel):
    """Every config section. Besides each field's own bounds, two rules hold for every field: numbers
    are finite (``allow_inf_nan=False``: ``inf`` or ``nan`` in a learning rate, a clip bound or a
    timeout only ever fails steps later, or silently zeroes updates), and integers fit a signed 64-bit
    integer (what torch, NumPy and the checkpoint's JSON readers hold). No field is exempt from the
    first: an unbounded setting is spelled ``null`` (``rl.optimizer.grad_clip_norm``,
    ``rl.kl_coeff_clamp``); a field that must take ``inf`` would say ``Field(allow_inf_nan=True)``."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )

    @field_validator("*", mode="after")
    @classmethod
    def _fits_64_bits(cls, value: object) -> object:
        problem = _int64_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value
