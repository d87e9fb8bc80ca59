"""Importance ratios and per-token surrogate losses of the GRPO family.

* ``token_ratio``: GRPO's per-token ratio (arXiv 2402.03300 eq. 3);
* ``sequence_ratio``: GSPO's length-normalised sequence ratio in its token-level form
  (arXiv 2507.18071 eq. 5-7 and §4.3);
* ``clipped_surrogate``: the PPO clipped ratio with asymmetric bounds (DAPO "clip-higher",
  arXiv 2503.14476 §3.1);
* ``legacy_pg_surrogate``: the plain policy gradient ``-A · log pi`` (the on-policy special case of
  GRPO, arXiv 2402.03300 §4.1).

Advantages are one per sequence ``[B]`` or one per token ``[B, T]``, always constants.
Shapes: ``B`` sequences, ``T`` completion tokens (padded).
"""

# Shape-suffixed names (logprobs_BT) are the project convention, not mixedCase.

from __future__ import annotations

import torch
from torch import Tensor


def token_ratio(logprobs_BT: Tensor, old_logprobs_BT: Tensor) -> Tensor:
    """GRPO's per-token ratio ``pi(y_t) / pi_old(y_t)`` (arXiv 2402.03300 eq. 3)."""
    return torch.exp(logprobs_BT - old_logprobs_BT.detach())


def sequence_ratio(logprobs_BT: Tensor, old_logprobs_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """GSPO's length-normalised sequence ratio in its token-level form (arXiv 2507.18071 §4.3).

    ``s_i = exp(mean_t over the masked tokens of (logp - old))`` and every token carries
    ``s_i,t = sg[s_i] · pi(y_t) / sg[pi(y_t)]``: value ``s_i`` at every token, gradient
    ``s_i · ∇ log pi(y_t)``. Reduced with ``seq-mean-token-mean`` this is exactly GSPO's gradient
    ``s_i · (1/|y_i|) Σ_t ∇ log pi(y_t)``. A fully masked sequence gets ``s = 1``.
    """
    mask_f_BT = (mask_BT > 0).to(logprobs_BT.dtype)
    tokens_B = mask_f_BT.sum(dim=1).clamp_min(1.0)
    log_s_B = ((logprobs_BT.detach() - old_logprobs_BT.detach()) * mask_f_BT).sum(dim=1) / tokens_B
    return torch.exp(log_s_B)[:, None] * torch.exp(logprobs_BT - logprobs_BT.detach())


def _advantage_columns(advantages: Tensor, dtype: torch.dtype) -> Tensor:
    """Advantages broadcastable against ``[B, T]``: one per sequence ``[B]`` becomes ``[B, 1]``;
    per-token advantages ``[B, T]`` stay as they are. Always treated as constants."""
    adv = advantages.detach().to(dtype)
    return adv[:, None] if adv.dim() == 1 else adv


def clipped_surrogate(
    ratio_BT: Tensor, advantages_B: Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[Tensor, Tensor]:
    """PPO/GRPO clipped per-token loss ``-min(r·A, clip(r, 1-eps_low, 1+eps_high)·A)``.

    ``advantages_B`` is one advantage per sequence, or a ``[B, T]`` tensor of per-token advantages.

    Returns ``(loss_BT, clipped_BT)``. A token is *clipped* when the clipped branch is the one the
    min selects and it differs from the unclipped one: ``A > 0 and r > 1 + eps_high`` or
    ``A < 0 and r < 1 - eps_low``. Exactly these tokens get zero gradient, and at ``r == 1`` (the
    policy has not moved) none is clipped, so ``train/clip_frac`` is exactly 0.
    """
    adv_B1 = _advantage_columns(advantages_B, ratio_BT.dtype)
    unclipped_BT = ratio_BT * adv_B1
    clipped_value_BT = ratio_BT.clamp(min=1.0 - epsilon_low, max=1.0 + epsilon_high) * adv_B1
    r_BT = ratio_BT.detach()
    clipped_BT = ((adv_B1 > 0) & (r_BT > 1.0 + epsilon_high)) | ((adv_B1 < 0) & (r_BT < 1.0 - epsilon_low))
    # `where` on the explicit decision equals the min in value and gives exactly one branch's
    # gradient (torch.minimum would split the gradient on ties).
    return -torch.where(clipped_BT, clipped_value_BT, unclipped_BT), clipped_BT


def legacy_pg_surrogate(logprobs_BT: Tensor, advantages_B: Tensor) -> Tensor:
    """Plain policy gradient ``-A · log pi(y_t)`` (no ratio, no clip); per-sequence or per-token ``A``."""
    return -_advantage_columns(advantages_B, logprobs_BT.dtype) * logprobs_BT
