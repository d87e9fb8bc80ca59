"""Rows that cannot move the weights.

A GRPO group whose rewards all tie has advantage 0 for every member: "it contributes no gradient
but still occupies batch capacity" (the spec, on dynamic sampling). Where the objective's only
gradient is the advantage-weighted surrogate (``Objective.zero_advantage_rows_learn_nothing``: no
KL term in the loss, no distillation divergence), such a row adds exactly zero to every gradient,
whatever its logprobs, clip or importance weight. The update still reads it: its tokens count in
the step's stats (the clip fraction's and the logprob gap's denominators, the gap and KL metrics)
and in the global normaliser, which the trainer computes from the whole mini-batch anyway. So the
trainer runs such rows in a forward without autograd, in a pass of their own, and the backward
covers only the rows that learn. Its micro-batches are cut with the free groups first
(``free_groups_first``; ``packed_free_first`` under ``model.sequence_packing``), and each is split
by kind (``distributed/passes.py``: in one process every micro-batch; across FSDP ranks, which must
all run the same passes, only where every rank can split it).
On the default CPU job 60 % of the groups tie over the 60 steps, and a backward costs about twice
its forward (docs/benchmarks.md, "Issue 18, seventeenth session").

The gradient is the same sum without the zero terms, so the update is the same up to the rounding
of the smaller products; a group is free only as a whole, so a shared prompt pass
(``model.share_prompt_prefix``) still gets whole groups on both sides.
"""

from __future__ import annotations

import torch

from posttrain.policy.batching import packed_micro_batches
from posttrain.policy.train_batch import TokenAdvantages


def free_rows(advantages_B: torch.Tensor, token_advantages: TokenAdvantages | None, group_size: int) -> torch.Tensor:
    """Per row (bool, on the CPU): whether its whole group has advantage exactly 0, per sequence and,
    with per-token advantages (OPD's credit), at every token. Rows are laid out group by group."""
    zero_B = advantages_B.detach().cpu() == 0
    if token_advantages is not None:
        zero_B &= torch.tensor([all(v == 0 for v in row) for row in token_advantages.values], dtype=torch.bool)
    g = max(group_size, 1)
    if zero_B.numel() % g:  # not whole groups: decide row by row
        return zero_B
    return zero_B.view(-1, g).all(dim=1).repeat_interleave(g)


def free_groups_first(rows: list[int], free: list[bool], group_size: int) -> list[int]:
    """``rows`` (whole groups, laid out group by group) with the groups whose every row is ``free``
    first, each part in its order. Micro-batches cut from this order hold free groups only, up to
    one mixed micro-batch, then groups that learn: whole micro-batches then skip the backward, and
    on FSDP ranks they do so at the same positions (``distributed/passes.py``)."""
    g = max(group_size, 1)
    groups = [rows[i : i + g] for i in range(0, len(rows), g)]
    tied = [all(free[i] for i in group) for group in groups]
    return [i for group, t in zip(groups, tied, strict=True) if t for i in group] + [
        i for group, t in zip(groups, tied, strict=True) if not t for i in group
    ]


def packed_free_first(rows: list[int], lengths: list[int], free: list[bool], size: int) -> list[list[int]]:
    """``rows``' micro-batches for ``model.sequence_packing`` (``lengths[j]`` is ``rows[j]``'s), as many
    as ``packed_micro_batches`` cuts (``ceil(len / size)``, the same on every FSDP rank), with
    ``free_groups_first``'s aim: as many wholly free micro-batches as the free rows fill (each packing
    what it holds), first, then the rest packed as before, with the free rows left over. Without a
    full micro-batch of free rows it is ``packed_micro_batches`` itself."""
    free_at = [j for j, row in enumerate(rows) if free[row]]
    whole = len(free_at) // size * size
    head, head_set = free_at[:whole], set(free_at[:whole])
    tail = [j for j in range(len(rows)) if j not in head_set]

    def packed(part: list[int]) -> list[list[int]]:
        return [[rows[part[k]] for k in micro] for micro in packed_micro_batches([lengths[j] for j in part], size)]

    return packed(head) + packed(tail)  # an empty part packs into no micro-batch
