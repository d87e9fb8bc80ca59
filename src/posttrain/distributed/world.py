"""The run-level world: which policy rank this process is, of how many, and the small collectives
the loop, the checkpoints and the logs coordinate with.

Every function here is trivial in a single process (no process group: rank 0 of 1, a gather is
``[obj]``, a broadcast returns its argument), so callers never branch on "one process or several";
with several ranks each one is a collective that every rank calls in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_rank_zero() -> bool:
    """True on the rank that writes run files and console lines (and in a single process)."""
    return rank_and_world()[0] == 0


def barrier(group: Any = None) -> None:
    """Every rank waits for the others (nothing to wait for in one process). A collective, on the
    default group or on ``group`` (one of ``background_groups``)."""
    if rank_and_world()[1] > 1:
        dist.barrier(group=group)


_BACKGROUND_GROUPS: list[Any] = []  # for the default group named first (a re-initialised world starts over)


def background_groups(count: int) -> list[Any]:
    """``count`` gloo groups of every rank for collectives that run in background threads (an
    asynchronous checkpoint's planning and barriers), each apart from the training step's groups and
    from the others, so that no two threads' collectives can interleave on one group; ``None``s in
    one process (the callers then coordinate nothing). Created on the first call, which is a
    collective (``new_group``): every rank must make the same calls in the same order."""
    if rank_and_world()[1] == 1:
        return [None] * count
    if not _BACKGROUND_GROUPS or _BACKGROUND_GROUPS[0] is not dist.group.WORLD:
        _BACKGROUND_GROUPS[:] = [dist.group.WORLD]
    while len(_BACKGROUND_GROUPS) <= count:
        _BACKGROUND_GROUPS.append(dist.new_group(backend="gloo"))
    return _BACKGROUND_GROUPS[1 : count + 1]


class RankFilter(logging.Filter):
    """Tags records with ``[rank r/w]`` in a multi-rank run and drops those below ``min_level_off_zero``
    on ranks other than 0, so N ranks do not print N copies of every info line."""

    def __init__(self, min_level_off_zero: int = logging.WARNING) -> None:
        super().__init__()
        self.min_level_off_zero = min_level_off_zero

    def filter(self, record: logging.LogRecord) -> bool:
        rank, world = rank_and_world()
        if world > 1 and not getattr(record, "rank_tagged", False):
            record.msg = f"[rank {rank}/{world}] {record.msg}"
            record.rank_tagged = True  # a record passing several filtered handlers is tagged once
        return rank == 0 or record.levelno >= self.min_level_off_zero


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` without a process group). A collective."""
    _, world = rank_and_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's picklable ``obj`` on every rank (``obj`` itself without a process group). A collective."""
    _, world = rank_and_world()
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (a stop request, a failure). A collective."""
    _, world = rank_and_world()
    if world == 1:
        return flag
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t[0] > 0)


def _merge_one(key: str, values: Sequence[float]) -> float:
    """One metric over the ranks, by what its name says it measures."""
    if key.endswith("_max"):
        return max(values)
    if key.endswith("_min"):
        return min(values)
    if key.endswith(("_per_s", "_count", "_tokens", "_sequences")):
        return float(sum(values))  # throughputs and counts add up over the ranks
    if key.endswith("_s"):
        return max(values)  # wall time of a phase: the slowest rank's
    return sum(values) / len(values)  # a per-cell mean: cells are equal in trajectories


def merge_rank_metrics(frames: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per-rank metric dicts combined into one: sums for counts and throughputs, max for maxima and
    wall times, min for minima, the mean over ranks for everything else. A key missing on a rank
    is merged over the ranks that have it."""
    keys: list[str] = []
    for frame in frames:
        keys += [k for k in frame if k not in keys]
    return {k: _merge_one(k, [float(f[k]) for f in frames if k in f]) for k in keys}


def gathered_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """``metrics`` merged over every policy rank (one rank's own metrics in one process). A collective."""
    return merge_rank_metrics(gather_objects(dict(metrics)))
