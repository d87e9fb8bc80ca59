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

Micro-batching contract: every reduction divides by a GLOBAL normaliser (``LossNormalizer``), so the
losses of the micro-batches of one optimizer step (on every rank) *sum* to the full-batch loss and
their gradients sum to the full-batch gradient. A sequence must not be split across micro-batches.

Shapes: ``B`` sequences, ``T`` completion tokens (padded), ``K`` score-centering head entries.
"""

# Shape-suffixed field names (logprobs_BT) are the project convention, not mixedCase.

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch
from torch import Tensor

from posttrain.algorithm import corrections
from posttrain.algorithm.kl import k3_kl, k3_kl_with_clamped_grad

Surrogate = Literal["clipped", "legacy_pg"]
ISLevel = Literal["token", "sequence"]
LossType = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-fixed"]
Compose = Literal["none", "tis", "mis"]


@dataclass(frozen=True)
class ObjectiveSpec:
    """The objective's knobs (``rl.*`` in the config); validated on construction."""

    surrogate: Surrogate = "clipped"
    """``rl.grpo_surrogate``."""
    importance_sampling_level: ISLevel = "token"
    """``rl.importance_sampling_level``; ``sequence`` needs the ``clipped`` surrogate."""
    loss_type: LossType = "token-mean"
    """``rl.loss_type``."""
    epsilon_low: float = 0.2
    """``rl.epsilon_low``: the ratio is clipped below at ``1 - epsilon_low``."""
    epsilon_high: float = 0.2
    """``rl.epsilon_high``: the ratio is clipped above at ``1 + epsilon_high``."""
    kl_beta: float = 0.0
    """``rl.kl_beta``: weight of the k3 KL term (0 disables it)."""
    kl_coeff_clamp: float | None = None
    """``rl.kl_coeff_clamp``: bound (nats) on the KL gradient coefficient; None: exact gradient."""
    max_tokens: int = 1
    """``rollout.max_tokens``: the fixed divisor of ``seq-mean-token-sum-fixed``."""
    score_centering: bool = False
    """``rl.score_centering.enabled``."""
    sc_compose: Compose = "none"
    """``rl.score_centering.compose``: TIS / MIS composed with score centering."""
    is_threshold: float = 2.0
    """``rl.score_centering.is_threshold``: truncation / rejection threshold of the IS weight."""

    def __post_init__(self) -> None:
        problems = _spec_problems(self)
        if problems:
            raise ValueError("invalid objective: " + "; ".join(problems))


def _spec_problems(spec: ObjectiveSpec) -> list[str]:
    """Every inconsistency of ``spec``, each naming the config field and what to change."""
    choices = [
        ("rl.grpo_surrogate", spec.surrogate, get_args(Surrogate)),
        ("rl.importance_sampling_level", spec.importance_sampling_level, get_args(ISLevel)),
        ("rl.loss_type", spec.loss_type, get_args(LossType)),
        ("rl.score_centering.compose", spec.sc_compose, get_args(Compose)),
    ]
    problems = [f"{name}={value!r} is not one of {list(known)}" for name, value, known in choices if value not in known]
    if not 0.0 <= spec.epsilon_low < 1.0:
        problems.append(f"rl.epsilon_low={spec.epsilon_low} must be in [0, 1)")
    if spec.epsilon_high < 0.0:
        problems.append(f"rl.epsilon_high={spec.epsilon_high} must be >= 0")
    if spec.kl_beta < 0.0:
        problems.append(f"rl.kl_beta={spec.kl_beta} must be >= 0")
    if spec.kl_coeff_clamp is not None and spec.kl_coeff_clamp <= 0.0:
        problems.append(f"rl.kl_coeff_clamp={spec.kl_coeff_clamp} must be > 0 (or null for no clamp)")
    if spec.max_tokens < 1:
        problems.append(f"rollout.max_tokens={spec.max_tokens} must be >= 1")
    if spec.is_threshold <= 0.0:
        problems.append(f"rl.score_centering.is_threshold={spec.is_threshold} must be > 0")
    if spec.surrogate == "legacy_pg" and spec.importance_sampling_level == "sequence":
        problems.append(
            "rl.importance_sampling_level='sequence' needs rl.grpo_surrogate=clipped "
            "(legacy_pg has no importance ratio)"
        )
    if spec.sc_compose != "none" and not spec.score_centering:
        problems.append(
            f"rl.score_centering.compose={spec.sc_compose!r} needs rl.score_centering.enabled=true "
            "(or set compose='none')"
        )
    return problems


@dataclass(frozen=True)
class LossNormalizer:
    """Global divisors of one optimizer step (all micro-batches, all ranks).

    A zero count (a step with nothing in the loss) is replaced by 1, so the loss is 0, not NaN.
    """

    num_tokens: Tensor | float
    """Loss tokens (mask entries equal to 1) in the whole step."""
    num_seqs: Tensor | float
    """Sequences with at least one loss token in the whole step (after truncation masking)."""


@dataclass
class LossInputs:
    """One micro-batch. Positions where ``mask_BT`` is 0 may hold anything (even inf / NaN)."""

    logprobs_BT: Tensor
    """Current policy logprobs of the completion tokens (carries gradient)."""
    old_logprobs_BT: Tensor
    """pi_old logprobs (treated as constants)."""
    advantages_B: Tensor
    """One advantage per sequence (treated as constants)."""
    mask_BT: Tensor
    """1 where a completion token counts in the loss, 0 on padding and masked truncated completions."""
    ref_logprobs_BT: Tensor | None = None
    """Frozen reference logprobs; required when ``kl_beta > 0``, used for the KL metrics otherwise."""
    sampler_logprobs_BT: Tensor | None = None
    """Rollout engine logprobs of the sampled tokens, when recorded (logprob gap, TIS / MIS)."""
    head_ids_BTK: Tensor | None = None
    """Score centering: the sampler's top-K token ids per generated token (negative id = padding)."""
    head_sampler_logprobs_BTK: Tensor | None = None
    """Score centering: the sampler's logprobs of those ids."""
    head_policy_logprobs_BTK: Tensor | None = None
    """Score centering: the current policy's logprobs of those ids (carries gradient)."""
    token_advantages_BT: Tensor | None = None
    """Per-token advantages (treated as constants); when given they replace ``advantages_B`` (on-policy
    distillation's teacher credit varies along a completion)."""


# ----------------------------------------------------------------------------------------------
# Stats
# ----------------------------------------------------------------------------------------------


@dataclass
class LossStats:
    """Detached 0-dim tensors in SUM form (or MAX form, see ``MAX_FIELDS``) for one micro-batch.

    Add micro-batches and ranks with :meth:`merge` (across ranks: all-reduce ``SUM`` for every
    field except ``MAX_FIELDS``, which take ``MAX``), then call :meth:`to_metrics` once.
    ``None`` means "does not apply" (e.g. no reference was given). ``loss_tokens`` / ``seqs``
    summed over the step must equal the ``LossNormalizer`` the trainer passed.
    """

    loss_sum: Tensor
    loss_tokens: Tensor
    clipped_tokens: Tensor
    seqs: Tensor
    kl_sum: Tensor | None = None
    kl_max: Tensor | None = None
    logprob_gap_abs_sum: Tensor | None = None
    logprob_gap_max: Tensor | None = None
    gap_tokens: Tensor | None = None
    sc_tokens: Tensor | None = None
    sc_head_mass_q_sum: Tensor | None = None
    sc_kl_head_sum: Tensor | None = None
    sc_rho_max: Tensor | None = None
    mis_dropped_tokens: Tensor | None = None
    opd_divergence_sum: Tensor | None = None

    MAX_FIELDS = frozenset({"kl_max", "logprob_gap_max", "sc_rho_max"})

    def merge(self, other: LossStats) -> LossStats:
        """Field-wise sum (max for ``MAX_FIELDS``); a field absent on one side keeps the other's."""
        merged: dict[str, Tensor | None] = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a is None or b is None:
                merged[f.name] = b if a is None else a
            elif f.name in self.MAX_FIELDS:
                merged[f.name] = torch.maximum(a, b)
            else:
                merged[f.name] = a + b
        return LossStats(**merged)  # type: ignore[arg-type]

    def to_metrics(self) -> dict[str, Tensor]:
        """The spec's metric names, for the fields that apply. Means divide by token counts >= 1."""

        def mean(total: Tensor, count: Tensor) -> Tensor:
            return total / count.clamp_min(1.0)

        # loss_sum is not reported: summed over several optimizer steps (n_mini > 1) it names no
        # one loss; the trainer reports its own per-step average.
        out = {"train/clip_frac": mean(self.clipped_tokens, self.loss_tokens)}
        if self.kl_sum is not None and self.kl_max is not None:
            out["train/kl_mean"] = mean(self.kl_sum, self.loss_tokens)
            out["train/kl_max"] = self.kl_max
        if self.logprob_gap_abs_sum is not None and self.gap_tokens is not None:
            out["train/logprob_gap_mean"] = mean(self.logprob_gap_abs_sum, self.gap_tokens)
        if self.logprob_gap_max is not None:
            out["train/logprob_gap_max"] = self.logprob_gap_max
        if self.sc_tokens is not None:
            if self.sc_head_mass_q_sum is not None:
                out["train/sc_head_mass_q"] = mean(self.sc_head_mass_q_sum, self.sc_tokens)
            if self.sc_kl_head_sum is not None:
                out["train/sc_kl_head"] = mean(self.sc_kl_head_sum, self.sc_tokens)
            if self.mis_dropped_tokens is not None:
                out["train/sc_mis_drop_frac"] = mean(self.mis_dropped_tokens, self.sc_tokens)
        if self.sc_rho_max is not None:
            out["train/sc_rho_max"] = self.sc_rho_max
        if self.opd_divergence_sum is not None:
            out["train/opd_divergence"] = mean(self.opd_divergence_sum, self.loss_tokens)
        return out


def _masked_sum(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum()


def _masked_max(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Max over the masked entries; 0 when there are none (every stat maxed here is >= 0)."""
    if x_BT.numel() == 0:
        return x_BT.new_zeros(())
    return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).amax()


# ----------------------------------------------------------------------------------------------
# Reductions
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Ratios and surrogates
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# The objective
# ----------------------------------------------------------------------------------------------


def _check_token_advantages(token_advantages_BT: Tensor | None, shape: tuple[int, ...], spec: ObjectiveSpec) -> None:
    if token_advantages_BT is None:
        return
    if tuple(token_advantages_BT.shape) != shape:
        raise ValueError(f"token_advantages_BT has shape {tuple(token_advantages_BT.shape)}, expected {shape}")
    if spec.importance_sampling_level == "sequence":
        raise ValueError("per-token advantages need importance_sampling_level=token (a sequence ratio has one A)")


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
        "sc_head_mass_q_sum": _masked_sum(centred.head_mass_q_BT, mask_BT),
        "sc_kl_head_sum": _masked_sum(centred.kl_head_BT, mask_BT),
    }
    weight_BT: Tensor | None = None
    if inputs.sampler_logprobs_BT is not None:
        rho_BT = corrections.importance_weights(old_BT, _masked(inputs.sampler_logprobs_BT, mask_BT, lp_BT.dtype))
        stats["sc_rho_max"] = _masked_max(rho_BT, mask_BT)
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
            "kl_sum": _masked_sum(kl_BT.detach(), mask_BT),
            "kl_max": _masked_max(kl_BT.detach(), mask_BT),
        }

    loss = reduce_loss(per_token_BT, mask_BT, spec.loss_type, norm, max_tokens=spec.max_tokens)
    stats = LossStats(
        loss_sum=loss.detach(),
        loss_tokens=mask_BT.to(dtype).sum(),
        clipped_tokens=clipped_BT.to(dtype).sum(),
        seqs=mask_BT.any(dim=1).to(dtype).sum(),
        **kl_stats,
        **_gap_stats(inputs, lp_BT, mask_BT),
        **sc_stats,
    )
    return loss, stats


def _gap_stats(inputs: LossInputs, lp_BT: Tensor, mask_BT: Tensor) -> dict[str, Tensor]:
    """``|log pi - log q|`` over the loss tokens: the train/inference gap of the *current* training
    forward against the rollout engine's recorded logprobs (empty when none were recorded)."""
    if inputs.sampler_logprobs_BT is None:
        return {}
    gap_BT = (lp_BT.detach() - _masked(inputs.sampler_logprobs_BT.detach(), mask_BT, lp_BT.dtype)).abs()
    return {
        "logprob_gap_abs_sum": _masked_sum(gap_BT, mask_BT),
        "logprob_gap_max": _masked_max(gap_BT, mask_BT),
        "gap_tokens": mask_BT.to(lp_BT.dtype).sum(),
    }
