"""Loss reductions: per-token values to one micro-batch's share of the step loss, over GLOBAL divisors.

* ``token-mean``: the DAPO token-level loss (arXiv 2503.14476 §3.3);
* ``seq-mean-token-mean``: the GRPO paper's ``1/G Σ 1/|o_i| Σ_t`` (arXiv 2402.03300 eq. 3);
* ``seq-mean-token-sum-fixed``: Dr-GRPO (arXiv 2503.20783 §3.1), each response's token sum divided
  by a fixed constant (``rollout.max_tokens``), removing the length bias.

Every reduction divides by the step's ``LossNormalizer`` (all micro-batches, all ranks), so the
micro-batch losses and their gradients sum to the full-batch ones. A sequence must not be split
across micro-batches (its own token count is local). ``masked_sum`` / ``masked_max`` reduce stats.

Shapes: ``B`` sequences, ``T`` completion tokens (padded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.algorithm.loss_types import LossNormalizer


def masked_sum(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Sum over the entries where the boolean ``mask_BT`` is True."""
    return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum()


def masked_max(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Max over the masked entries; 0 when there are none (every stat maxed here is >= 0)."""
    if x_BT.numel() == 0:
        return x_BT.new_zeros(())
    return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).amax()


def _divisor(value: Tensor | float, like: Tensor) -> Tensor:
    t = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    return torch.where(t > 0, t, torch.ones_like(t))


def _token_mean(values_BT: Tensor, mask_BT: Tensor, norm: LossNormalizer, max_tokens: int) -> Tensor:
    return values_BT.sum() / _divisor(norm.num_tokens, values_BT)


def _seq_mean_token_mean(values_BT: Tensor, mask_BT: Tensor, norm: LossNormalizer, max_tokens: int) -> Tensor:
    # The per-sequence token count is local: a sequence lives in one micro-batch.
    tokens_B = mask_BT.to(values_BT.dtype).sum(dim=1).clamp_min(1.0)
    return (values_BT.sum(dim=1) / tokens_B).sum() / _divisor(norm.num_seqs, values_BT)


def _seq_mean_token_sum_fixed(values_BT: Tensor, mask_BT: Tensor, norm: LossNormalizer, max_tokens: int) -> Tensor:
    return (values_BT.sum(dim=1) / float(max_tokens)).sum() / _divisor(norm.num_seqs, values_BT)


_Reduction = Callable[[Tensor, Tensor, LossNormalizer, int], Tensor]
REDUCTIONS: dict[str, _Reduction] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-fixed": _seq_mean_token_sum_fixed,
}


def reduce_loss(
    values_BT: Tensor, mask_BT: Tensor, loss_type: str, norm: LossNormalizer, *, max_tokens: int = 1
) -> Tensor:
    """Reduce per-token values to the micro-batch's share of the step loss.

    ``token-mean``: ``Σ_{i,t} m·v / num_tokens``. ``seq-mean-token-mean``:
    ``Σ_i (Σ_t m·v / Σ_t m) / num_seqs``. ``seq-mean-token-sum-fixed``:
    ``Σ_i (Σ_t m·v / max_tokens) / num_seqs``. A fully masked sequence contributes exactly 0;
    padding columns change nothing.
    """
    if loss_type not in REDUCTIONS:
        raise ValueError(f"rl.loss_type={loss_type!r} is not one of {list(REDUCTIONS)}")
    mask_bool_BT = mask_BT > 0
    masked_BT = torch.where(mask_bool_BT, values_BT, torch.zeros_like(values_BT))
    return REDUCTIONS[loss_type](masked_BT, mask_bool_BT, norm, max_tokens)
