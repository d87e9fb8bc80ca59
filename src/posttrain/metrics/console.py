"""The per-step console line and the progress bar for long phases.

The console line is the spec's (grpo.md §6): ``step N/M`` followed by a fixed set of metrics in a
fixed order, so that consecutive lines line up by eye and users can grep them. Everything else a
frame carries goes to ``metrics.jsonl`` only.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["CONSOLE_KEYS", "format_number", "format_step_line", "progress"]

CONSOLE_KEYS: tuple[str, ...] = (
    "train/loss_avg",
    "train/reward_mean",
    "train/reward_std",
    "train/grad_norm",
    "train/kl_mean",
    "train/kl_max",
    "train/clip_frac",
    "train/grpo_informative_group_count",
    "train/opd_divergence",
    "train/opd_teacher_credit",
    "train/opd_dpca_chunk_gap",
    "train/response_len_mean",
    "timer/e2e_step_s",
)
"""Keys printed on the console line, in print order; keys absent from a frame are left out."""


def format_number(value: Any) -> str:
    """Compact rendering with 4 significant digits: ``-0.0123``, ``0.406``, ``1.23``, ``3``."""
    if value is None:
        return "null"
    if hasattr(value, "item"):  # tensor or numpy scalar
        value = value.item()
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    try:
        x = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(x):
        return str(x)  # "nan", "inf", "-inf"
    if x == 0.0:
        return "0"
    # %g switches to an exponent from 1e4 on; large step times and token counts read better
    # as plain rounded numbers (12346 instead of 1.235e+04).
    if 1e4 <= abs(x) < 1e15:
        return f"{x:.0f}"
    return f"{x:.4g}"


def format_step_line(step: int, max_steps: int | None, metrics: Mapping[str, Any]) -> str:
    """``step 3/60 train/loss_avg -0.0123 train/reward_mean 0.406 ... timer/e2e_step_s 8.1``.

    ``max_steps`` of ``None`` prints ``step 3`` alone.
    """
    head = f"step {step}/{max_steps}" if max_steps is not None else f"step {step}"
    parts = [head]
    for key in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{key} {format_number(metrics[key])}")
    return " ".join(parts)


class _NullBar:
    """Stands in for a tqdm bar when bars are off or tqdm is missing: same calls, no output."""

    def __init__(self, iterable: Iterable[Any] | None = None) -> None:
        self._iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        if self._iterable is None:
            raise TypeError("this progress bar was created from a total, not an iterable")
        return iter(self._iterable)

    def update(self, n: float = 1) -> None:
        """No-op."""

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """No-op."""

    def close(self) -> None:
        """No-op."""

    def __enter__(self) -> _NullBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(iterable_or_total: Iterable[Any] | int, desc: str, enabled: bool | None = None) -> Any:
    """A tqdm bar over an iterable (iterate it) or a total (call ``.update(n)``; use as ``with``).

    ``enabled=None`` shows the bar only when stderr is a terminal, so logs of batch jobs do not
    fill with carriage-return noise; ``True`` forces it. Without tqdm installed, the bar is silent.
    The returned object supports iteration (iterable form), ``update``, ``set_postfix_str``,
    ``close`` and the ``with`` statement whether or not a real bar is drawn.
    """
    total: int | None = None
    iterable: Iterable[Any] | None = None
    if isinstance(iterable_or_total, int):
        total = iterable_or_total
    else:
        iterable = iterable_or_total
    if enabled is None:
        enabled = _stderr_is_tty()
    if not enabled:
        return _NullBar(iterable)
    try:
        from tqdm import tqdm
    except ImportError:
        return _NullBar(iterable)
    if iterable is None:
        return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False)
    return tqdm(iterable, desc=desc, dynamic_ncols=True, leave=False)


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False
