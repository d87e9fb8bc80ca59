"""Train/inference mismatch corrections: truncated / masked importance sampling and score centering.

The rollout engine (q, the "sampler") and the training forward (pi) compute the same policy with
different kernels, so the tokens were drawn from q while the policy gradient assumes pi. Two
families of fixes live here, as pure functions the objective composes:

* **Importance weights** ``rho_t = pi_old(y_t) / q(y_t)`` (detached), either *truncated* (TIS:
  ``min(rho, C)``, the fix proposed by Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training") or *masked* (MIS: a token whose ``rho`` exceeds ``C`` is
  rejected, weight 0; the others keep their weight ``rho``).
* **Score centering under the sampler distribution**: the score ``∇ log pi(y_t)`` has zero mean
  under pi but not under q. Subtracting its expectation under q, estimated on the sampler's top-K
  head renormalised to a distribution ``q̂``, gives the centred score
  ``∇ log pi(y_t) - Σ_k q̂_k ∇ log pi(k)``, which has (head-approximate) zero mean under the
  distribution the tokens actually came from. Only the gradient changes: values, the ratio, the
  clip decision, the KL term and the reduction are untouched.

Shapes: ``B`` sequences, ``T`` completion tokens, ``K`` head entries per token.
"""

# Shape-suffixed field names (logprobs_BT) are the project convention, not mixedCase.

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def importance_weights(old_logprobs_BT: Tensor, sampler_logprobs_BT: Tensor) -> Tensor:
    """``rho = exp(log pi_old - log q)`` per token, detached (a correction factor, never a path
    for gradient). ``pi_old`` is what the surrogate's ratio is taken against, so ``rho`` corrects
    exactly the gap between the distribution the ratio assumes and the one that sampled."""
    return torch.exp(old_logprobs_BT.detach() - sampler_logprobs_BT.detach())


def tis_weights(rho_BT: Tensor, threshold: float) -> Tensor:
    """Truncated importance sampling: ``min(rho, threshold)`` (bias traded for bounded variance)."""
    return rho_BT.detach().clamp(max=threshold)


def mis_weights(rho_BT: Tensor, threshold: float) -> Tensor:
    """Masked importance sampling: ``rho`` where ``rho <= threshold``, else 0.

    Unlike TIS, an outlier token is rejected outright rather than kept at the cap: a token the
    sampler found far less likely than the trainer does is treated as a sampling artefact. The
    accepted tokens keep their importance weight (not 1), so the estimator stays corrected
    on them. A rejected token still counts in the loss normaliser (it is a zero-weight token).
    """
    rho_BT = rho_BT.detach()
    return torch.where(rho_BT <= threshold, rho_BT, torch.zeros_like(rho_BT))


def head_validity(head_sampler_logprobs_BTK: Tensor, head_ids_BTK: Tensor | None = None) -> Tensor:
    """Boolean ``[B, T, K]``: head entries that are real (finite sampler logprob, id >= 0).

    An engine that returns fewer than K entries for a token pads the rest; padding is recognised
    by a negative id or a non-finite logprob.
    """
    valid_BTK = torch.isfinite(head_sampler_logprobs_BTK)
    if head_ids_BTK is not None:
        valid_BTK = valid_BTK & (head_ids_BTK >= 0)
    return valid_BTK


def _masked_log_softmax(logits_BTK: Tensor, valid_BTK: Tensor) -> Tensor:
    """log_softmax over the valid entries only. Invalid entries get a meaningless finite value the
    callers discard through ``valid_BTK``; a row with no valid entry stays finite (never NaN)."""
    neg_inf = torch.finfo(logits_BTK.dtype).min
    safe_BTK = torch.where(valid_BTK, logits_BTK, torch.full_like(logits_BTK, neg_inf))
    return torch.log_softmax(safe_BTK, dim=-1)


@dataclass(frozen=True)
class CenteredScore:
    """Result of :func:`center_score`."""

    logprobs_BT: Tensor
    """Same values as the input logprobs; gradient is the centred score."""
    head_mass_q_BT: Tensor
    """Total sampler probability of the head, ``Σ_k exp(head_sampler_logprobs)`` (detached)."""
    kl_head_BT: Tensor
    """``KL(q̂ || p̂)`` over the head, both renormalised over the head (detached)."""


def center_score(
    logprobs_BT: Tensor,
    head_sampler_logprobs_BTK: Tensor,
    head_policy_logprobs_BTK: Tensor,
    head_ids_BTK: Tensor | None = None,
) -> CenteredScore:
    """Score centering under the sampler distribution.

    ``q̂ = softmax_k(head_sampler_logprobs)`` over the valid head entries (detached). The expected
    score is ``c_t = Σ_k q̂_k · head_policy_logprobs_t,k``; the returned logprobs are
    ``logprobs - (c - sg[c])``: the value is unchanged, the gradient becomes
    ``∇ log pi(y_t) - Σ_k q̂_k ∇ log pi(k)``. ``head_policy_logprobs_BTK`` are the *current*
    policy's logprobs at the head ids and must carry gradient. A token whose head has no valid
    entry is left uncentred.
    """
    valid_BTK = head_validity(head_sampler_logprobs_BTK, head_ids_BTK)
    dtype = logprobs_BT.dtype
    hs_BTK = head_sampler_logprobs_BTK.detach().to(dtype)
    hp_BTK = head_policy_logprobs_BTK.to(dtype)
    zero_BTK = torch.zeros_like(hs_BTK)

    logq_BTK = _masked_log_softmax(hs_BTK, valid_BTK)
    qhat_BTK = torch.where(valid_BTK, logq_BTK.exp(), zero_BTK)
    # Zero the invalid policy entries before multiplying: 0 * (-inf) would be NaN.
    hp_safe_BTK = torch.where(valid_BTK, hp_BTK, zero_BTK)
    expected_BT = (qhat_BTK * hp_safe_BTK).sum(dim=-1)
    centred_BT = logprobs_BT - (expected_BT - expected_BT.detach())

    with torch.no_grad():
        head_mass_BT = torch.where(valid_BTK, hs_BTK.exp(), zero_BTK).sum(dim=-1)
        logp_BTK = _masked_log_softmax(hp_BTK.detach(), valid_BTK)
        kl_terms_BTK = torch.where(valid_BTK, qhat_BTK * (logq_BTK - logp_BTK), zero_BTK)
        kl_head_BT = kl_terms_BTK.sum(dim=-1)
    return CenteredScore(logprobs_BT=centred_BT, head_mass_q_BT=head_mass_BT, kl_head_BT=kl_head_BT)
