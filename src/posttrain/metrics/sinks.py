"""Where metric frames go: ``metrics.jsonl``, the console, ``train.log``, TensorBoard, W&B.

The loop calls ``MetricsLogger.log(step, metrics)`` once per collected batch. Every value is turned
into a plain JSON number first (tensors and numpy scalars via ``.item()``; integers stay integers,
everything else becomes a float; NaN and ±inf become ``null``), so each sink sees the same record.

Failure policy: metrics must never be the reason a long run dies, so every sink catches its own
exceptions (``Exception`` only, so Ctrl-C still stops the run) and warns once, naming the sink and
the error. ``metrics.jsonl`` is the run's primary record, so it keeps retrying every frame (a full
disk that is cleaned up recovers, and a second warning then says how many frames were lost); every
other sink disables itself after its first failure. Warnings go through the ``logging`` module
(logger ``posttrain.metrics``) and, while it works, into ``train.log``; console lines go to stdout.

W&B: every attempt of one job logs to one W&B run. Its id is kept in ``wandb_id`` in the job
directory (beside the attempts' directories); an attempt that resumes (``rl.resume`` not ``off``)
reuses it with ``resume="allow"``, a fresh one (``rl.resume=off``) starts a new run and stores its id.
Offline runs of one id (``wandb sync``) become one run online.

Only one process of a distributed job (rank 0) should create a ``MetricsLogger``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, TypeVar, cast

from posttrain.metrics.console import format_step_line

__all__ = ["MetricsLogger", "OffRankLogger", "to_json_number"]

_log = logging.getLogger("posttrain.metrics")

JsonNumber = int | float | None
_SinkT = TypeVar("_SinkT")


def to_json_number(value: Any) -> JsonNumber:
    """A plain ``int``/``float`` for a Python, numpy or torch scalar; ``None`` for NaN/±inf/None.

    Raises ``TypeError`` for anything that is not a single number (a string, a 2-element tensor).
    """
    if value is None:
        return None
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()  # torch tensors and numpy scalars / 0-d arrays
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"not a single number ({type(value).__name__}): {exc}") from None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        x = float(value)
        return x if math.isfinite(x) else None
    raise TypeError(f"not a number: {type(value).__name__} {value!r:.60}")


class _JsonlSink:
    """Appends one JSON object per line; reopens on the next frame after a failure."""

    name = "metrics.jsonl"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: IO[str] | None = None

    def _open(self) -> IO[str]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A killed run can leave a last line without its newline; appending straight after it
        # would glue the next record onto the fragment and lose both.
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open("rb") as f:
                f.seek(-1, os.SEEK_END)
                needs_newline = f.read(1) != b"\n"
        fh = self.path.open("a", encoding="utf-8")
        if needs_newline:
            fh.write("\n")
        return fh

    def write(self, record: Mapping[str, JsonNumber]) -> None:
        try:
            if self._fh is None:
                self._fh = self._open()
            self._fh.write(json.dumps(record, allow_nan=False) + "\n")
            # Flush (not fsync) per line: survives a killed process, costs nothing per step.
            self._fh.flush()
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            with contextlib.suppress(OSError):
                fh.close()


class _TextLogSink:
    """``train.log``: console lines and ``info`` messages with a timestamp."""

    name = "train.log"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: IO[str] | None = None

    def write_line(self, text: str) -> None:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._fh.write(f"{stamp} {text}\n")
        self._fh.flush()

    def close(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            fh.close()


class _TensorBoardSink:
    """Scalars under ``<run dir>/tensorboard``, through torch's ``SummaryWriter``."""

    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(f"{exc}; install it with `pip install tensorboard`") from None
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, record: Mapping[str, JsonNumber]) -> None:
        for key, value in record.items():
            if key != "step" and value is not None:
                self._writer.add_scalar(key, value, global_step=step)
        # One flush per frame so a killed run's event file has every frame it logged.
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _wandb_mode() -> str:
    """``WANDB_MODE`` when set; else online only if credentials are configured, so a machine that
    never logged in neither blocks on a login prompt nor fails: it logs offline (``wandb sync``)."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        import netrc

        # Only asks whether `wandb login` stored an entry; the key itself is never read here.
        has_entry = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        has_entry = False
    return "online" if has_entry else "offline"


WANDB_ID_FILE = "wandb_id"
"""The file in the job directory holding the W&B run id every attempt of the job logs to."""
_WANDB_ID = re.compile(r"^[a-z0-9]{1,64}$")


def stable_wandb_id(id_file: Path, *, resume: bool) -> str:
    """The W&B run id of this job: the stored one when ``resume`` and ``id_file`` holds a valid id,
    else a new random id, stored in ``id_file`` (atomically) for the attempts that resume later."""
    if resume and id_file.is_file():
        stored = id_file.read_text(encoding="utf-8").strip()
        if _WANDB_ID.match(stored):
            return stored
        _log.warning("%s holds no valid W&B run id (%.40r); starting a new W&B run", id_file, stored)
    run_id = secrets.token_hex(8)
    id_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = id_file.with_name(id_file.name + ".tmp")
    tmp.write_text(run_id + "\n", encoding="utf-8")
    os.replace(tmp, id_file)
    return run_id


class _WandbSink:
    """Weights & Biases; offline when no credentials are configured; one run id per job."""

    name = "wandb"

    def __init__(
        self,
        run_dir: Path,
        project: str | None,
        run_name: str | None,
        config: dict | None,
        *,
        id_file: Path | None = None,
        resume: bool = False,
    ):
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "the wandb package is not installed (`pip install wandb` or `pip install posttrain[wandb]`)"
            ) from None
        run_dir.mkdir(parents=True, exist_ok=True)
        run_id = stable_wandb_id(id_file or run_dir.parent / WANDB_ID_FILE, resume=resume)
        self._run = wandb.init(
            project=project or "posttrain",
            name=run_name,
            config=config,
            dir=str(run_dir),
            id=run_id,
            resume="allow",  # the same id continues the run (a fresh id simply starts one)
            # cast: wandb types `mode` as a Literal; WANDB_MODE is validated by wandb itself.
            mode=cast(Any, _wandb_mode()),
        )
        self.run_id = run_id

    def write(self, step: int, record: Mapping[str, JsonNumber]) -> None:
        self._run.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    """One metrics frame per collected batch to every enabled sink; see the module docstring."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str | None = None,
        run_name: str | None = None,
        config: dict | None = None,
        console: bool = True,
        console_every: int = 1,
        max_steps: int | None = None,
        resume_step: int | None = None,
        wandb_resume: bool = False,
        wandb_id_file: Path | None = None,
    ) -> None:
        """``resume_step``: on a resumed run, records with a step above it (logged by the killed
        attempt after its last checkpoint) are removed from an existing ``metrics.jsonl`` first,
        so the file reads like one uninterrupted run. ``wandb_resume``: this attempt may continue
        the job (``rl.resume`` is not ``off``), so it logs to the job's stored W&B run id
        (``wandb_id_file``, default ``<run_dir>/../wandb_id``)."""
        if console_every < 1:
            raise ValueError(f"console_every must be >= 1, got {console_every}")
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.console = console
        self.console_every = console_every
        self.max_steps = max_steps
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._closed = False
        self._jsonl = _JsonlSink(self.metrics_path)
        self._jsonl_lost = 0
        self._text: _TextLogSink | None = _TextLogSink(self.run_dir / "train.log")
        self._tb: _TensorBoardSink | None = None
        self._wandb: _WandbSink | None = None
        if resume_step is not None:
            self._guarded("metrics.jsonl resume truncation", lambda: _drop_steps_after(self.metrics_path, resume_step))
        if tensorboard:
            self._tb = self._make("tensorboard", lambda: _TensorBoardSink(self.run_dir / "tensorboard"))
        if wandb:
            self._wandb = self._make(
                "wandb",
                lambda: _WandbSink(
                    self.run_dir, wandb_project, run_name, config, id_file=wandb_id_file, resume=wandb_resume
                ),
            )

    # -- public API ---------------------------------------------------------------------------

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write one frame ``{"step": step, **metrics}`` to every sink; never raises on I/O."""
        with self._lock:
            if self._closed:
                self._warn_once("closed", f"MetricsLogger.log(step={step}) after close(); frame dropped")
                return
            record = self._convert(step, metrics)
            self._write_jsonl(record)
            tb, wb = self._tb, self._wandb
            if tb is not None and not self._guarded("tensorboard", lambda: tb.write(step, record)):
                self._tb = None
            if wb is not None and not self._guarded("wandb", lambda: wb.write(step, record)):
                self._wandb = None
            if self._console_due(step):  # to train.log even with the console off
                self._emit(format_step_line(step, self.max_steps, record))

    def info(self, msg: str) -> None:
        """A log line to the console (stdout) and ``train.log``."""
        with self._lock:
            self._emit(msg)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """One batch's samples (``metrics/completions.py``) as TensorBoard text and a W&B table, where
        those sinks are on. W&B: uncommitted (it joins the next frame), so an off-policy batch logged
        ahead of the step still training cannot move W&B's step past that step's frame."""
        from posttrain.metrics.completions import COLUMNS, markdown_table, table_data

        with self._lock:
            tb, wb = self._tb, self._wandb
            if tb is not None and not self._guarded(
                "tensorboard", lambda: tb._writer.add_text("completions", markdown_table(rows), global_step=step)
            ):
                self._tb = None
            if wb is not None:

                def send() -> None:
                    import wandb

                    wb._run.log(
                        {"completions": wandb.Table(columns=list(COLUMNS), data=table_data(rows))}, commit=False
                    )

                if not self._guarded("wandb", send):
                    self._wandb = None

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jsonl.close()
            for name, sink in (("tensorboard", self._tb), ("wandb", self._wandb), ("train.log", self._text)):
                if sink is not None:
                    self._guarded(name, sink.close)
            self._tb = self._wandb = self._text = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _console_due(self, step: int) -> bool:
        return step % self.console_every == 0 or (self.max_steps is not None and step == self.max_steps)

    def _convert(self, step: int, metrics: Mapping[str, Any]) -> dict[str, JsonNumber]:
        record: dict[str, JsonNumber] = {"step": int(step)}
        for raw_key, value in metrics.items():
            key = str(raw_key)
            if key == "step":
                self._warn_once("key:step", "a metric named 'step' is ignored; the step argument wins")
                continue
            try:
                number = to_json_number(value)
            except TypeError as exc:
                self._warn_once(f"type:{key}", f"metric {key!r} at step {step} dropped: {exc}")
                continue
            if number is None and value is not None:
                self._warn_once(
                    f"nonfinite:{key}",
                    f"metric {key!r} is {value!r} at step {step}; written as null (warned once per metric)",
                )
            record[key] = number
        return record

    def _write_jsonl(self, record: Mapping[str, JsonNumber]) -> None:
        try:
            self._jsonl.write(record)
        except Exception as exc:
            self._jsonl_lost += 1
            self._warn_once(
                "sink:metrics.jsonl",
                f"metrics sink metrics.jsonl failed writing {self.metrics_path}: {exc!r}; "
                "retrying every step, frames are lost until it works",
            )
            return
        if self._jsonl_lost:
            _log.warning("metrics sink metrics.jsonl works again; %d frame(s) were lost", self._jsonl_lost)
            self._jsonl_lost = 0
            self._warned.discard("sink:metrics.jsonl")

    def _emit(self, line: str) -> None:
        if self.console:
            try:
                print(line, file=sys.stdout, flush=True)
            except Exception as exc:
                self.console = False
                self._warn_once("sink:console", f"metrics sink console failed: {exc!r}; it is disabled")
        text = self._text
        if text is not None and not self._guarded("train.log", lambda: text.write_line(line)):
            self._text = None

    def _guarded(self, name: str, fn: Callable[[], object]) -> bool:
        """Run ``fn``; on an exception warn once naming sink ``name`` and return False."""
        try:
            fn()
        except Exception as exc:
            self._warn_once(f"sink:{name}", f"metrics sink {name} failed: {exc!r}; it is disabled")
            return False
        return True

    def _make(self, name: str, factory: Callable[[], _SinkT]) -> _SinkT | None:
        """Build an optional sink; a failure (missing package, unwritable dir) warns once."""
        try:
            return factory()
        except Exception as exc:
            self._warn_once(f"sink:{name}", f"metrics sink {name} failed: {exc!r}; it is disabled")
            return None

    def _warn_once(self, key: str, msg: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        _log.warning(msg)
        text = self._text
        if text is not None and not key.startswith("sink:train.log"):
            try:
                text.write_line(f"WARNING {msg}")
            except Exception as exc:
                self._text = None
                self._warn_once("sink:train.log", f"metrics sink train.log failed: {exc!r}; it is disabled")


class OffRankLogger(MetricsLogger):
    """What a rank other than 0 of a multi-rank run holds instead of a ``MetricsLogger``: the same
    methods, and nothing written (rank 0 owns the run directory, the console and every sink; the
    frames it logs are already merged over the ranks)."""

    def __init__(self) -> None:  # opens no file: the parent's constructor is deliberately not run
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Dropped: rank 0 logs the merged frame."""

    def info(self, msg: str) -> None:
        """Dropped: rank 0 says it."""

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Dropped: rank 0 writes every cell's samples."""

    def close(self) -> None:
        """Nothing to close."""
        self._closed = True


def _drop_steps_after(path: Path, last_step: int) -> None:
    """Rewrite ``path`` keeping only records with ``step <= last_step`` (atomic replace)."""
    if not path.exists():
        return
    kept: list[str] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                step = json.loads(line).get("step")
            except (json.JSONDecodeError, AttributeError):
                continue  # the truncated tail of the killed attempt
            if isinstance(step, int) and step <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
