"""Host-to-device copies of a micro-batch's inputs that do not make the host wait for the GPU.

A plain ``tensor.to("cuda")`` from ordinary (pageable) host memory is a synchronous copy: the host
waits until the GPU has run everything queued before it, the previous micro-batch's backward
included, and the GPU then idles while the host prepares and launches the next forward. On one
H100 a W update made 274 such waits (``benchmarks/update_precision.py --syncs``, twenty-fifth
session), 256 of them one per row of the sampler's logprobs. Staged through pinned (page-locked)
memory, the copy is queued like a kernel and the host runs on; PyTorch's caching host allocator keeps
the pinned block until the copy has run, so reusing it is safe.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """``t`` on ``device``: a CPU tensor bound for a CUDA device as a non-blocking copy from pinned
    memory; any other move as ``Tensor.to``."""
    device = torch.device(device)
    if t.device.type != "cpu" or device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
