"""The run report: a PNG of the main training curves and a short summary table.

``posttrain report RUN_DIR`` calls ``write_report``. It reads ``<run dir>/metrics.jsonl`` as the
run left it: a killed run can end in a half-written line and a resumed run can repeat steps, so
undecodable lines are skipped with a warning and a repeated step keeps its latest record (the
resumed attempt's). matplotlib is imported only here, lazily, with the Agg renderer and without
pyplot, so a report never needs a display and never touches global plotting state.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.metrics.console import format_number

__all__ = ["PANELS", "ReportError", "read_metrics", "summarize", "write_report"]

_log = logging.getLogger("posttrain.metrics")

REWARD_KEY = "train/reward_mean"
STEP_TIME_KEY = "timer/e2e_step_s"

PANELS: tuple[tuple[str, str, str | None], ...] = (
    # (main key, panel title, optional second key drawn dashed on the same axes)
    (REWARD_KEY, "reward mean (line: rolling mean)", None),
    ("train/grpo_informative_group_count", "informative groups", None),
    ("train/opd_divergence", "OPD teacher divergence (JSD)", None),
    ("train/opd_dpca_chunk_gap", "DPCA chunk gap L_S - L_T", None),
    (
        "train/opd_dpca_teacher_chunk_logprob",
        "DPCA chunk logprob: teacher (dashed: student)",
        "train/opd_dpca_student_chunk_logprob",
    ),
    ("train/kl_mean", "KL to reference (mean; dashed: max)", "train/kl_max"),
    ("train/clip_frac", "clip fraction", None),
    ("train/response_len_mean", "response length (mean; dashed: max)", "train/response_len_max"),
    (STEP_TIME_KEY, "step time (s)", None),
    ("eval/reward_mean", "eval reward mean (rl.eval)", None),
    ("eval/pass@1", "eval pass@1 (dashed: pass@k)", "eval/pass@k"),
)
"""Curves of the report; a panel whose main key a run never logged is left out."""

EVAL_PREFIX = "eval/"
"""Evaluation metrics (``rl.eval``): logged at a few steps only, step 0 among them, in a frame of its
own there; drawn with markers whenever present, and summarised over the evaluations."""
EVAL_ONLY_KEYS = frozenset({"step", "timer/eval_s"})


class ReportError(PosttrainError):
    """The run directory has no readable metrics, or the report cannot be drawn."""


def _metrics_path(run_dir: Path) -> Path:
    path = run_dir if run_dir.is_file() else run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(
            f"no metrics file at {path}: pass a posttrain run directory (the one holding "
            "metrics.jsonl and config_resolved.yaml)"
        )
    return path


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """Records of a ``metrics.jsonl`` sorted by step (latest record wins for a repeated step),
    and the number of malformed lines skipped (each is warned about with its line number)."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    by_step: dict[int, dict[str, Any]] = {}
    skipped = 0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = record["step"]
            if not isinstance(step, int) or isinstance(step, bool):
                raise TypeError(f"step is {step!r}, not an integer")
        except (json.JSONDecodeError, TypeError, KeyError) as exc:
            skipped += 1
            why = "truncated last line (killed run?)" if lineno == len(lines) else f"{exc}"
            _log.warning("%s:%d: skipped malformed metrics line: %s", path, lineno, why)
            continue
        by_step[step] = record
    return [by_step[s] for s in sorted(by_step)], skipped


def _values(records: Sequence[dict[str, Any]], key: str) -> list[float]:
    """Finite values of ``key`` in record order (null, absent and non-numeric are left out)."""
    out = []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Numbers behind the summary table, for records sorted by step.

    A quarter is ``max(1, n // 4)`` records; for each panel key the first-quarter mean, the
    last-quarter mean and the final (last logged) value. ``reward_gain`` is last minus first
    quarter mean of ``train/reward_mean`` (the acceptance measure of the default job). Quarters count
    training steps (step 0's evaluation-only frame is not one); an ``eval/*`` key's quarters count
    its evaluations.
    """
    every = records
    records = [r for r in records if not _eval_only(r)]  # the training steps (step 0's eval frame is none)
    n = len(records)
    q = max(1, n // 4)
    head, tail = records[:q], records[-q:]
    keys = [k for panel in PANELS for k in (panel[0], panel[2]) if k is not None]
    per_key: dict[str, dict[str, float | None]] = {}
    for key in keys:
        values = _values(every, key)
        if not values:
            continue
        if key.startswith(EVAL_PREFIX):  # quarters of the evaluations, not of the steps
            qk = max(1, len(values) // 4)
            first, last = _mean(values[:qk]), _mean(values[-qk:])
        else:
            first, last = _mean(_values(head, key)), _mean(_values(tail, key))
        per_key[key] = {
            "first_quarter_mean": first,
            "last_quarter_mean": last,
            "final": values[-1],
            "mean": _mean(values),
        }
    reward = per_key.get(REWARD_KEY, {})
    first, last = reward.get("first_quarter_mean"), reward.get("last_quarter_mean")
    return {
        "steps": n,
        "first_step": records[0]["step"] if records else None,
        "last_step": records[-1]["step"] if records else None,
        "quarter": q,
        "metrics": per_key,
        "reward_first_quarter_mean": first,
        "reward_last_quarter_mean": last,
        "reward_gain": last - first if first is not None and last is not None else None,
        "mean_step_time_s": per_key.get(STEP_TIME_KEY, {}).get("mean"),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a small fixed-width table."""

    def cell(v: float | None) -> str:
        return "-" if v is None else format_number(v)

    lines = [
        f"steps: {summary['steps']} (step {summary['first_step']}..{summary['last_step']}; "
        f"a quarter is {summary['quarter']} steps)",
        f"{'metric':<38}{'first 1/4':>12}{'last 1/4':>12}{'final':>12}",
    ]
    for key, row in summary["metrics"].items():
        lines.append(
            f"{key:<38}{cell(row['first_quarter_mean']):>12}"
            f"{cell(row['last_quarter_mean']):>12}{cell(row['final']):>12}"
        )
    gain = summary["reward_gain"]
    if gain is not None:
        lines.append(f"reward gain (last 1/4 mean - first 1/4 mean): {gain:+.4g}")
    if summary["mean_step_time_s"] is not None:
        lines.append(f"mean step time: {format_number(summary['mean_step_time_s'])} s")
    return "\n".join(lines)


def _rolling_mean(ys: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points (shorter at the start)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _eval_only(record: dict[str, Any]) -> bool:
    """A frame that holds evaluation metrics only (step 0's, before the first update)."""
    return all(k in EVAL_ONLY_KEYS or k.startswith(EVAL_PREFIX) for k in record)


def _drawn(records: Sequence[dict[str, Any]], key: str) -> bool:
    """A panel is drawn when its key was logged and, except the rewards and evaluation scores, is not
    zero throughout (an OPD run's clip fraction, or a distillation divergence of an advantage-mode
    run, says nothing)."""
    ys = _series(records, key)[1]
    return bool(ys) and (key == REWARD_KEY or key.startswith(EVAL_PREFIX) or any(y != 0 for y in ys))


def _draw(records: Sequence[dict[str, Any]], out_png: Path, title: str) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("the run report needs matplotlib: pip install 'posttrain[report]'") from None
    panels = [p for p in PANELS if _drawn(records, p[0])]
    ncols = 3 if len(panels) > 4 else 2
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig = Figure(figsize=(4.2 * ncols, 3.2 * nrows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (key, label, extra) in zip(axes, panels):
        xs, ys = _series(records, key)
        if key == REWARD_KEY:
            ax.plot(xs, ys, ".", alpha=0.5, color="tab:blue", label="per step")
            ax.plot(xs, _rolling_mean(ys, max(1, len(ys) // 10)), color="tab:blue", label="rolling")
            ax.legend(loc="best", fontsize="small")
        else:
            # Evaluations are a few points apart: markers show where each one was taken.
            ax.plot(xs, ys, "o-" if key.startswith(EVAL_PREFIX) else "-", color="tab:blue")
        if extra is not None:
            ex, ey = _series(records, extra)
            if ex:
                ax.plot(ex, ey, "o--" if extra.startswith(EVAL_PREFIX) else "--", color="tab:orange")
        ax.set_title(label, fontsize="medium")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_axis_off()
    if not panels:
        axes[0].text(0.5, 0.5, "no plottable metrics in this run", ha="center", va="center")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)


def write_report(run_dir: str | Path, out_png: str | Path | None = None) -> tuple[Path, str]:
    """Draw ``<run dir>/report.png`` (or ``out_png``) and return its path and the summary text.

    ``run_dir`` may also be the ``metrics.jsonl`` file itself.
    """
    run_dir = Path(run_dir)
    metrics_path = _metrics_path(run_dir)
    records, skipped = read_metrics(metrics_path)
    if not records:
        raise ReportError(f"{metrics_path} holds no metric records (an empty or unreadable file)")
    out = Path(out_png) if out_png is not None else metrics_path.parent / "report.png"
    summary = summarize(records)
    _draw(records, out, title=f"{'/'.join(metrics_path.parent.parts[-2:])}  ({summary['steps']} steps)")
    text = format_summary(summary)
    if skipped:
        text += f"\nskipped {skipped} malformed line(s) of {metrics_path}"
    return out, text
