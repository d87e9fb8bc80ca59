"""Python's cyclic garbage collector, timed: its passes and the seconds it held the interpreter.

Shared by the benchmark scripts (``grpo_step.py``'s ``gc`` column over each train phase,
``vllm_flat_logprobs.py``'s per call) through ``gc.callbacks``, which the collector calls at the start
and the end of every pass.
"""

from __future__ import annotations

import gc
import time


class GcClock:
    """The collector's passes and seconds since construction or the last ``take()``."""

    def __init__(self) -> None:
        self.passes, self.seconds, self._t0 = 0, 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.passes += 1
            self.seconds += time.perf_counter() - self._t0

    def take(self) -> tuple[float, int]:
        """The seconds and passes so far, then zero again."""
        taken = (self.seconds, self.passes)
        self.passes, self.seconds = 0, 0.0
        return taken
