"""``completions.jsonl``: the samples of every N-th collected batch, one JSON object per line.

``job.log_completions_every=N`` (0: off) makes the loop hand each collected batch's samples to
``CompletionsLog.record``; on every N-th step (``step % N == 0``) each sample becomes one line::

    {"step": 4, "cell": 0, "uid": "row:3#1", "prompt": ..., "completion": "...", "completion_tokens": 7,
     "rewards": {"<reward key>": 0.5, ...}, "reward": 0.5, "advantage": 1.2, "finish_reason": "stop"}

``rewards`` holds each reward's own score, by its metric key (``rewards/combined.py metric_key``),
``reward`` the weighted sum the advantage was computed from. Several policy ranks: every rank
passes its data cell's samples to ``gather`` (a collective, so every rank calls ``record`` at the
same steps) and rank 0 alone writes them all, cell by cell (``cell`` is the rank's index). The
lines go to the run directory and, when those sinks are on, to TensorBoard (text) and W&B (a table)
through ``sink``. Like the metrics sinks, a failed write warns and never stops the run.

The log counts collected batches itself (the loop's batch function does not see the step): the
first batch it sees is step ``first_step()``, asked then (after any resume), each later one the
next step; with ``rl.max_off_policy_steps=1`` batch k+1 is collected during step k, and still is
the (k+1)-th batch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

_log = logging.getLogger("posttrain.metrics")

Row = dict[str, Any]
Gather = Callable[[list[Row]], list[list[Row]]]
"""Every rank's rows in rank order (``posttrain.distributed.world.gather_objects``)."""


class CompletionsLog:
    """Appends the samples of every ``every``-th collected batch to ``path`` (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        every: int,
        *,
        first_step: Callable[[], int],
        gather: Gather,
        writes: bool,
        sink: Callable[[int, list[Row]], None] | None = None,
    ) -> None:
        self.path = path
        self.every = every
        self.first_step = first_step
        self.gather = gather
        self.writes = writes  # rank 0
        self.sink = sink
        self.next_step: int | None = None
        self._warned = False

    def record(self, rows: Callable[[], list[Row]]) -> None:
        """One collected batch: ``rows()`` (this rank's samples, built only when due) go to the file
        on an N-th step."""
        if self.every <= 0:
            return
        step = self.first_step() if self.next_step is None else self.next_step
        self.next_step = step + 1
        if step % self.every:
            return
        cells = self.gather(rows())
        if not self.writes:
            return
        lines = [{"step": step, "cell": c, **row} for c, cell in enumerate(cells) for row in cell]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write("".join(json.dumps(line, default=str) + "\n" for line in lines))
        except OSError as exc:
            if not self._warned:
                self._warned = True
                _log.warning("completions log %s failed at step %d: %r; samples are lost", self.path, step, exc)
        if self.sink is not None:
            self.sink(step, lines)


COLUMNS = (
    "step",
    "cell",
    "uid",
    "prompt",
    "completion",
    "completion_tokens",
    "rewards",
    "reward",
    "advantage",
    "finish_reason",
)
"""The columns of the TensorBoard text table and the W&B table."""


def _cell_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def markdown_table(rows: list[Row]) -> str:
    """``rows`` as a Markdown table (TensorBoard renders text summaries as Markdown)."""

    def cell(value: Any) -> str:
        return "" if value is None else _cell_text(value).replace("|", "\\|").replace("\n", "<br>")

    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(cell(row.get(c)) for c in COLUMNS) + " |\n" for row in rows)


def table_data(rows: list[Row]) -> list[list[Any]]:
    """``rows`` as W&B table data: numbers stay numbers, the rest becomes text."""
    return [
        [
            v if isinstance(v, (int, float)) and not isinstance(v, bool) else _cell_text(v)
            for v in (r.get(c) for c in COLUMNS)
        ]
        for r in rows
    ]


__all__ = ["COLUMNS", "CompletionsLog", "Row", "markdown_table", "table_data"]
