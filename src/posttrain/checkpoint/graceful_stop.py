"""Graceful stop on SIGTERM / SIGINT: save at the next safe boundary, then exit cleanly.

Schedulers (Slurm, Kubernetes) send SIGTERM some time before they kill a job; Ctrl-C sends SIGINT.
Inside ``GracefulStop`` the first such signal only sets ``.requested``: the loop finishes the
collected batch it is on, writes a checkpoint and leaves. A second signal means "now": the handler
raises ``KeyboardInterrupt`` at once, which unwinds the stack (``finally`` blocks still close the
metric sinks) and ends the process with Python's usual interrupt exit. From then on the previous
handlers are back, so a third signal gets the default action (SIGTERM kills the process outright).

Usage::

    with GracefulStop() as stop:
        for step in ...:
            ...one collected batch...
            if stop.should_stop():
                writer.save(...)
                break
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

_log = logging.getLogger("posttrain.checkpoint")

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """Context manager turning the first SIGTERM/SIGINT into a stop request (see the module docstring).

    Handlers can only be installed from the main thread; elsewhere the object stays inert (it never
    requests a stop) and says so once in the log.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.requested = False
        """True once the first signal arrived."""
        self.signal_name: str | None = None
        """Name of the first signal received (``SIGTERM``, ``SIGINT``)."""
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is not threading.main_thread():
            _log.warning("GracefulStop used outside the main thread: signals keep their default action")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self.requested:
            self.requested = True
            self.signal_name = name
            _log.warning(
                "received %s: finishing the current collected batch, saving a checkpoint and exiting; "
                "send it again to stop at once",
                name,
            )
            return
        _log.warning("received %s again: stopping now, without a checkpoint", name)
        self._restore()
        raise KeyboardInterrupt(f"second stop signal ({name})")

    def should_stop(self) -> bool:
        """Whether to stop at this boundary. In a multi-rank job every rank must call it at the same
        boundary: the flag is OR-reduced so that all ranks stop (and save) together."""
        from posttrain.distributed.world import any_rank

        return any_rank(self.requested)
