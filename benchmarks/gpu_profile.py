"""One call under torch.profiler, summed up: where a phase's wall time goes on the GPU.

Shared by the benchmark scripts (``update_precision.py --profile``, ``grpo_step.py --profile-step``):
the call's wall time against the GPU's busy time (its kernels' durations summed, and their union on
the timeline), the kernels and CUDA-graph replays launched, the aten calls made, the kernels that
take most of the busy time and torch.profiler's operator table. A phase whose busy time is a small
share of its wall time is bound by its host; one whose kernels grow longer is bound by the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

TOP_KERNELS = 40


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _union_us(ranges: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) ranges: time the GPU ran at least one kernel."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(ranges):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def profile_call(fn: Callable[[], Any], top: int = TOP_KERNELS) -> tuple[Any, dict[str, Any]]:
    """Run ``fn()`` once under torch.profiler; its result and the summary (seconds; CUDA when present)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        _sync()
        start, cpu0 = time.perf_counter(), time.thread_time()
        result = fn()
        _sync()
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu0
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    names = [e.name for e in events]
    by_kernel: dict[str, list[float]] = {}  # name -> [count, GPU seconds]
    for e in kernels:
        entry = by_kernel.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us() / 1e6
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]
    ops = prof.key_averages().table(sort_by="self_device_time_total", row_limit=top) if kernels else ""
    return result, {
        "wall_s": wall,
        "thread_cpu_s": cpu,
        "gpu_busy_s": sum(e.time_range.elapsed_us() for e in kernels) / 1e6,
        "gpu_union_s": _union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e6,
        "kernels": len(kernels),
        "kernel_launches": sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC") for n in names),
        "graph_launches": sum(n == "cudaGraphLaunch" for n in names),
        "aten_calls": sum(n.startswith("aten::") for n in names),
        "top_kernels": [{"name": n[:200], "count": int(c), "gpu_s": t} for n, (c, t) in ranked],
        "ops_table": ops,
    }
