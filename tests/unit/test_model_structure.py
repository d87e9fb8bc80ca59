"""The body's forward tells transformers when its rows hold no packed sequences
(``models.structure.rows_not_packed``): padded rows skip the packing check (a host sync per
forward on a GPU), packed rows keep it, and the answer is scoped to the forward's thread."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from posttrain.models.structure import body_hidden_states, rows_not_packed, split_body_and_head
from tiny_models import tiny_llama

PACKED_L = torch.tensor([[0, 1, 2, 0, 1]])


def tiny_body() -> nn.Module:
    torch.manual_seed(0)
    body, _ = split_body_and_head(tiny_llama(32, attention="sdpa").eval())
    return body


@pytest.fixture
def check_calls(monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """Put a recording check in transformers' place (restored after the test); the body's forward
    wraps it on first use."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    while hasattr(original, "__wrapped__"):  # an earlier test's wrapper: record the transformers one
        original = original.__wrapped__
    calls: list[Tensor] = []

    def recording(position_ids: Tensor) -> Any:
        calls.append(position_ids)
        return original(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", recording)
    return calls


def test_padded_rows_skip_the_packing_check_and_packed_rows_keep_it(check_calls: list[Tensor]) -> None:
    body = tiny_body()
    ids_RL = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        padded = body_hidden_states(body, ids_RL)
        assert check_calls == []  # no check, so no host sync on a GPU
        # the same rows with their positions given: checked, and equal (one sequence each)
        assert torch.allclose(body_hidden_states(body, ids_RL, torch.arange(5).expand(2, 5)), padded, atol=1e-6)
        assert len(check_calls) == 1
        # a packed row still gets its per-sequence mask: the second sequence sees nothing of the first
        packed = body_hidden_states(body, ids_RL[:1], PACKED_L)
        alone = body_hidden_states(body, ids_RL[:1, 3:])
        assert len(check_calls) == 2
    assert torch.allclose(packed[:, 3:], alone, atol=1e-6)


def test_the_answer_holds_only_inside_the_block_and_only_in_its_thread() -> None:
    from transformers import masking_utils

    assert masking_utils.find_packed_sequence_indices(PACKED_L) is not None
    seen_elsewhere: list[Any] = []
    with rows_not_packed():
        assert masking_utils.find_packed_sequence_indices(PACKED_L) is None
        other = threading.Thread(
            target=lambda: seen_elsewhere.append(masking_utils.find_packed_sequence_indices(PACKED_L))
        )
        other.start()
        other.join()
    assert seen_elsewhere[0] is not None  # a packed forward in another thread is still checked
    assert masking_utils.find_packed_sequence_indices(PACKED_L) is not None
