"""Collective weight sync between a policy rank and a disaggregated rollout replica
(``rl.weight_sync_transport=nccl``).

The policy rank that feeds a replica (its *owner*, see ``launch/ray_backend.py``) and the replica
form a process group of two of their own, outside the policy ranks' default group: a ``TCPStore``
served by the owner and a ``ProcessGroupNCCL`` between the two GPUs (``ProcessGroupGloo`` on CPU,
which is how the CPU tests run this path). Each sync the owner tells the replica, by a Ray call,
the names, shapes and dtypes it will send, then broadcasts the tensors packed into buckets of about
``BUCKET_BYTES`` (``plan_buckets``: a few hundred tensors of a small model are one broadcast, a 7B
model's ~30); the replica receives each bucket into a fresh buffer, splits it into views, and
copies them into its model only once all arrived, then stamps the version. A broken or partial
transfer poisons the replica (``RolloutActor``).

Why not vLLM's ``NCCLWeightTransferEngine``: it opens its own PyNccl communicator on CUDA streams
at both ends, so it cannot run the gloo pair these paths are tested with on CPU, nor two processes
on one GPU; its packing (``packed_tensor.pack_tensors``) is the same byte concatenation done here,
so the layout costs nothing to own. Packing keeps the one-broadcast-per-bucket gain, and while one
bucket is on the wire the next is packed (two in flight at most, bounding the extra memory).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from posttrain.errors import TrainingError

TensorMeta = tuple[str, tuple[int, ...], str]


def pair_group(host: str, port: int, rank: int, *, timeout_s: float) -> Any:
    """A process group of two: rank 0 (the owner, which serves the store) and rank 1 (the replica).

    NCCL between CUDA devices, gloo on the CPU. Blocks until both sides joined (bounded by the timeout).
    """
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size=2, is_master=rank == 0, timeout=timeout)
    if torch.cuda.is_available():
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise TrainingError("rl.weight_sync_transport=nccl: this torch build has no NCCL process group")
        options = nccl.Options()
        options._timeout = timeout
        return nccl(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def close_group(group: Any) -> None:
    """Release a pair group's communicator (NCCL warns at exit about one never shut down); ``None``
    is a no-op. Local: it does not wait for the peer."""
    shutdown = getattr(group, "shutdown", None)
    if shutdown is not None:
        shutdown()


def describe(named_tensors: dict[str, torch.Tensor]) -> list[TensorMeta]:
    """What the replica must allocate to receive ``named_tensors``, in send order."""
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named_tensors.items()]


BUCKET_BYTES = 256 * 2**20
"""Bytes per packed broadcast: large enough that per-call latency vanishes (a bucket of 256 MiB
moves in ~1 ms over NVLink), small enough that the extra copy on each side stays small."""


_ALIGN = 16  # bytes: each tensor starts where a view of any dtype (complex128 included) may start


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * getattr(torch, dtype).itemsize


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def plan_buckets(meta: list[TensorMeta], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive runs of ``meta``'s indices, each at most ``bucket_bytes`` with every tensor
    padded to ``_ALIGN`` bytes (a larger tensor goes alone). Both sides compute it from the same
    ``meta``, so no boundary travels."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(meta):
        n = _padded(_nbytes(shape, dtype))
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def _offsets(entries: list[TensorMeta]) -> tuple[list[int], int]:
    """Where each entry's bytes start in its bucket's buffer, and the buffer's size."""
    offsets, end = [], 0
    for _, shape, dtype in entries:
        offsets.append(end)
        end += _padded(_nbytes(shape, dtype))
    return offsets, end


def _packed(entries: list[TensorMeta], tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes in one uint8 buffer on their device, each at its aligned offset."""
    offsets, size = _offsets(entries)
    buffer = torch.empty(size, dtype=torch.uint8, device=tensors[0].device)
    for tensor, offset in zip(tensors, offsets, strict=True):
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        buffer[offset : offset + flat.numel()].copy_(flat)
    return buffer


def send(group: Any, named_tensors: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Broadcast the tensors from the owner (rank 0) in ``plan_buckets`` buckets, in ``describe``
    order; the next bucket is packed while the previous one is on the wire."""
    tensors = list(named_tensors.values())
    meta = describe(named_tensors)
    pending: Any = None
    for bucket in plan_buckets(meta, bucket_bytes):
        work = group.broadcast(_packed([meta[i] for i in bucket], [tensors[i] for i in bucket]), 0)
        if pending is not None:
            pending.wait()
        pending = work
    if pending is not None:
        pending.wait()


def receive(
    group: Any, meta: list[TensorMeta], device: torch.device, bucket_bytes: int = BUCKET_BYTES
) -> dict[str, torch.Tensor]:
    """The replica's side of ``send``: a fresh buffer per bucket, split into views of it."""
    out: dict[str, torch.Tensor] = {}
    for bucket in plan_buckets(meta, bucket_bytes):
        entries = [meta[i] for i in bucket]
        offsets, size = _offsets(entries)
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        group.broadcast(buffer, 0).wait()
        for (name, shape, dtype), offset in zip(entries, offsets, strict=True):
            n = _nbytes(shape, dtype)
            out[name] = buffer[offset : offset + n].view(getattr(torch, dtype)).reshape(shape)
    return out
