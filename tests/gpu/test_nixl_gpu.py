"""The ``nixl`` weight-sync transport with both ends' buffers in GPU memory (VRAM), on one GPU:
two processes, the owner's tensors and the replica's buffer on ``cuda:0``, NIXL's UCX backend moving
the bytes (``cuda_ipc`` or ``cuda_copy``, whichever UCX picks on the machine). Bitwise at three bucket
sizes, and a transfer that breaks off after one bucket is refused with no weights handed over.

The CPU tests (``tests/unit/test_nixl_sync.py``) cover the same guarantees on host memory; this file
is what one GPU allows of the GPU path (the disaggregated replica on a second GPU needs two).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from posttrain.distributed import weight_sync
from posttrain.distributed.nixl_sync import NixlReceiver, NixlSender, missing_library
from posttrain.errors import TrainingError

pytestmark = pytest.mark.gpu
GPU = "cuda:0"


@pytest.fixture(autouse=True)
def _needs_cuda_and_nixl() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    missing = missing_library()
    if missing is not None:
        pytest.fail(f"NIXL cannot run here: {missing}")


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    cpu = {
        "embed.weight": torch.randn(1000, 576, generator=gen),
        "layer.0.bias": torch.randn(3, generator=gen).to(torch.bfloat16),
        "big": torch.randn(300_000, generator=gen, dtype=torch.float64),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "steps": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "strided": torch.randn(40, 60, generator=gen).t(),
    }
    return {name: value.to(GPU) for name, value in cpu.items()}


def _replica(bucket_bytes: int, version: int, to_owner: Any, to_test: Any) -> None:
    receiver = NixlReceiver()
    meta = weight_sync.describe(_tensors())
    to_owner.put(receiver.prepare(meta, torch.device(GPU), bucket_bytes, None))
    try:
        got = receiver.wait(meta, version, min_bandwidth_gbps=0.1, probe=True, floor_s=10.0)
        assert all(t.is_cuda for t in got.values())
        payload = io.BytesIO()
        torch.save({k: v.cpu().clone() for k, v in got.items()}, payload)
        to_test.put(payload.getvalue())
    except TrainingError as err:
        to_test.put(str(err))
    receiver.close()


def _run_pair(bucket_bytes: int, first_buckets: int | None = None) -> Any:
    ctx = mp.get_context("spawn")
    to_owner, to_test = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_replica, args=(bucket_bytes, 3, to_owner, to_test))
    proc.start()
    try:
        destination = to_owner.get(timeout=120)
        assert destination.mem_type == "VRAM"
        sender, sent = NixlSender(), _tensors()
        sender.send(
            sent, weight_sync.describe(sent), destination, 3, bucket_bytes=bucket_bytes, first_buckets=first_buckets
        )
        result = to_test.get(timeout=120)
        sender.close()
        if isinstance(result, bytes):
            result = torch.load(io.BytesIO(result))
    finally:
        proc.join(timeout=120)
    assert proc.exitcode == 0
    return result


@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 20, weight_sync.BUCKET_BYTES])
def test_nixl_writes_vram_to_vram_bitwise(bucket_bytes: int) -> None:
    got, sent = _run_pair(bucket_bytes), _tensors()
    assert isinstance(got, dict), got
    assert list(got) == list(sent)
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor.cpu()), name


def test_a_vram_transfer_that_breaks_off_is_refused() -> None:
    got = _run_pair(1 << 20, first_buckets=1)
    assert isinstance(got, str), "a broken-off transfer handed weights over"
    assert "the nixl transfer of version 3 broke off: 1 of" in got
