"""Per-token credit of on-policy distillation's advantage mode: the reward advantage plus teacher credit.

In advantage mode the teacher's signal is not a loss of its own but credit added to the group
(reward) advantage of every generated token, and the sum is trained with the GRPO clipped surrogate
(spec: opd.md, "Cross-token DPCA" and "Teacher modes")::

    A_policy(t) = A_reward + kl_penalty_coef · A_teacher(t)

``A_reward`` is the completion's group advantage (GRPO, arXiv 2402.03300 §4.1.2), the same for all
its tokens. ``A_teacher(t)`` is built by the teacher role: ``log p_teacher(y_t) - log p_rollout(y_t)``
for a same-vocabulary teacher, the per-token reverse-KL reward of on-policy distillation
(MiniLLM, Gu et al., arXiv 2306.08543; GKD, Agarwal et al., arXiv 2306.13649), or the DPCA chunk
credit for a cross-tokenizer one (``dpca.py``). The first ``n_ignore_prefix_tokens`` tokens of
every completion carry no teacher credit (their reward advantage stays).

Pure tensor math: no I/O, no ``.item()``; computed in float64. Shapes: ``B`` completions, ``N``
generated tokens of all of them, concatenated in completion order.
"""

# Shape-suffixed names (credit_N) are the project convention, not mixedCase.

from __future__ import annotations

import torch
from torch import Tensor


def opd_token_advantages(
    reward_advantages_B: Tensor,
    teacher_credit_N: Tensor,
    lengths_B: Tensor,
    kl_penalty_coef: float,
    n_ignore_prefix_tokens: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Every generated token's policy advantage ``A_reward + kl_penalty_coef · A_teacher(t)``.

    ``reward_advantages_B``: one group advantage per completion. ``teacher_credit_N``: the teacher
    credit of every generated token before ``kl_penalty_coef``, completion after completion (ragged:
    completion ``b`` holds ``lengths_B[b]`` consecutive entries). Credit at positions below
    ``n_ignore_prefix_tokens`` of a completion is zeroed.

    Returns ``token_advantages_N`` (float64, split it by ``lengths_B`` for the completions) and
    0-dim float64 metrics: ``advantage_mean`` (the mean policy advantage over all tokens,
    ``train/opd_advantage``) and ``teacher_credit_mean`` (the mean credit over the tokens past the
    prefix, before ``kl_penalty_coef``, ``train/opd_teacher_credit``); each is 0 with no token.
    """
    lengths_B = lengths_B.long()
    num_tokens = int(teacher_credit_N.shape[0])
    # Broadcast each completion's group advantage over its tokens.
    reward_N = torch.repeat_interleave(reward_advantages_B.double(), lengths_B)
    starts_B = torch.cumsum(lengths_B, dim=0) - lengths_B
    positions_N = torch.arange(num_tokens, device=lengths_B.device) - torch.repeat_interleave(starts_B, lengths_B)
    counted_N = positions_N >= n_ignore_prefix_tokens
    credit_N = torch.where(counted_N, teacher_credit_N.double(), 0.0)
    token_advantages_N = reward_N + kl_penalty_coef * credit_N
    metrics = {
        "advantage_mean": token_advantages_N.sum() / max(1, num_tokens),
        "teacher_credit_mean": credit_N.sum() / counted_N.sum().clamp_min(1),
    }
    return token_advantages_N, metrics
