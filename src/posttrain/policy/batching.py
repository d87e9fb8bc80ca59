"""Pack (prompt, completion) token lists into the right-padded tensors the policy forward reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class PolicyBatch:
    """Right-padded sequences: row ``b`` is ``prompt_b + completion_b`` then padding.

    ``completion_ids_BT[b, t]`` sits at ``input_ids_BL[b, completion_start_B[b] + t]`` and is
    predicted by position ``completion_start_B[b] + t - 1``. ``T`` is the longest completion.
    """

    input_ids_BL: Tensor
    attention_mask_BL: Tensor
    completion_start_B: Tensor
    completion_mask_BT: Tensor
    completion_ids_BT: Tensor

    @property
    def num_rows(self) -> int:
        return int(self.input_ids_BL.shape[0])


def build_policy_batch(
    prompt_ids: list[list[int]], completion_ids: list[list[int]], *, pad_id: int, device: Any
) -> PolicyBatch:
    """Build a ``PolicyBatch`` on ``device``; every prompt needs at least one token (the first
    completion token is predicted from the prompt's last position)."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions; they must pair up")
    empty = [i for i, p in enumerate(prompt_ids) if not p]
    if empty:
        raise ValueError(f"row(s) {empty[:5]} have an empty prompt; every prompt needs at least one token")
    rows = len(prompt_ids)
    width = max((len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)), default=0)
    longest = max((len(c) for c in completion_ids), default=0)
    input_ids_BL = torch.full((rows, width), pad_id, dtype=torch.long)
    attention_mask_BL = torch.zeros((rows, width), dtype=torch.long)
    completion_ids_BT = torch.full((rows, longest), pad_id, dtype=torch.long)
    completion_mask_BT = torch.zeros((rows, longest), dtype=torch.float32)
    for b, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        total = len(prompt) + len(completion)
        input_ids_BL[b, :total] = torch.tensor(list(prompt) + list(completion), dtype=torch.long)
        attention_mask_BL[b, :total] = 1
        completion_ids_BT[b, : len(completion)] = torch.tensor(completion, dtype=torch.long)
        completion_mask_BT[b, : len(completion)] = 1.0
    completion_start_B = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    return PolicyBatch(
        input_ids_BL=input_ids_BL.to(device),
        attention_mask_BL=attention_mask_BL.to(device),
        completion_start_B=completion_start_B.to(device),
        completion_mask_BT=completion_mask_BT.to(device),
        completion_ids_BT=completion_ids_BT.to(device),
    )
