"""Completion logprobs with each group's prompt run once.

In GRPO the ``group_size`` completions of a prompt share that prompt. The plain path runs
``prompt + completion`` for every completion, so on short completions most of the forward and
backward work is the same prompt, repeated ``group_size`` times. Here the body runs each distinct
prompt once (left-padded, with the KV cache on), the cache is repeated per completion, and the
completions run on top of it. Autograd flows through the repeated cache back into the single prompt
pass, so the gradient is the same as the plain path's (the prompt's contribution arrives summed
over the group instead of computed ``group_size`` times); the values agree to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posttrain.models.structure import split_body_and_head
from posttrain.policy.batching import completion_grid, flat_tensor, ragged_slots
from posttrain.policy.logprobs import chunked_head_logprobs
from posttrain.policy.transfer import to_device

# Where ``model.share_prompt_prefix=auto`` shares on a GPU. Measured on one H200 (the update alone,
# benchmarks/update_precision.py --share on,off; docs/benchmarks.md, "eighth session"): the shared
# path runs the layers twice (prompt pass, then completions over the repeated cache), so at small
# sizes it pays twice the launches, and per computed token it costs 2-4x the plain path. It lost at
# every measured size with prompts of 44 or 256 tokens (135M: 0.231 s against 0.113 s plain on the
# default recipe's batch; 0.4B shape, 256-token prompts and 16-token completions: 0.242 against 0.173 s)
# and won at every size with prompts of 512 or 1,024 tokens (0.4B shape: 512 + 64 tokens 1.03 against
# 1.22 s; 1,024 + 64 1.71 against 2.26 s; 1,024 + 256 1.84 against 2.78 s). At about 2.2x the cost
# per token and groups of 8, it breaks even near prompts of 1.7x the completions.
GPU_SHARE_MIN_PROMPT_TOKENS = 512
GPU_SHARE_MIN_PROMPT_TO_COMPLETION = 2.0


def sharing_pays(mean_prompt_tokens: float, mean_completion_tokens: float, *, on_gpu: bool) -> bool:
    """``model.share_prompt_prefix=auto``'s choice for a batch with these mean lengths.

    On a CPU the update is compute-bound and running each prompt once saves its tokens' work as soon
    as prompts are at least as long as completions. On a GPU small updates are launch-bound and the
    shared path's second pass and cache handling cost more than the repeated prompt tokens it saves,
    unless prompts are both long and well over the completions' length (the thresholds above)."""
    if not on_gpu:
        return mean_prompt_tokens >= mean_completion_tokens
    return (
        mean_prompt_tokens >= GPU_SHARE_MIN_PROMPT_TOKENS
        and mean_prompt_tokens >= GPU_SHARE_MIN_PROMPT_TO_COMPLETION * mean_completion_tokens
    )


@dataclass
class GroupedBatch:
    """``N`` prompts, left-padded to one width, and their ``N * G`` completions, right-padded."""

    prompt_ids_NP: Tensor
    prompt_mask_NP: Tensor
    completion_ids_BT: Tensor
    completion_mask_BT: Tensor
    group_size: int
    row_N: Tensor  # (row, column) of every completion token, row-major, built on the host (no sync)
    col_N: Tensor


def build_grouped_batch(
    prompt_ids: list[list[int]], completion_ids: list[list[int]], *, group_size: int, pad_id: int, device: Any
) -> GroupedBatch:
    """``prompt_ids[i]`` is shared by ``completion_ids[i * G : (i + 1) * G]``."""
    if len(completion_ids) != len(prompt_ids) * group_size:
        raise ValueError(f"{len(prompt_ids)} prompts x group {group_size} != {len(completion_ids)} completions")
    width_p = max(len(p) for p in prompt_ids)
    width_t = max([1, *(len(c) for c in completion_ids)])
    # prompts left-padded (each ends where its completions begin), placed as the completions are
    lengths_N = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    slot_N, _, _ = ragged_slots(lengths_N, torch.arange(len(prompt_ids)) * width_p + width_p - lengths_N)
    prompt_NP = torch.full((len(prompt_ids), width_p), pad_id, dtype=torch.long)
    prompt_NP.view(-1)[slot_N] = flat_tensor(prompt_ids, len(slot_N), torch.long)
    pmask_NP = torch.zeros_like(prompt_NP)
    pmask_NP.view(-1)[slot_N] = 1
    comp_BT, cmask_BT, row_N, col_N = completion_grid(completion_ids, pad_id=pad_id, width=width_t)
    return GroupedBatch(
        to_device(prompt_NP, device),
        to_device(pmask_NP, device),
        to_device(comp_BT, device),
        to_device(cmask_BT, device),
        group_size,
        to_device(row_N, device),
        to_device(col_N, device),
    )


def grouped_completion_logprobs(
    model: Any, batch: GroupedBatch, *, temperature: float = 1.0, chunk_tokens: int = 1024
) -> Tensor:
    """``logprobs_BT`` exactly as ``completion_logprobs`` defines them, one prompt pass per group."""
    body, head = split_body_and_head(model)
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    g = batch.group_size
    prompt_pos_NP = (batch.prompt_mask_NP.cumsum(-1) - 1).clamp(min=0)
    prompt_out = body(
        input_ids=batch.prompt_ids_NP,
        attention_mask=batch.prompt_mask_NP,
        position_ids=prompt_pos_NP,
        use_cache=True,
    )
    cache = prompt_out.past_key_values
    cache.batch_repeat_interleave(g)
    last_prompt_BH = prompt_out.last_hidden_state[:, -1].repeat_interleave(g, dim=0)

    width_t = batch.completion_ids_BT.shape[1]
    prompt_len_B1 = batch.prompt_mask_NP.sum(-1, keepdim=True).repeat_interleave(g, dim=0)
    comp_pos_BT = prompt_len_B1 + torch.arange(width_t, device=prompt_len_B1.device)
    # Padding after a completion is masked out; real tokens never look past themselves anyway.
    full_mask = torch.cat(
        [batch.prompt_mask_NP.repeat_interleave(g, dim=0), batch.completion_mask_BT.long().clamp(min=0)], dim=1
    )
    full_mask[:, batch.prompt_mask_NP.shape[1] :] = 1
    comp_out = body(
        input_ids=batch.completion_ids_BT,
        attention_mask=full_mask,
        position_ids=comp_pos_BT,
        past_key_values=cache,
        use_cache=True,
    )
    # Token t is predicted by the state before it: the prompt's last state for t = 0.
    predict_BTH = torch.cat([last_prompt_BH[:, None], comp_out.last_hidden_state[:, :-1]], dim=1)
    b_N, t_N = batch.row_N, batch.col_N
    hidden_NH = predict_BTH[b_N, t_N]
    ids_N1 = batch.completion_ids_BT[b_N, t_N].unsqueeze(-1)
    out_N = chunked_head_logprobs(
        hidden_NH, ids_N1, head, temperature=temperature, softcap=softcap, chunk_tokens=chunk_tokens
    )[:, 0]
    rows = batch.completion_ids_BT.shape[0]
    return out_N.new_zeros((rows, width_t)).index_put((b_N, t_N), out_N)
