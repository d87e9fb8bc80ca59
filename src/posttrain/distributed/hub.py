"""Rank 0 as a hub: every policy rank hands it an object, rank 0 answers each rank with its own.

A role that serves all policy ranks at once (the OPD teacher pool, ``teacher/remote.py``) takes one
batch per step rather than one per rank: rank 0 gathers the ranks' parts (``gather_to_zero``),
calls the role once, and sends each rank its part of the answer (``scatter_from_zero``). Both are
collectives every rank calls in the same order; in one process they are trivial.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from posttrain.distributed.world import rank_and_world


def gather_to_zero(obj: Any) -> list[Any] | None:
    """Every rank's picklable ``obj`` in rank order on rank 0 (``None`` on the others). A collective."""
    rank, world = rank_and_world()
    if world == 1:
        return [obj]
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def scatter_from_zero(per_rank: list[Any] | None) -> Any:
    """Rank ``r``'s entry of rank 0's ``per_rank`` list (ignored on the other ranks). A collective."""
    rank, world = rank_and_world()
    if world == 1:
        if per_rank is None or len(per_rank) != 1:
            raise ValueError("scatter_from_zero in one process needs a list of one entry")
        return per_rank[0]
    box: list[Any] = [None]
    dist.scatter_object_list(box, per_rank if rank == 0 else None, src=0)
    return box[0]
