"""Lay (prompt, completion) token lists out as the tensors the policy forward reads.

Two layouts of the same sequences:

* **padded** (the default): one row per sequence, right-padded to the longest. Every real token
  sees only its own row, and the causal mask alone keeps it from seeing the padding after it.
* **packed** (``model.sequence_packing``): sequences placed end to end into as few rows as hold
  them (first-fit decreasing, each row as wide as the longest sequence), with ``position_ids``
  restarting at 0 for each sequence. transformers turns such position ids into a block-diagonal
  causal mask (flash-attention varlen, flex attention, or an SDPA/eager mask), so each sequence
  still sees only itself while the rows carry little padding.

Either way the batch also carries, for every completion token in row-major order, its ``(row, column)``
in the ``[B, T]`` completion layout and the flat index of the position whose hidden state predicts
it. Those are built on the host here, so the forward never asks the device where the tokens are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch
from torch import Tensor

from posttrain.policy.transfer import to_device


@dataclass
class PolicyBatch:
    """Model inputs ``[R, L]`` (R = B rows padded, fewer when packed) and the ``[B, T]`` completions.

    Completion token ``t`` of sequence ``b`` is ``completion_ids_BT[b, t]``; the hidden state that
    predicts it sits at flat position ``source_N[n]`` of the ``[R * L]`` input, where ``n`` runs over
    the completion tokens row-major and ``(row_N[n], col_N[n]) == (b, t)``. ``T`` is the longest
    completion. ``position_ids_RL`` is None in the padded layout (positions count from 0 per row).
    """

    input_ids_RL: Tensor
    attention_mask_RL: Tensor
    position_ids_RL: Tensor | None
    completion_mask_BT: Tensor
    completion_ids_BT: Tensor
    row_N: Tensor
    col_N: Tensor
    source_N: Tensor
    seq_start_B: list[int] = field(default_factory=list)
    """Host-side: the flat ``[R * L]`` offset of each sequence's first token (routing replay lays its
    per-sequence expert traces out with it, ``policy/routing.py``)."""

    @property
    def num_rows(self) -> int:
        """B: the number of sequences (not of packed input rows)."""
        return int(self.completion_ids_BT.shape[0])


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequence indices grouped into rows of at most ``capacity`` tokens: first-fit decreasing
    (longest first, each into the first row with room). Every length must fit ``capacity``."""
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise ValueError(f"sequence(s) {too_long[:5]} are longer than the packing capacity {capacity}")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            rows.append([])
            room.append(capacity)
            slot = len(rows) - 1
        rows[slot].append(i)
        room[slot] -= lengths[i]
    return rows


def packed_cells(lengths: list[int]) -> int:
    """Token cells (rows x width) of these sequences packed into rows of the longest one."""
    width = max(lengths, default=0)
    return len(pack_rows(lengths, width)) * width


def packed_micro_batches(lengths: list[int], size: int) -> list[list[int]]:
    """Sequence indices split into ``ceil(len / size)`` micro-batches for packing, whichever of two
    splits computes fewer packed cells: consecutive runs of ``size`` by length (each micro-batch
    packs what it holds), or all the sequences packed into rows of the longest one and those rows
    dealt round-robin (short sequences then fill the room beside long ones in every micro-batch).
    The count is the padded split's, so every policy rank runs as many forwards as without
    packing."""
    count = -(-len(lengths) // size)
    by_len = sorted(range(len(lengths)), key=lambda i: lengths[i])
    runs = [by_len[i : i + size] for i in range(0, len(by_len), size)]
    rows = pack_rows(lengths, max(lengths, default=0))
    if len(rows) < count:  # too few rows to give every micro-batch one
        return runs
    dealt = [[i for row in rows[k::count] for i in row] for k in range(count)]

    def cost(split: list[list[int]]) -> int:
        return sum(packed_cells([lengths[i] for i in micro]) for micro in split)

    return dealt if cost(dealt) < cost(runs) else runs


def ragged_slots(lengths_B: Tensor, starts_B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Where the tokens of ragged sequences go in a flat buffer, row-major, on the host: sequence ``b``
    holds ``lengths_B[b]`` tokens from flat offset ``starts_B[b]`` on. Returns ``(slot_N, index_N,
    owner_N)``: each token's flat slot, its index within its sequence and its sequence. A handful of
    tensor operations whatever the number of sequences, where a loop with a few small tensor operations
    per row took 7.3 ms of host time for one of W's micro-batches (1.3 ms now; twenty-sixth session,
    ``benchmarks/layout_host_cost.py``)."""
    owner_N = torch.repeat_interleave(torch.arange(len(lengths_B)), lengths_B)
    first_N = torch.repeat_interleave(lengths_B.cumsum(0) - lengths_B, lengths_B)
    index_N = torch.arange(len(owner_N)) - first_N
    return starts_B[owner_N] + index_N, index_N, owner_N


_NUMPY = {torch.long: np.int64, torch.float32: np.float32}  # flat_tensor's dtypes


def flat_tensor(rows: Iterable[Iterable[Any]], count: int, dtype: torch.dtype) -> Tensor:
    """The ``count`` numbers of ``rows`` end to end as one 1-D host tensor: numpy's ``fromiter`` reads
    them about three times as fast as ``torch.tensor`` of a list (W's micro-batch: 0.27 against 0.91 ms
    on a 2-core EPYC)."""
    return torch.from_numpy(np.fromiter(chain.from_iterable(rows), _NUMPY[dtype], count=count))


def pad_lists(values: list[Any], width: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Rows of numbers (lists, or None for an empty row) right-padded with zeros to ``width``
    columns (longer rows cut), as one host tensor ``[B, width]``: one conversion of all the numbers
    at once instead of one per row."""
    return _padded(values, width, dtype, fill=0)[0]


def _padded(values: list[Any], width: int, dtype: torch.dtype, fill: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``pad_lists`` padding with ``fill``, and each placed number's flat slot, row and column."""
    cut = [() if row is None else row if len(row) <= width else row[:width] for row in values]
    out_BT = torch.full((len(cut), width), fill, dtype=dtype)
    lengths_B = torch.tensor([len(row) for row in cut], dtype=torch.long)
    slot_N, col_N, row_N = ragged_slots(lengths_B, torch.arange(len(cut)) * width)
    out_BT.view(-1)[slot_N] = flat_tensor(cut, len(slot_N), dtype)
    return out_BT, slot_N, row_N, col_N


def completion_grid(
    completion_ids: list[list[int]], *, pad_id: int, width: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The completions right-padded to ``width`` columns, on the host: ids ``[B, width]``, their mask
    (fp32, 1 on real tokens) and the row and column of every real token, row-major (``row_N``,
    ``col_N``, long)."""
    ids_BT, slot_N, row_N, col_N = _padded(completion_ids, width, torch.long, fill=pad_id)
    mask_BT = torch.zeros((len(completion_ids), width), dtype=torch.float32)
    mask_BT.view(-1)[slot_N] = 1.0
    return ids_BT, mask_BT, row_N, col_N


def _check_rows(prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> None:
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions; they must pair up")
    empty = [i for i, p in enumerate(prompt_ids) if not p]
    if empty:
        raise ValueError(f"row(s) {empty[:5]} have an empty prompt; every prompt needs at least one token")


def build_policy_batch(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    *,
    pad_id: int,
    device: Any,
    pack_capacity: int | None = None,
) -> PolicyBatch:
    """Build a ``PolicyBatch`` on ``device``: padded (one row per sequence) when ``pack_capacity`` is
    None, else packed into rows of ``max(pack_capacity, longest sequence)`` tokens. Every prompt
    needs at least one token (the first completion token is predicted from the prompt's last
    position)."""
    _check_rows(prompt_ids, completion_ids)
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    width = max(lengths, default=0)
    if pack_capacity is None:
        layout = [[b] for b in range(len(lengths))]
    else:
        width = max(width, pack_capacity)
        layout = pack_rows(lengths, width)
    start_B = [0] * len(lengths)  # flat offset of each sequence's first token in [R * L]
    fill_R = [0] * len(layout)  # tokens placed in each row
    for r, members in enumerate(layout):
        for b in members:
            start_B[b] = r * width + fill_R[r]
            fill_R[r] += lengths[b]
    starts_B = torch.tensor(start_B, dtype=torch.long)
    slot_N, index_N, _ = ragged_slots(torch.tensor(lengths, dtype=torch.long), starts_B)
    input_ids_RL = torch.full((len(layout), width), pad_id, dtype=torch.long)
    sequences = (chain(p, c) for p, c in zip(prompt_ids, completion_ids))
    input_ids_RL.view(-1)[slot_N] = flat_tensor(sequences, len(slot_N), torch.long)
    attention_mask_RL = torch.zeros((len(layout), width), dtype=torch.long)
    attention_mask_RL.view(-1)[slot_N] = 1
    position_ids_RL = None
    if pack_capacity is not None:
        # each row's tail is a sequence of its own (positions from 0), so it never joins the last one
        position_ids_RL = torch.arange(width) - torch.tensor(fill_R, dtype=torch.long)[:, None]
        position_ids_RL.view(-1)[slot_N] = index_N

    longest = max((len(c) for c in completion_ids), default=0)
    completion_ids_BT, completion_mask_BT, row_N, col_N = completion_grid(completion_ids, pad_id=pad_id, width=longest)
    # completion token t of sequence b is predicted by the position before it (the prompt's last for t = 0)
    last_prompt_B = starts_B + torch.tensor([len(p) for p in prompt_ids], dtype=torch.long) - 1
    source_N = last_prompt_B[row_N] + col_N

    def put(t: Tensor) -> Tensor:
        return to_device(t, device)

    return PolicyBatch(
        input_ids_RL=put(input_ids_RL),
        attention_mask_RL=put(attention_mask_RL),
        position_ids_RL=None if position_ids_RL is None else put(position_ids_RL),
        completion_mask_BT=put(completion_mask_BT),
        completion_ids_BT=put(completion_ids_BT),
        row_N=put(row_N),
        col_N=put(col_N),
        source_N=put(source_N),
        seq_start_B=start_B,
    )
