"""Host-to-device copies of a micro-batch's inputs that do not make the host wait for the GPU.

A plain ``tensor.to("cuda")`` from ordinary (pageable) host memory is a synchronous copy: the host
waits until the GPU has run everything queued before it, the previous micro-batch's backward
included, and the GPU then idles while the host prepares and launches the next forward. On one
H100 a W update made 274 such waits (``benchmarks/update_precision.py --syncs``, twenty-fifth
session), 256 of them one per row of the sampler's logprobs. Staged through pinned (page-locked)
memory, the copy is queued like a kernel and the host runs on; PyTorch's caching host allocator keeps
the pinned block until the copy has run, so reusing it is safe.

``host_waits`` lists where a piece of work made the host wait (for the benchmarks and the GPU tests).
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """``t`` on ``device``: a CPU tensor bound for a CUDA device as a non-blocking copy from pinned
    memory; any other move as ``Tensor.to``."""
    device = torch.device(device)
    if t.device.type != "cpu" or device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def host_waits(run: Callable[[], Any]) -> list[traceback.StackSummary]:
    """Run ``run`` under CUDA's sync debug mode and return the Python stack of each place it made the
    host wait for the GPU, from ``run`` inwards (innermost frame last). CUDA only: a diagnostic for
    the benchmarks and the GPU tests, never on in a run."""
    stacks: list[traceback.StackSummary] = []

    def record(message: Any, *_where: Any) -> None:  # warnings.showwarning(message, category, file, line, ...)
        if "synchronizing" in str(message):
            frames = traceback.extract_stack()[:-1]
            here = [i for i, f in enumerate(frames) if f.name == "host_waits" and f.filename == __file__]
            if here:  # else another thread's wait, not run's
                inward = [f for f in frames[here[-1] + 1 :] if not f.filename.endswith("warnings.py")]
                stacks.append(traceback.StackSummary.from_list(inward))

    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every wait, not the first per place
        warnings.showwarning = record  # type: ignore[assignment]  # reads the message only
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return stacks
