"""The host-side layouts of ``policy/batching.py``: the vectorized slots against hand-computed values
and against a plain per-row layout written here (the one the module used before the twenty-sixth
session), on random ragged batches, padded and packed."""

from __future__ import annotations

import random

import pytest
import torch

from posttrain.policy.batching import build_policy_batch, flat_tensor, pack_rows, pad_lists, ragged_slots


def test_ragged_slots_by_hand() -> None:
    # sequences of 2, 0 and 3 tokens at flat offsets 10, 20 and 5
    slot_N, index_N, owner_N = ragged_slots(torch.tensor([2, 0, 3]), torch.tensor([10, 20, 5]))
    assert slot_N.tolist() == [10, 11, 5, 6, 7]
    assert index_N.tolist() == [0, 1, 0, 1, 2]
    assert owner_N.tolist() == [0, 0, 2, 2, 2]
    empty = ragged_slots(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert [t.numel() for t in empty] == [0, 0, 0]


def test_pad_lists_pads_cuts_and_reads_none_as_empty() -> None:
    out = pad_lists([[0.5, -1.0], None, [1.0, 2.0, 3.0, 4.0], []], 3)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.5, -1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]
    assert pad_lists([], 4).shape == (0, 4)
    # float32 rounding as torch.tensor's: a value that is not exact in float32
    assert pad_lists([[0.1]], 1)[0, 0].item() == torch.tensor(0.1, dtype=torch.float32).item()


def test_flat_tensor_joins_rows_and_checks_the_count() -> None:
    assert flat_tensor([[3, 4], [], (5,)], 3, torch.long).tolist() == [3, 4, 5]
    assert flat_tensor([[3, 4]], 2, torch.long).dtype == torch.long
    with pytest.raises(ValueError):  # fewer numbers than counted: a layout bug, not silent garbage
        flat_tensor([[3]], 2, torch.long)


def _per_row_layout(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int, pack_capacity: int | None
) -> tuple[list, ...]:
    """The layout written the plain way: a loop over rows and their tokens."""
    sequences = [list(p) + list(c) for p, c in zip(prompts, completions)]
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    layout = [[b] for b in range(len(sequences))]
    if pack_capacity is not None:
        width = max(width, pack_capacity)
        layout = pack_rows(lengths, width)
    ids = [[pad_id] * width for _ in layout]
    mask = [[0] * width for _ in layout]
    pos = [list(range(width)) for _ in layout]
    start = [0] * len(sequences)
    for r, members in enumerate(layout):
        col = 0
        for b in members:
            start[b] = r * width + col
            for t, tok in enumerate(sequences[b]):
                ids[r][col + t], mask[r][col + t], pos[r][col + t] = tok, 1, t
            col += lengths[b]
        pos[r][col:] = range(width - col)
    longest = max(len(c) for c in completions)
    comp = [list(c) + [pad_id] * (longest - len(c)) for c in completions]
    cmask = [[1.0] * len(c) + [0.0] * (longest - len(c)) for c in completions]
    rows = [b for b, c in enumerate(completions) for _ in c]
    cols = [t for c in completions for t in range(len(c))]
    sources = [start[b] + len(prompts[b]) - 1 + t for b, t in zip(rows, cols)]
    return ids, mask, pos, comp, cmask, rows, cols, sources, start


@pytest.mark.parametrize("pack_capacity", [None, 6, 24])
def test_build_policy_batch_matches_the_per_row_layout(pack_capacity: int | None) -> None:
    rng = random.Random(pack_capacity or 0)
    for _ in range(60):
        n = rng.randint(1, 9)
        prompts = [[rng.randrange(3, 99) for _ in range(rng.randint(1, 7))] for _ in range(n)]
        completions = [[rng.randrange(3, 99) for _ in range(rng.randint(0, 9))] for _ in range(n)]
        batch = build_policy_batch(prompts, completions, pad_id=1, device="cpu", pack_capacity=pack_capacity)
        ids, mask, pos, comp, cmask, rows, cols, sources, start = _per_row_layout(
            prompts, completions, 1, pack_capacity
        )
        assert batch.input_ids_RL.tolist() == ids and batch.attention_mask_RL.tolist() == mask
        if pack_capacity is None:
            assert batch.position_ids_RL is None
        else:
            assert batch.position_ids_RL is not None and batch.position_ids_RL.tolist() == pos
        assert batch.completion_ids_BT.tolist() == comp and batch.completion_mask_BT.tolist() == cmask
        assert (batch.row_N.tolist(), batch.col_N.tolist(), batch.source_N.tolist()) == (rows, cols, sources)
        assert batch.seq_start_B == start
        assert batch.input_ids_RL.dtype == batch.attention_mask_RL.dtype == batch.row_N.dtype == torch.long


def test_grouped_batch_left_pads_prompts_and_right_pads_completions() -> None:
    from posttrain.policy.shared_prefix import build_grouped_batch

    batch = build_grouped_batch([[5, 6, 7], [8]], [[1, 2], [3], [], [4, 4, 4]], group_size=2, pad_id=0, device="cpu")
    assert batch.prompt_ids_NP.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch.prompt_mask_NP.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.completion_ids_BT.tolist() == [[1, 2, 0], [3, 0, 0], [0, 0, 0], [4, 4, 4]]
    assert (batch.row_N.tolist(), batch.col_N.tolist()) == ([0, 0, 1, 3, 3, 3], [0, 1, 0, 0, 1, 2])
