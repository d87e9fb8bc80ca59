"""Per-token KL estimate toward the frozen reference: the k3 estimator and its gradient clamp.

The k3 estimator (Schulman, "Approximating KL divergence", 2020; used by GRPO, arXiv 2402.03300
eq. 4) estimates KL(pi_theta || pi_ref) from samples of pi_theta:

    z = log pi_ref(y_t) - log pi_theta(y_t),     kl_t = exp(z) - z - 1   (>= 0, unbiased).

Its gradient with respect to ``log pi_theta`` is the coefficient ``1 - exp(z)``, unbounded as the
policy puts less mass than the reference on a sampled token. One such token can dominate a step's
gradient; ``rl.kl_coeff_clamp`` bounds that coefficient while leaving the value (and the logged
``train/kl_mean`` / ``train/kl_max``) exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""Safety clamp (nats) on ``z`` before ``exp``: keeps the value finite on a token where the two
models disagree wildly (exp(20) ~ 5e8). Beyond it the exact k3 has zero gradient."""


def k3_kl(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """Exact k3 per token, ``exp(z) - z - 1`` with ``z = clamp(ref - logp, ±20)``; differentiable.

    Gradient w.r.t. ``logprobs_BT`` is ``1 - exp(z)`` inside the ±20 nat clamp, 0 beyond it.
    The reference is treated as a constant (it is frozen).
    """
    z_BT = (ref_logprobs_BT.detach() - logprobs_BT).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(z_BT) - z_BT - 1.0


def k3_kl_with_clamped_grad(logprobs_BT: Tensor, ref_logprobs_BT: Tensor, coeff_clamp: float) -> Tensor:
    """k3 with the exact value and a bounded gradient coefficient (``rl.kl_coeff_clamp = c``).

    Value: exactly :func:`k3_kl`. Gradient w.r.t. ``logprobs_BT``: ``1 - exp(clamp(z, -c, c))``, i.e.
    the exact coefficient for ``|z| <= c`` and the boundary slope beyond ``|z| = c``. It therefore
    lies in ``[1 - exp(c), 1 - exp(-c)]``, inside ``[-(exp(c) - 1), exp(c) - 1]``. Built straight-
    through: the exact value (detached) plus ``coeff * (logp - sg[logp])``, which is 0 in value and
    carries the clamped coefficient as gradient. A token beyond the ±20 nat value clamp keeps the
    boundary slope too (the exact form's gradient would vanish there).
    """
    if coeff_clamp <= 0:
        raise ValueError(f"rl.kl_coeff_clamp must be > 0 nats, got {coeff_clamp}")
    value_BT = k3_kl(logprobs_BT.detach(), ref_logprobs_BT)
    z_BT = (ref_logprobs_BT.detach() - logprobs_BT.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    coeff_BT = 1.0 - torch.exp(z_BT.clamp(-coeff_clamp, coeff_clamp))
    return value_BT + coeff_BT * (logprobs_BT - logprobs_BT.detach())
