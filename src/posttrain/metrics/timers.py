"""Wall-clock timing of the named phases of one training step.

The loop wraps each phase (``rollout``, ``reward``, ``update``, ``sync_weights`` ...) in
``timer.phase(name)`` and calls ``timer.frame()`` once per collected batch; the frame's
``timer/<phase>_s`` values and ``timer/e2e_step_s`` go into the metrics frame.

CUDA work is asynchronous, so without a device synchronize a phase's time is the host time to
*enqueue* its kernels, not to run them. Synchronizing at every phase boundary costs throughput, so
it happens only when asked (``StepTimer(sync=True)``), e.g. for a profiling run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["StepTimer", "peak_memory_frame"]


def _cuda_synchronize() -> None:
    # Imported here so that timing a CPU-only or torch-free code path never imports torch.
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer:
    """Accumulates seconds per named phase between two ``frame()`` calls.

    A phase entered several times in one frame (one rollout per micro-batch, say) reports the sum.
    Phases may nest; each is timed on its own, so nested time counts in both.
    """

    def __init__(self, *, sync: bool = False) -> None:
        self.sync = sync
        self._totals: dict[str, float] = {}
        self._frame_start = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body of the ``with`` block and add it to phase ``name``."""
        if not name:
            raise ValueError("StepTimer.phase needs a non-empty phase name")
        if self.sync:
            _cuda_synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            # Time the phase even when its body raises, so a failing step still shows where it was.
            if self.sync:
                _cuda_synchronize()
            self._totals[name] = self._totals.get(name, 0.0) + (time.perf_counter() - start)

    def frame(self) -> dict[str, float]:
        """Return ``timer/<phase>_s`` for every phase timed since the last frame, plus
        ``timer/e2e_step_s`` (wall time since the last frame or construction), then reset."""
        if self.sync:
            _cuda_synchronize()
        now = time.perf_counter()
        out = {f"timer/{name}_s": seconds for name, seconds in self._totals.items()}
        out["timer/e2e_step_s"] = now - self._frame_start
        self._totals = {}
        self._frame_start = now
        return out


def peak_memory_frame() -> dict[str, float]:
    """``memory/policy_peak_gib``: the most GPU memory torch's allocator held in this process since
    the last frame (GiB), then the peak is reset; empty without CUDA. A host-side counter: no sync.
    An in-process vLLM engine's weights and KV cache go through torch's allocator too and count."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return {"memory/policy_peak_gib": peak}
