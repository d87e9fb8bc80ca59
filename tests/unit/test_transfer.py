"""A micro-batch's host inputs reach the device as few whole tensors (``policy/transfer.py``,
``train_batch.sampler_logprobs_rows``, ``gather_rows``); the pinned, non-blocking path itself is checked on a GPU
(``tests/gpu/test_gpu_smoke.py``: an update's host waits do not grow with rows or micro-batches)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from posttrain.policy import train_batch
from posttrain.policy.train_batch import TrainBatch, gather_rows, sampler_logprobs_rows
from posttrain.policy.transfer import to_device


def _recording_moves(monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    moved: list[Tensor] = []

    def recording(t: Tensor, device: torch.device | str) -> Tensor:
        moved.append(t)
        return to_device(t, device)

    monkeypatch.setattr(train_batch, "to_device", recording)
    return moved


def test_sampler_rows_are_padded_on_the_host_and_moved_as_one_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    moved = _recording_moves(monkeypatch)
    batch = TrainBatch(
        prompt_ids=[[1]] * 3,
        completion_ids=[[5, 6, 7], [], [5, 6, 7, 8, 9]],
        advantages_B=torch.zeros(3),
        in_loss_B=torch.ones(3, dtype=torch.bool),
        sampler_logprobs=[[1.0, 2.0, 3.0], [], [4.0, 5.0, 6.0, 7.0, 8.0]],
        group_size=1,
    )
    out, recorded = sampler_logprobs_rows(batch, [2, 0, 1], 4, torch.device("cpu"))
    assert torch.equal(out, torch.tensor([[4.0, 5, 6, 7], [1, 2, 3, 0], [0, 0, 0, 0]]))
    assert out.dtype == torch.float32 and recorded is None
    assert len(moved) == 1 and moved[0].shape == (3, 4)  # one copy for the micro-batch, not one a row


def test_gather_rows_takes_rows_and_columns_in_one_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    moved = _recording_moves(monkeypatch)
    padded_BT = torch.arange(12.0).reshape(3, 4)
    out = gather_rows(padded_BT, [2, 0], 3, torch.device("cpu"))
    assert torch.equal(out, torch.tensor([[8.0, 9, 10], [0, 1, 2]]))
    assert [t.shape for t in moved] == [(2,), (2, 3)]  # the row indices, then the rows: no copy per row


def test_to_device_leaves_a_tensor_already_there_alone_and_takes_device_names() -> None:
    t = torch.arange(3)
    assert to_device(t, "cpu") is t
    assert to_device(t, torch.device("cpu")) is t


def test_host_waits_lists_each_wait_from_run_inwards(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA's sync debug mode reports a wait as a warning; here the work raises such warnings itself
    # (no GPU), so what is checked is the recording: every wait, its stack from run inwards, nothing else
    import threading
    import warnings

    from posttrain.policy import transfer

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def reads_a_gpu_value() -> None:
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)

    def step() -> None:
        for _ in range(3):
            reads_a_gpu_value()
        warnings.warn("some other warning", stacklevel=1)
        other = threading.Thread(target=reads_a_gpu_value)  # another thread's wait is not run's
        other.start()
        other.join()

    stacks = transfer.host_waits(step)
    assert [[f.name for f in stack] for stack in stacks] == [["step", "reads_a_gpu_value"]] * 3
    assert modes == ["warn", "default"]
