"""Work rank 0 does alone for longer than a collective may wait, while the other ranks wait for it.

An upload drained at the end of a run (``rl.upload.wait_timeout_s``, an hour by default) or a
checkpoint downloaded from the archive before a resume can take longer than
``grid.collective_timeout_s``. Had the other ranks waited for it inside a collective (a broadcast
of its result, the barrier before leaving the process group), the process group's timeout would
end them first and take the launch down with them. ``on_rank_zero`` has them poll the process
group's key-value store instead (``check`` returns at once, so no timeout applies) until rank 0
says it is done, and only then meet it in the broadcast of its result. Trivial in one process.

A rank 0 that dies meanwhile never says so; the launcher (torchrun's agent, the Ray driver) ends
the other ranks when one of its processes fails.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from posttrain.distributed.world import broadcast_object, rank_and_world
from posttrain.errors import TrainingError

T = TypeVar("T")
_CALLS = itertools.count()
_POLL_S = 0.1


def _store() -> Any:
    """The default process group's key-value store (the rendezvous store every rank reaches)."""
    return dist.distributed_c10d._get_default_store()


def on_rank_zero(work: Callable[[], T], *, what: str) -> T:
    """``work()`` run on rank 0 only; its (picklable) result on every rank. The other ranks wait
    without a timeout (see the module docstring). An exception of ``work`` is re-raised on rank 0;
    the other ranks raise a ``TrainingError`` naming ``what`` and the error. A collective: every rank
    calls it at the same point."""
    rank, world = rank_and_world()
    if world == 1:
        return work()
    key = f"posttrain/on_rank_zero/{next(_CALLS)}"
    store = _store()
    if rank == 0:
        failure: BaseException | None = None
        result: Any = None
        try:
            result = work()
        except BaseException as exc:  # the others must hear of it, or they would wait for ever
            failure = exc
        store.set(key, b"done")  # kept: a rank still between two polls must find it (one key per call)
        broadcast_object((None if failure is None else f"{type(failure).__name__}: {failure}", result))
        if failure is not None:
            raise failure
        return result
    while not store.check([key]):
        time.sleep(_POLL_S)
    error, result = broadcast_object(None)
    if error is not None:
        raise TrainingError(f"rank 0 failed {what}: {error}")
    return result
