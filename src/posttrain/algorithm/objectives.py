"""The GRPO objective family as one pure function: per-token surrogate, corrections, KL, reduction.

Variants, each named as in its paper:

* ``clipped`` surrogate, ``token`` importance sampling: GRPO (arXiv 2402.03300, eq. 3), the
  PPO clipped ratio taken per token, with asymmetric bounds ``epsilon_low`` / ``epsilon_high``
  (DAPO "clip-higher", arXiv 2503.14476 §3.1).
* ``clipped`` surrogate, ``sequence`` importance sampling: GSPO (arXiv 2507.18071, eq. 5-7 and the
  GSPO-token form of §4.3), one length-normalised ratio per response, clipped per response.
* ``legacy_pg``: the plain policy gradient ``-A · log pi`` (no ratio, no clip; the on-policy
  special case of GRPO, arXiv 2402.03300 §4.1).
* reductions ``token-mean`` (DAPO token-level loss, arXiv 2503.14476 §3.3), ``seq-mean-token-mean``
  (the GRPO paper's 1/G Σ 1/|o_i| Σ_t, arXiv 2402.03300 eq. 3) and ``seq-mean-token-sum-fixed``
  (Dr-GRPO, arXiv 2503.20783 §3.1: each response's token sum divided by a fixed constant,
  ``rollout.max_tokens``, removing the length bias).
* KL to a frozen reference with the k3 estimator (arXiv 2402.03300 eq. 4), see ``kl.py``;
  train/inference mismatch corrections (TIS / MIS, score centering), see ``corrections.py``.

The pieces live by job: the types (``ObjectiveSpec``, ``LossInputs``, ``LossNormalizer``,
``LossStats``) in ``loss_types.py``, ratios and surrogates in ``surrogates.py``, reductions in
``reductions.py``; this module assembles them into ``policy_loss`` (and re-exports them, so
``posttrain.algorithm.objectives`` stays the one import for the objective).

Micro-batching contract: every reduction divides by a GLOBAL normaliser (``LossNormalizer``), so the
losses of the micro-batches of one optimizer step (on every rank) *sum* to the full-batch loss and
their gradients sum to the full-batch gradient. A sequence must not be split across micro-batches.

Shapes: ``B`` sequences, ``T`` completion tokens (padded), ``K`` score-centering head entries.
"""

# Shape-suffixed field names (logprobs_BT) are the project convention, not mixedCase.

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithm import corrections
from posttrain.algorithm.kl import k3_kl, k3_kl_with_clamped_grad
from posttrain.algorithm.loss_types import (
    Compose,
    ISLevel,
    LossInputs,
    LossNormalizer,
    LossStats,
    LossType,
    ObjectiveSpec,
    Surrogate,
)
from posttrain.algorithm.reductions import REDUCTIONS, masked_max, masked_sum, reduce_loss
from posttrain.algorithm.surrogates import clipped_surrogate, legacy_pg_surrogate, sequence_ratio, token_ratio

__all__ = [
    "REDUCTIONS",
    "Compose",
    "ISLevel",
    "LossInputs",
    "LossNormalizer",
    "LossStats",
    "LossType",
    "ObjectiveSpec",
    "Surrogate",
    "clipped_surrogate",
    "gap_stats",
    "legacy_pg_surrogate",
    "policy_loss",
    "reduce_loss",
    "sequence_ratio",
    "token_ratio",
]


def _check_token_advantages(token_advantages_BT: Tensor | None, shape: tuple[int, ...], spec: ObjectiveSpec) -> None:
    if token_advantages_BT is None:
        return
    if tuple(token_advantages_BT.shape) != shape:
        raise ValueError(f"token_advantages_BT has shape {tuple(token_advantages_BT.shape)}, expected {shape}")
    if spec.importance_sampling_level == "sequence":
        raise ValueError("per-token advantages need importance_sampling_level=token (a sequence ratio has one A)")


def _check_recorded_rows(recorded_B: Tensor | None, shape: tuple[int, ...], spec: ObjectiveSpec) -> None:
    if recorded_B is None:
        return
    if tuple(recorded_B.shape) != shape[:1]:
        raise ValueError(f"sampler_recorded_B has shape {tuple(recorded_B.shape)}, expected ({shape[0]},)")
    if spec.score_centering:
        raise ValueError("score centering weighs every row by its sampler logprobs; some rows were not recorded")


def _check_inputs(inputs: LossInputs, spec: ObjectiveSpec) -> None:
    """Shape and presence checks (static, no device sync)."""
    shape = tuple(inputs.logprobs_BT.shape)
    if len(shape) != 2:
        raise ValueError(f"logprobs_BT must be 2-D (sequences x tokens), got shape {shape}")
    per_token = {
        "old_logprobs_BT": inputs.old_logprobs_BT,
        "mask_BT": inputs.mask_BT,
        "ref_logprobs_BT": inputs.ref_logprobs_BT,
        "sampler_logprobs_BT": inputs.sampler_logprobs_BT,
    }
    for name, t in per_token.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} like logprobs_BT")
    if tuple(inputs.advantages_B.shape) != shape[:1]:
        raise ValueError(f"advantages_B has shape {tuple(inputs.advantages_B.shape)}, expected ({shape[0]},)")
    _check_token_advantages(inputs.token_advantages_BT, shape, spec)
    if spec.kl_beta > 0 and inputs.ref_logprobs_BT is None:
        raise ValueError("rl.kl_beta > 0 needs ref_logprobs_BT (build the reference: rl.ref.build_ref=true)")
    if spec.sc_compose != "none" and inputs.sampler_logprobs_BT is None:
        raise ValueError(f"rl.score_centering.compose={spec.sc_compose!r} needs the rollout's sampler_logprobs_BT")
    _check_recorded_rows(inputs.sampler_recorded_B, shape, spec)
    if spec.score_centering:
        heads = (inputs.head_sampler_logprobs_BTK, inputs.head_policy_logprobs_BTK)
        if heads[0] is None or heads[1] is None:
            raise ValueError(
                "rl.score_centering.enabled=true needs head_sampler_logprobs_BTK and head_policy_logprobs_BTK"
            )
        for name, t in zip(
            ("head_sampler_logprobs_BTK", "head_policy_logprobs_BTK", "head_ids_BTK"),
            (*heads, inputs.head_ids_BTK),
        ):
            if t is not None and (t.dim() != 3 or tuple(t.shape[:2]) != shape):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} + (K,)")


def _masked(x_BT: Tensor, mask_BT: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype`` with the non-loss positions replaced by 0, so no inf / NaN there can
    reach a value or a gradient."""
    x_BT = x_BT.to(dtype)
    return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT))


def _surrogate(
    lp_BT: Tensor, old_BT: Tensor, adv_B: Tensor, mask_BT: Tensor, spec: ObjectiveSpec
) -> tuple[Tensor, Tensor]:
    """Per-token surrogate loss and the clipped-token indicator for the chosen variant."""
    if spec.surrogate == "legacy_pg":
        return legacy_pg_surrogate(lp_BT, adv_B), torch.zeros_like(mask_BT)
    if spec.importance_sampling_level == "sequence":
        ratio_BT = sequence_ratio(lp_BT, old_BT, mask_BT)
    else:
        ratio_BT = token_ratio(lp_BT, old_BT)
    loss_BT, clipped_BT = clipped_surrogate(ratio_BT, adv_B, spec.epsilon_low, spec.epsilon_high)
    return loss_BT, clipped_BT & mask_BT


def _score_centering(
    inputs: LossInputs, lp_BT: Tensor, old_BT: Tensor, mask_BT: Tensor, spec: ObjectiveSpec
) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    """Centred logprobs, the TIS / MIS weight (or None) and the score-centering stats."""
    head_sampler_BTK, head_policy_BTK = inputs.head_sampler_logprobs_BTK, inputs.head_policy_logprobs_BTK
    if head_sampler_BTK is None or head_policy_BTK is None:  # checked in _check_inputs; narrows types
        raise ValueError("score centering needs head_sampler_logprobs_BTK and head_policy_logprobs_BTK")
    # A non-loss token's head is marked invalid, so nothing there reaches a value or a gradient.
    head_sampler_BTK = head_sampler_BTK.masked_fill(~mask_BT[..., None], float("-inf"))
    centred = corrections.center_score(lp_BT, head_sampler_BTK, head_policy_BTK, inputs.head_ids_BTK)
    stats = {
        "sc_tokens": mask_BT.to(lp_BT.dtype).sum(),
        "sc_head_mass_q_sum": masked_sum(centred.head_mass_q_BT, mask_BT),
        "sc_kl_head_sum": masked_sum(centred.kl_head_BT, mask_BT),
    }
    weight_BT: Tensor | None = None
    if inputs.sampler_logprobs_BT is not None:
        rho_BT = corrections.importance_weights(old_BT, _masked(inputs.sampler_logprobs_BT, mask_BT, lp_BT.dtype))
        stats["sc_rho_max"] = masked_max(rho_BT, mask_BT)
        if spec.sc_compose == "tis":
            weight_BT = corrections.tis_weights(rho_BT, spec.is_threshold)
        elif spec.sc_compose == "mis":
            weight_BT = corrections.mis_weights(rho_BT, spec.is_threshold)
            stats["mis_dropped_tokens"] = (mask_BT & (rho_BT > spec.is_threshold)).to(lp_BT.dtype).sum()
    return centred.logprobs_BT, weight_BT, stats


def _kl_term(lp_BT: Tensor, ref_BT: Tensor, spec: ObjectiveSpec) -> Tensor:
    """k3 per token on the raw (never score-centred) logprobs; differentiable only when it is in
    the loss, with the coefficient clamp when ``rl.kl_coeff_clamp`` is set."""
    if spec.kl_beta == 0:
        return k3_kl(lp_BT.detach(), ref_BT)  # monitoring only
    if spec.kl_coeff_clamp is None:
        return k3_kl(lp_BT, ref_BT)
    return k3_kl_with_clamped_grad(lp_BT, ref_BT, spec.kl_coeff_clamp)


def policy_loss(inputs: LossInputs, spec: ObjectiveSpec, norm: LossNormalizer) -> tuple[Tensor, LossStats]:
    """This micro-batch's share of the step loss, and its stats in sum form.

    Per token: ``surrogate_t · w_t + kl_beta · kl_t`` where the surrogate is the clipped GRPO /
    GSPO term or ``legacy_pg`` (computed on the score-centred logprobs when score centering is on),
    ``w_t`` is the TIS / MIS weight (1 without ``sc_compose``; it scales the surrogate only, not
    the KL term), and ``kl_t`` the k3 estimate on the raw logprobs. Under GSPO every token of a
    response carries the response's surrogate value, and ``clipped_tokens`` counts every token of a
    clipped response, so ``train/clip_frac`` is token-weighted at both levels. The per-token
    values are reduced with ``spec.loss_type`` over the GLOBAL ``norm`` (see :func:`reduce_loss`):
    the losses of all micro-batches and ranks sum to the full-batch loss and so do their gradients.
    """
    _check_inputs(inputs, spec)
    mask_BT = inputs.mask_BT > 0
    dtype = torch.promote_types(inputs.logprobs_BT.dtype, torch.float32)
    lp_BT = _masked(inputs.logprobs_BT, mask_BT, dtype)
    old_BT = _masked(inputs.old_logprobs_BT.detach(), mask_BT, dtype)
    # Per-token advantages (OPD credit) replace the per-sequence ones; masked positions hold 0.
    adv_B = inputs.advantages_B.detach().to(dtype)
    if inputs.token_advantages_BT is not None:
        adv_B = _masked(inputs.token_advantages_BT.detach(), mask_BT, dtype)

    score_lp_BT: Tensor = lp_BT
    weight_BT: Tensor | None = None
    sc_stats: dict[str, Tensor] = {}
    if spec.score_centering:
        score_lp_BT, weight_BT, sc_stats = _score_centering(inputs, lp_BT, old_BT, mask_BT, spec)
    per_token_BT, clipped_BT = _surrogate(score_lp_BT, old_BT, adv_B, mask_BT, spec)
    if weight_BT is not None:
        per_token_BT = per_token_BT * weight_BT

    kl_stats: dict[str, Tensor] = {}
    if inputs.ref_logprobs_BT is not None:
        ref_BT = _masked(inputs.ref_logprobs_BT.detach(), mask_BT, dtype)
        kl_BT = _kl_term(lp_BT, ref_BT, spec)
        if spec.kl_beta > 0:
            per_token_BT = per_token_BT + spec.kl_beta * kl_BT
        kl_stats = {
            "kl_sum": masked_sum(kl_BT.detach(), mask_BT),
            "kl_max": masked_max(kl_BT.detach(), mask_BT),
        }

    loss = reduce_loss(per_token_BT, mask_BT, spec.loss_type, norm, max_tokens=spec.max_tokens)
    stats = LossStats(
        loss_sum=loss.detach(),
        loss_tokens=mask_BT.to(dtype).sum(),
        clipped_tokens=clipped_BT.to(dtype).sum(),
        seqs=mask_BT.any(dim=1).to(dtype).sum(),
        **kl_stats,
        **gap_stats(inputs, lp_BT, mask_BT),
        **sc_stats,
    )
    return loss, stats


def gap_stats(inputs: LossInputs, lp_BT: Tensor, mask_BT: Tensor) -> dict[str, Tensor]:
    """``|log pi - log q|`` over the loss tokens: the train/inference gap of the *current* training
    forward against the rollout engine's recorded logprobs (empty when none were recorded), over
    the recorded rows only when ``sampler_recorded_B`` names them."""
    if inputs.sampler_logprobs_BT is None:
        return {}
    if inputs.sampler_recorded_B is not None:
        mask_BT = mask_BT & inputs.sampler_recorded_B[:, None].to(torch.bool)
    gap_BT = (lp_BT.detach() - _masked(inputs.sampler_logprobs_BT.detach(), mask_BT, lp_BT.dtype)).abs()
    return {
        "logprob_gap_abs_sum": masked_sum(gap_BT, mask_BT),
        "logprob_gap_max": masked_max(gap_BT, mask_BT),
        "gap_tokens": mask_BT.to(lp_BT.dtype).sum(),
    }
