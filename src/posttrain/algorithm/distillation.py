"""Same-token direct on-policy distillation: the teacher's top-k support plus residual, and the generalized JSD.

On-policy distillation (Agarwal et al., "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD), arXiv 2306.13649; Gu et al., MiniLLM, arXiv 2306.08543) trains the
student on its own samples to match a frozen teacher token by token. When both share a vocabulary
the teacher returns, at every scored position, its top-K token ids and their full-vocabulary
logprobs. The teacher's distribution is then known exactly on those K ids and only in total on the
rest, so both models are compared on the same **(K+1)-way partition** of the vocabulary: the K
support ids, plus one "everything else" category holding the residual mass ``1 - Σ_k p_k``.
The student's side uses its full-vocabulary logprobs at the teacher's ids, so its residual is the
mass it puts outside the teacher's support, and the gradient of the residual term pushes that
mass in the right direction too.

The per-position divergence is the generalized Jensen-Shannon divergence of GKD (arXiv 2306.13649
§3) with mixture ``M = β·P_T + (1-β)·P_S``; see :func:`generalized_jsd` for the beta limits
(β = 0 forward KL, β = 1 reverse KL, the usual on-policy distillation choice). The trainer reduces
the per-token values with :func:`posttrain.algorithm.objectives.reduce_loss`, so the micro-batch
and rank normalisation of the GRPO objectives applies unchanged; :func:`direct_distillation_policy_loss`
is the form the trainer calls (``LossInputs`` in, ``LossStats`` out, like ``policy_loss``).

Pure tensor math: no I/O, no process groups; the one host sync is in the payload validation
(once per batch, before training).

Shapes: ``B`` sequences, ``T`` completion tokens, ``K`` teacher top-k entries, ``C`` categories
(``K + 1`` here), ``N`` positions (one or several leading dims).
"""

# Shape-suffixed names (logprobs_BTK) are the project convention, not mixedCase.

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.algorithm.loss_types import LossInputs, LossNormalizer, LossStats
from posttrain.algorithm.objectives import gap_stats
from posttrain.algorithm.reductions import reduce_loss
from posttrain.errors import PosttrainError

RESIDUAL_FLOOR = 1e-6
"""Smallest residual mass of a partition. A float32 sum of K probabilities carries rounding error
of about 1e-7 to 1e-6, so a smaller residual is indistinguishable from zero; flooring it keeps
``log`` finite for an exactly full (or, within tolerance, over-full) support. Below the floor the
residual carries no gradient; the renormalisation after flooring still moves the support entries."""

DEFAULT_MASS_TOLERANCE = 1e-4
"""Support mass up to ``1 + tolerance`` is accepted as rounding (bf16/fp32 teachers); beyond, the
payload is malformed."""


class TeacherPayloadError(PosttrainError):
    """The teacher's scoring result is malformed (the message names the first bad position)."""


# ----------------------------------------------------------------------------------------------
# Payload validation
# ----------------------------------------------------------------------------------------------


def _row_problems(ids_NK: Tensor, logprobs_NK: Tensor, vocab_size: int, mass_tolerance: float) -> dict[str, Tensor]:
    """One boolean ``[N]`` per kind of problem (True: the position has it)."""
    sorted_NK = ids_NK.sort(dim=-1).values
    finite_NK = torch.isfinite(logprobs_NK)
    lp64_NK = torch.where(finite_NK, logprobs_NK.double(), torch.full_like(logprobs_NK, -math.inf, dtype=torch.float64))
    return {
        "duplicate ids": (sorted_NK[..., 1:] == sorted_NK[..., :-1]).any(dim=-1),
        f"ids outside [0, {vocab_size})": ((ids_NK < 0) | (ids_NK >= vocab_size)).any(dim=-1),
        "non-finite logprobs": (~finite_NK).any(dim=-1),
        f"support mass above 1 + {mass_tolerance:g}": torch.logsumexp(lp64_NK, dim=-1) > math.log1p(mass_tolerance),
    }


def validate_teacher_topk(
    ids_NK: Tensor,
    logprobs_NK: Tensor,
    vocab_size: int,
    *,
    valid_N: Tensor | None = None,
    mass_tolerance: float = DEFAULT_MASS_TOLERANCE,
) -> None:
    """Reject a malformed teacher top-k payload; positions where ``valid_N`` is False are ignored.

    ``ids_NK`` / ``logprobs_NK``: ``[..., K]`` (any leading shape, e.g. ``[B, T, K]``), the teacher's
    top-K ids and full-vocabulary logprobs per scored position; ``valid_N`` has the leading shape
    (padding may hold anything). Raises :class:`TeacherPayloadError` naming the first bad position,
    every problem it has and its entries, when a valid position has duplicate ids, an id outside
    ``[0, vocab_size)``, a non-finite logprob (NaN, ±inf), or support mass
    ``Σ exp(logprobs) > 1 + mass_tolerance``.

    ``-inf`` (zero teacher mass) is rejected too, as the spec asks of every non-finite value: a
    top-K entry of a softmax over finite logits is never exactly zero, and a zero-mass teacher
    category would make the reverse KL (``jsd_beta=1``) infinite wherever the student has mass.
    One host sync (``any``) on success; the error path syncs freely.
    """
    if ids_NK.shape != logprobs_NK.shape or ids_NK.dim() < 1:
        raise TeacherPayloadError(
            f"teacher top-k ids have shape {tuple(ids_NK.shape)} and logprobs {tuple(logprobs_NK.shape)}; "
            "expected the same shape [..., K]"
        )
    if ids_NK.is_floating_point() or ids_NK.is_complex():
        raise TeacherPayloadError(f"teacher top-k ids must be integers, got dtype {ids_NK.dtype}")
    if valid_N is not None and tuple(valid_N.shape) != tuple(ids_NK.shape[:-1]):
        raise TeacherPayloadError(
            f"valid_N has shape {tuple(valid_N.shape)}, expected the payload's leading shape {tuple(ids_NK.shape[:-1])}"
        )
    problems = _row_problems(ids_NK, logprobs_NK, vocab_size, mass_tolerance)
    bad_N = torch.stack(list(problems.values())).any(dim=0)
    if valid_N is not None:
        bad_N = bad_N & (valid_N > 0)
    if not bool(bad_N.any()):  # the one sync of the success path
        return
    bad_positions = torch.nonzero(bad_N)
    first = tuple(int(i) for i in bad_positions[0].tolist())
    what = [name for name, flags_N in problems.items() if bool(flags_N[first])]
    ids_K, logprobs_K = ids_NK[first].tolist(), logprobs_NK[first].double()
    mass = float(torch.exp(logprobs_K[torch.isfinite(logprobs_K)]).sum())
    where = first[0] if len(first) == 1 else first
    raise TeacherPayloadError(
        f"teacher top-k payload is invalid at position {where} (first of {bad_positions.shape[0]} bad "
        f"position(s)): {'; '.join(what)}. ids={ids_K}, logprobs={logprobs_K.tolist()}, "
        f"finite support mass={mass:.6g}. The teacher must return K distinct in-vocabulary ids with finite "
        "full-vocabulary logprobs per scored position."
    )


# ----------------------------------------------------------------------------------------------
# The (K+1)-way partition and the generalized JSD
# ----------------------------------------------------------------------------------------------


def topk_partition_logprobs(support_logprobs_NK: Tensor, *, residual_floor: float = RESIDUAL_FLOOR) -> Tensor:
    """The ``(K+1)``-way categorical in log space: the K support logprobs, then ``log(1 - Σ_k p_k)``.

    The residual is ``log(-expm1(logsumexp(support)))``, exact even when the support holds almost
    all the mass. It is floored at ``residual_floor`` (see :data:`RESIDUAL_FLOOR`), and then the
    K+1 entries are renormalised to sum to one: for a well-formed row (support mass below
    ``1 - residual_floor``) the renormalisation changes nothing, in value or gradient; an exactly
    full or slightly over-full row becomes a proper distribution with residual ≈ ``residual_floor``.
    Differentiable: use it on the student's logprobs at the teacher's ids (from the student's full
    softmax) as well as on the teacher's constants. A row needs at least one finite entry.
    Computed (and returned) in at least float32: a bf16 residual would be mostly rounding.
    """
    if not 0.0 < residual_floor < 1.0:
        raise ValueError(f"residual_floor must be in (0, 1), got {residual_floor}")
    support_logprobs_NK = support_logprobs_NK.to(torch.promote_types(support_logprobs_NK.dtype, torch.float32))
    support_mass_log_N1 = torch.logsumexp(support_logprobs_NK, dim=-1, keepdim=True)
    # Clamping the log-mass (not the residual) keeps expm1 away from >= 0 and makes the floored
    # residual exactly residual_floor, with zero gradient there.
    capped_N1 = support_mass_log_N1.clamp(max=math.log1p(-residual_floor))
    residual_log_N1 = torch.log(-torch.expm1(capped_N1))
    partition_NC = torch.cat([support_logprobs_NK, residual_log_N1], dim=-1)
    return partition_NC - torch.logsumexp(partition_NC, dim=-1, keepdim=True)


def _kl(logp_NC: Tensor, logq_NC: Tensor) -> Tensor:
    """``KL(P || Q) = Σ_c p_c (log p_c - log q_c)`` with ``0 · log 0 = 0`` (xlogy semantics).

    A category with ``p_c = 0`` (``-inf`` or underflow) contributes exactly 0 and passes a zero
    (never NaN) gradient to both sides. ``q_c = 0`` where ``p_c > 0`` gives the true value, +inf.
    """
    zero_NC = torch.exp(logp_NC) == 0
    safe_logp_NC = torch.where(zero_NC, torch.zeros_like(logp_NC), logp_NC)
    safe_logq_NC = torch.where(zero_NC, torch.zeros_like(logq_NC), logq_NC)
    terms_NC = torch.exp(safe_logp_NC) * (safe_logp_NC - safe_logq_NC)
    return torch.where(zero_NC, torch.zeros_like(terms_NC), terms_NC).sum(dim=-1)


def _log_mixture(teacher_logp_NC: Tensor, student_logp_NC: Tensor, beta: float) -> Tensor:
    """``log(β·P_T + (1-β)·P_S)``; where both are zero the value is a finite dummy (no category
    with zero mass on both sides is ever read, see :func:`_kl`), so no NaN gradient appears."""
    both_zero_NC = torch.isneginf(teacher_logp_NC) & torch.isneginf(student_logp_NC)
    t_NC = torch.where(both_zero_NC, torch.zeros_like(teacher_logp_NC), teacher_logp_NC)
    s_NC = torch.where(both_zero_NC, torch.zeros_like(student_logp_NC), student_logp_NC)
    return torch.logaddexp(t_NC + math.log(beta), s_NC + math.log1p(-beta))


def generalized_jsd(teacher_logp_NC: Tensor, student_logp_NC: Tensor, beta: float) -> Tensor:
    """Generalized JSD per position, over the last dim (C categories), in nats: ``[...]``.

    For ``0 < β < 1``: ``JSD_β = β·KL(P_T || M) + (1-β)·KL(P_S || M)`` with ``M = β·P_T + (1-β)·P_S``.

    The beta limits: with this mixture weighting ``JSD_β / β → KL(P_T || P_S)`` as ``β → 0`` (M
    tends to P_S, so the first term is ``β·KL(T||S) + O(β²)`` while ``KL(P_S || M)`` is second order
    in ``β``), and ``JSD_β / (1-β) → KL(P_S || P_T)`` as ``β → 1``. The endpoints are defined as
    these limits: ``β = 0`` returns forward KL(P_T || P_S) (mode covering) and ``β = 1`` reverse
    KL(P_S || P_T) (mode seeking, the usual on-policy distillation choice). ``JSD_β`` itself tends
    to 0 at both ends, so interior values near an endpoint are about ``β`` (or ``1-β``) times the
    endpoint KL: the scale is not continuous at 0 and 1. The opposite weighting
    (``M = (1-β)·P_T + β·P_S``) would give ``JSD_β / β → ∞`` as ``β → 0`` and is not used.
    Symmetry: ``JSD_β(T, S) = JSD_{1-β}(S, T)``.

    Zero-mass categories contribute 0 with finite gradients. Both inputs are log-probabilities
    over the same C categories (e.g. from :func:`topk_partition_logprobs`); the teacher is
    detached, the gradient flows to the student only. Computed in at least float32.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"rl.jsd_beta={beta} must be in [0, 1]")
    dtype = torch.promote_types(student_logp_NC.dtype, torch.float32)
    t_NC = teacher_logp_NC.detach().to(dtype)
    s_NC = student_logp_NC.to(dtype)
    if beta == 0.0:
        return _kl(t_NC, s_NC)
    if beta == 1.0:
        return _kl(s_NC, t_NC)
    log_m_NC = _log_mixture(t_NC, s_NC, beta)
    return beta * _kl(t_NC, log_m_NC) + (1.0 - beta) * _kl(s_NC, log_m_NC)


# ----------------------------------------------------------------------------------------------
# Direct OPD loss
# ----------------------------------------------------------------------------------------------


def _masked_partitions(
    student_topk_logprobs_BTK: Tensor, teacher_topk_logprobs_BTK: Tensor, mask_BT: Tensor, residual_floor: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Student and teacher partitions ``[B, T, K+1]`` with padding replaced by a harmless uniform
    row (so no garbage there reaches a value or a gradient), and the boolean mask."""
    shape = tuple(student_topk_logprobs_BTK.shape)
    if len(shape) != 3 or tuple(teacher_topk_logprobs_BTK.shape) != shape or tuple(mask_BT.shape) != shape[:2]:
        raise ValueError(
            f"student top-k logprobs {shape}, teacher {tuple(teacher_topk_logprobs_BTK.shape)} and mask "
            f"{tuple(mask_BT.shape)} must be [B, T, K], [B, T, K] and [B, T]"
        )
    mask_BT = mask_BT > 0
    dtype = torch.promote_types(student_topk_logprobs_BTK.dtype, torch.float32)
    uniform = -math.log(shape[2] + 1)  # K entries of 1/(K+1) leave a residual of 1/(K+1): a valid row
    keep_BT1 = mask_BT[..., None]
    student_BTK = torch.where(keep_BT1, student_topk_logprobs_BTK.to(dtype), uniform)
    teacher_BTK = torch.where(keep_BT1, teacher_topk_logprobs_BTK.detach().to(dtype), uniform)
    return (
        topk_partition_logprobs(student_BTK, residual_floor=residual_floor),
        topk_partition_logprobs(teacher_BTK, residual_floor=residual_floor),
        mask_BT,
    )


def direct_opd_loss(
    student_topk_logprobs_BTK: Tensor,
    teacher_topk_logprobs_BTK: Tensor,
    mask_BT: Tensor,
    beta: float,
    *,
    residual_floor: float = RESIDUAL_FLOOR,
) -> Tensor:
    """Per-token divergence ``div_BT``: :func:`generalized_jsd` between the teacher's and the
    student's (K+1)-way partitions; exactly 0 where ``mask_BT`` is 0.

    ``student_topk_logprobs_BTK``: the student's full-vocabulary logprobs gathered at the teacher's
    top-K ids (carries gradient); ``teacher_topk_logprobs_BTK``: the teacher's logprobs of those ids
    (constants; validate them first with :func:`validate_teacher_topk`). Masked positions may hold
    anything (NaN, ±inf): nothing there reaches the value or the gradient. Reduce the result with
    :func:`posttrain.algorithm.objectives.reduce_loss` (or use :func:`direct_distillation_loss`).
    """
    student_BTC, teacher_BTC, keep_BT = _masked_partitions(
        student_topk_logprobs_BTK, teacher_topk_logprobs_BTK, mask_BT, residual_floor
    )
    div_BT = generalized_jsd(teacher_BTC, student_BTC, beta)
    return torch.where(keep_BT, div_BT, torch.zeros_like(div_BT))


def direct_distillation_loss(  # noqa: PLR0917 (the trainer's documented positional order)
    student_topk_logprobs_BTK: Tensor,
    teacher_topk_logprobs_BTK: Tensor,
    mask_BT: Tensor,
    beta: float,
    loss_type: str,
    norm: LossNormalizer,
    *,
    max_tokens: int = 1,
    residual_floor: float = RESIDUAL_FLOOR,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the direct OPD step loss, and detached stats in SUM form.

    The per-token divergence of :func:`direct_opd_loss`, reduced by ``loss_type`` over the GLOBAL
    ``norm`` exactly like the GRPO objectives (micro-batch losses and gradients sum to the step's).
    No importance ratio: the divergence is taken on the realized trajectory, so the rollout's
    sampling controls only choose the data. Stats (0-dim, add them over micro-batches and ranks):
    ``loss_sum`` (this share of the loss), ``divergence_sum`` (Σ over loss tokens), ``tokens``,
    ``seqs`` (sequences with a loss token), ``teacher_residual_mass_sum`` and
    ``student_residual_mass_sum`` (Σ of the residual mass; its mean says how much of each model's
    mass lies outside the teacher's top-K). ``train/opd_divergence`` = divergence_sum / tokens.
    """
    student_BTC, teacher_BTC, keep_BT = _masked_partitions(
        student_topk_logprobs_BTK, teacher_topk_logprobs_BTK, mask_BT, residual_floor
    )
    div_BT = generalized_jsd(teacher_BTC, student_BTC, beta)
    div_BT = torch.where(keep_BT, div_BT, torch.zeros_like(div_BT))
    loss = reduce_loss(div_BT, keep_BT, loss_type, norm, max_tokens=max_tokens)
    zeros_BT = torch.zeros_like(div_BT)
    stats = {
        "loss_sum": loss.detach(),
        "divergence_sum": div_BT.detach().sum(),
        "tokens": keep_BT.to(div_BT.dtype).sum(),
        "seqs": keep_BT.any(dim=1).to(div_BT.dtype).sum(),
        "teacher_residual_mass_sum": torch.where(keep_BT, teacher_BTC[..., -1].exp(), zeros_BT).sum(),
        "student_residual_mass_sum": torch.where(keep_BT, student_BTC[..., -1].detach().exp(), zeros_BT).sum(),
    }
    return loss, stats


def direct_distillation_policy_loss(
    inputs: LossInputs, norm: LossNormalizer, *, beta: float, loss_type: str, max_tokens: int = 1
) -> tuple[Tensor, LossStats]:
    """Direct OPD in the trainer's form: one micro-batch's ``LossInputs`` in, its share of the step
    loss and its ``LossStats`` out (the counterpart of ``objectives.policy_loss``).

    The loss is :func:`direct_distillation_loss` of the inputs' student and teacher top-k views over
    ``mask_BT`` (the trainer has already masked ``rl.n_ignore_prefix_tokens``). Stats: its loss,
    token, sequence and divergence sums (``train/opd_divergence``), zero clipped tokens (no ratio),
    and the train/inference logprob gap when the rollout recorded sampler logprobs.
    """
    teacher_BTK, student_BTK = inputs.teacher_topk_logprobs_BTK, inputs.student_topk_logprobs_BTK
    if teacher_BTK is None or student_BTK is None:
        raise ValueError("direct distillation needs teacher_topk_logprobs_BTK and student_topk_logprobs_BTK")
    mask_BT = inputs.mask_BT > 0
    loss, sums = direct_distillation_loss(
        student_BTK, teacher_BTK, mask_BT, beta, loss_type, norm, max_tokens=max_tokens
    )
    lp_BT = inputs.logprobs_BT.to(torch.promote_types(inputs.logprobs_BT.dtype, torch.float32))
    stats = LossStats(
        loss_sum=sums["loss_sum"],
        loss_tokens=sums["tokens"],
        clipped_tokens=torch.zeros_like(sums["tokens"]),
        seqs=sums["seqs"],
        opd_divergence_sum=sums["divergence_sum"],
        **gap_stats(inputs, lp_BT, mask_BT),
    )
    return loss, stats
