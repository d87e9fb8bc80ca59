"""A mini-batch's passes: which rows run together, and which of those passes run with autograd.

The trainer marks the rows that cannot move the weights (``policy/free_rows.py``: whole groups
with all-zero advantages under an objective whose only gradient is the advantage-weighted
surrogate). Their forward still runs, for the step's metrics, but without autograd, and the
backward covers only the rows that learn. The trainer cuts its micro-batches with the free groups
first (``free_groups_first``; ``packed_free_first`` under ``model.sequence_packing``, whose
micro-batches after the wholly free ones follow the lengths, so more than one may hold both). In one
process each micro-batch then splits in two where it holds both (``split_passes``). FSDP's ranks
must run the same sequence of passes, since every forward gathers the sharded weights and every
backward reduces gradients, collectives that pair up across ranks, while each rank's rows tie
differently. There a micro-batch runs without autograd only where it is free on every rank, and is
split where every rank can split it (``pass_kinds``, reduced by minimum, then ``agreed_passes``): a
rank whose micro-batch holds both kinds splits it by kind, and one whose micro-batch is wholly free
runs its last ``unit`` rows (a group, where the prompt pass is shared) with autograd, where they add
zero, so that it still meets the other ranks' backward. Otherwise (some rank's micro-batch learns
whole) it runs whole with autograd, its free rows adding zero.
"""

from __future__ import annotations

import torch

Pass = tuple[list[int], bool]  # a pass's rows, and whether it learns (runs with autograd)


def split_passes(micro_batches: list[list[int]], free_B: torch.Tensor) -> list[Pass]:
    """Each micro-batch's free rows in a pass without autograd, then each one's rows that learn;
    empty parts left out. The free passes run first (``free_first``)."""
    flags = free_B.tolist()
    return free_first([part for rows in micro_batches for part in _split(rows, flags)])


def _split(rows: list[int], flags: list[bool]) -> list[Pass]:
    """One micro-batch's free rows (no autograd), then its rows that learn; an empty part left out."""
    learning, free = [i for i in rows if not flags[i]], [i for i in rows if flags[i]]
    return [(part, learns) for part, learns in ((free, False), (learning, True)) if part]


def free_first(parts: list[Pass]) -> list[Pass]:
    """The passes without autograd, then those with, each in their order. The gradient is a sum, so
    the order does not change it; a forward without autograd between two backwards under FSDP2
    (torch 2.13) dropped the gradient the [embedding, head] unit had accumulated so far (two gloo
    ranks, tests/integration/test_fsdp_equivalence.py), while one before the first backward is what
    the pi_old pass has always done."""
    return [p for p in parts if not p[1]] + [p for p in parts if p[1]]


def pass_kinds(micro_batches: list[list[int]], free_B: torch.Tensor, unit: int = 1) -> torch.Tensor:
    """Per micro-batch (float, shape ``[M, 2]``): 1.0 where this rank can split it into a pass without
    autograd and one with (it has free rows, and rows that learn or more than ``unit`` rows), 1.0 where
    every row is free. Their minimum over ranks is what every rank may do (``agreed_passes``)."""
    flags = free_B.tolist()
    kinds = []
    for rows in micro_batches:
        free = sum(flags[i] for i in rows)
        kinds.append([float(free > 0 and (free < len(rows) or len(rows) > unit)), float(free == len(rows))])
    return torch.tensor(kinds, dtype=torch.float32).reshape(len(micro_batches), 2)


def agreed_passes(
    micro_batches: list[list[int]], free_B: torch.Tensor, agreed_kinds: torch.Tensor, unit: int = 1
) -> list[Pass]:
    """The passes every rank runs alike, from ``pass_kinds``'s minimum over the ranks: a micro-batch
    free on every rank runs without autograd; one that every rank can split is split (by kind, or,
    where it is wholly free on this rank, its last ``unit`` rows with autograd, adding zero); any
    other runs whole with autograd (its free rows add zero to the gradient). The passes without
    autograd come first (``free_first``)."""
    flags, parts = free_B.tolist(), []
    for rows, (split, all_free) in zip(micro_batches, agreed_kinds.tolist(), strict=True):
        if all_free:
            parts.append((rows, False))
        elif split and all(flags[i] for i in rows):
            parts += [(rows[:-unit], False), (rows[-unit:], True)]
        elif split:
            parts += _split(rows, flags)
        else:
            parts.append((rows, True))
    return free_first(parts)
