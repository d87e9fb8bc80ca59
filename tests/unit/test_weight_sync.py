"""Packed-bucket weight transfer between an owner and a replica (``distributed/weight_sync.py``),
over a real gloo pair group in two processes."""

from __future__ import annotations

import io

import pytest
import torch
import torch.multiprocessing as mp
from gloo_ranks import free_port
from weight_sets import mixed_weight_set

from posttrain.distributed import weight_sync


def test_plan_buckets_hand_values() -> None:
    meta = weight_sync.describe(mixed_weight_set())
    # bytes in order, padded to 16: 144, 16, 320, 16, 0, 48, 96; buckets of at most 160 bytes, a
    # larger tensor alone
    assert weight_sync.plan_buckets(meta, 160) == [[0, 1], [2], [3, 4, 5, 6]]
    assert weight_sync.plan_buckets(meta, 159) == [[0], [1], [2], [3, 4, 5], [6]]
    assert weight_sync.plan_buckets(meta, 10**6) == [[0, 1, 2, 3, 4, 5, 6]]
    assert weight_sync.plan_buckets(meta, 1) == [[0], [1], [2], [3], [4], [5], [6]]


def _replica(port: int, bucket_bytes: int, queue: mp.Queue) -> None:
    group = weight_sync.pair_group("127.0.0.1", port, 1, timeout_s=60)
    got = weight_sync.receive(group, weight_sync.describe(mixed_weight_set()), torch.device("cpu"), bucket_bytes)
    # As bytes: a tensor put on a torch queue travels as a file descriptor the receiver fetches from
    # this process, which may have exited by then (seen under load: ConnectionResetError).
    payload = io.BytesIO()
    torch.save({k: v.clone() for k, v in got.items()}, payload)  # own storage each: views share a bucket
    queue.put(payload.getvalue())


@pytest.mark.parametrize("bucket_bytes", [160, 1, weight_sync.BUCKET_BYTES])
def test_send_receive_bitwise_over_gloo(bucket_bytes: int) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_replica, args=(port, bucket_bytes, queue))
    proc.start()
    group = weight_sync.pair_group("127.0.0.1", port, 0, timeout_s=60)
    sent = mixed_weight_set()
    weight_sync.send(group, sent, bucket_bytes)
    got = torch.load(io.BytesIO(queue.get(timeout=60)))
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert list(got) == list(sent)
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
