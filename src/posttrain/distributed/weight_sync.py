"""Collective weight sync between a policy rank and a disaggregated rollout replica
(``rl.weight_sync_transport=nccl``).

The policy rank that feeds a replica (its *owner*, see ``launch/ray_backend.py``) and the replica
form a process group of two of their own, outside the policy ranks' default group: a ``TCPStore``
served by the owner and a ``ProcessGroupNCCL`` between the two GPUs (``ProcessGroupGloo`` on CPU,
which is how the CPU tests run this path). Each sync the owner tells the replica, by a Ray call,
the names, shapes and dtypes it will send, then broadcasts every tensor from its device; the
replica receives into fresh buffers and copies them into its model only once all arrived, then
stamps the version. A broken or partial transfer poisons the replica (``RolloutActor``).
"""

from __future__ import annotations

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


def send(group: Any, named_tensors: dict[str, torch.Tensor]) -> None:
    """Broadcast every tensor from the owner (rank 0), in ``describe`` order."""
    for tensor in named_tensors.values():
        group.broadcast(tensor.detach().contiguous(), 0).wait()


def receive(group: Any, meta: list[TensorMeta], device: torch.device) -> dict[str, torch.Tensor]:
    """The replica's side of ``send``: fresh buffers, filled by the owner's broadcasts."""
    out: dict[str, torch.Tensor] = {}
    for name, shape, dtype in meta:
        buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        group.broadcast(buffer, 0).wait()
        out[name] = buffer
    return out
