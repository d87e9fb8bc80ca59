"""The objective's types: its knobs (``ObjectiveSpec``), one micro-batch's inputs (``LossInputs``),
the step's global divisors (``LossNormalizer``) and the stats every loss returns (``LossStats``).

Shared by the GRPO family (``objectives.py``) and direct on-policy distillation
(``distillation.py``); the trainer builds ``LossInputs`` and merges ``LossStats`` without knowing
which loss runs. Micro-batching contract: every reduction divides by a GLOBAL normaliser, so the
losses of the micro-batches of one optimizer step (on every rank) *sum* to the full-batch loss.

Shapes: ``B`` sequences, ``T`` completion tokens (padded), ``K`` top-k head entries.
"""

# Shape-suffixed field names (logprobs_BT) are the project convention, not mixedCase.

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch
from torch import Tensor

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
    sampler_recorded_B: Tensor | None = None
    """Which rows' ``sampler_logprobs_BT`` were recorded (bool), when the engine recorded them for
    some samples only (``rollout.sampler_logprobs_samples``); the others hold zeros and count in no
    gap. None: every row was recorded. Only the gap may read partial rows (not TIS / MIS)."""
    head_ids_BTK: Tensor | None = None
    """Score centering: the sampler's top-K token ids per generated token (negative id = padding)."""
    head_sampler_logprobs_BTK: Tensor | None = None
    """Score centering: the sampler's logprobs of those ids."""
    head_policy_logprobs_BTK: Tensor | None = None
    """Score centering: the current policy's logprobs of those ids (carries gradient)."""
    token_advantages_BT: Tensor | None = None
    """Per-token advantages (treated as constants); when given they replace ``advantages_B`` (on-policy
    distillation's teacher credit varies along a completion)."""
    teacher_topk_logprobs_BTK: Tensor | None = None
    """Direct distillation: the teacher's logprobs of its top-K ids per generated token (constants)."""
    student_topk_logprobs_BTK: Tensor | None = None
    """Direct distillation: the current policy's logprobs of the same ids (carries gradient)."""


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
