"""The weight set the weight-sync tests send (torch.distributed broadcast and NIXL alike): one of each case a
bucketed transfer must carry — float32, bfloat16 and float64 tensors, one larger than a 160-byte bucket on its
own, a 0-dim scalar, an empty tensor, int64 and a non-contiguous view."""

from __future__ import annotations

import torch


def mixed_weight_set() -> dict[str, torch.Tensor]:
    """The same tensors on every call (a fixed generator), 614 bytes in all."""
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=gen),  # 140 bytes
        "layer.0.bias": torch.randn(3, generator=gen).to(torch.bfloat16),  # 6 bytes
        "big": torch.randn(40, generator=gen, dtype=torch.float64),  # 320 bytes: over the bucket alone
        "scalar": torch.tensor(2.5),  # 0-dim: 4 bytes
        "empty": torch.empty(0, 4),  # no bytes
        "steps": torch.arange(6, dtype=torch.int64).reshape(2, 3),  # 48 bytes
        "strided": torch.randn(4, 6, generator=gen).t(),  # not contiguous: 96 bytes
    }
