"""Metrics: the per-step console line, ``metrics.jsonl``, TensorBoard and W&B sinks, step timers,
progress bars and the run report.

Importing this package imports neither torch nor matplotlib nor tqdm; each sink imports its
backend when it is enabled.
"""

from posttrain.metrics.console import CONSOLE_KEYS, format_number, format_step_line, progress
from posttrain.metrics.report import ReportError, read_metrics, summarize, write_report
from posttrain.metrics.sinks import MetricsLogger, to_json_number
from posttrain.metrics.timers import StepTimer

__all__ = [
    "CONSOLE_KEYS",
    "MetricsLogger",
    "ReportError",
    "StepTimer",
    "format_number",
    "format_step_line",
    "progress",
    "read_metrics",
    "summarize",
    "to_json_number",
    "write_report",
]
