"""What the trainer optimises: one micro-batch's loss, and what the trainer must prepare for it.

An ``Objective`` is built once, when the run is assembled (``loop/run.py start_run``, from the
recipe), and handed to ``PolicyTrainer``: the trainer runs its ``loss`` on every micro-batch and
reads its flags to decide which passes and tensors to prepare (pi_old, the reference forward, the
sampler's head, the teacher's top-k). Knobs of one algorithm (GRPO's ``rl.kl_beta``,
``rl.grpo_surrogate``, ``rl.score_centering.*``; OPD's ``rl.jsd_beta``, ...) are read here, by
that algorithm's builder, never by the trainer:

* ``grpo_objective``: the GRPO family (``algorithm.objectives.policy_loss`` with the
  ``ObjectiveSpec`` of ``objective_spec``);
* ``advantage_distillation_objective``: OPD advantage mode, the GRPO surrogate (``clipped`` by
  default, token ratio, no KL, no score centering) on the per-token advantages of
  ``algorithm.credit``;
* ``direct_distillation_objective``: OPD direct mode, the generalized JSD to the teacher's
  top-k + residual (``algorithm.distillation.direct_distillation_loss``), no ratio, no pi_old.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from posttrain.algorithm.distillation import direct_distillation_policy_loss
from posttrain.algorithm.loss_types import LossInputs, LossNormalizer, LossStats, ObjectiveSpec
from posttrain.algorithm.objectives import policy_loss
from posttrain.config.opd import OPDConfig
from posttrain.config.schema import GRPOConfig, RunConfig
from posttrain.errors import ConfigError

LossFn = Callable[[LossInputs, LossNormalizer], tuple[Tensor, LossStats]]
"""One micro-batch's share of the step loss (divided by the step's GLOBAL normaliser) and its stats."""


@dataclass(frozen=True)
class Objective:
    """One micro-batch's loss and what the trainer prepares for it."""

    name: str
    """Which objective this is: ``grpo``, ``opd-advantage`` or ``opd-direct``."""
    loss: LossFn
    """``loss(inputs, norm)``: this micro-batch's share of the step loss and its stats."""
    uses_old_logprobs: bool = True
    """The loss reads pi_old (an importance ratio or weight). False: no pi_old exists, not even the
    rollout's logprobs (``rl.use_rollout_logprobs_for_loss``); the current logprobs stand in."""
    old_logprobs_pass: bool = True
    """With several mini-batches (``rl.n_mini > 1``) pi_old is frozen by a pass ahead of the first
    update. False: the current policy stands in (``legacy_pg``: its gradient forms no ratio)."""
    builds_reference: bool = False
    """A frozen reference model is built for the run (``build_reference``)."""
    reference_logprobs: bool = False
    """Every micro-batch runs the reference forward (the KL term is in the loss)."""
    reference_dir: str | None = None
    """Anchor the reference at this checkpoint instead of a copy of the initial policy."""
    sampler_head: bool = False
    """The loss reads the policy's logprobs at the sampler's top-k head (``TrainBatch.sampler_head``)."""
    teacher_topk: bool = False
    """The loss reads the policy's logprobs at the teacher's top-k (``TrainBatch.teacher_topk``)."""
    ignore_prefix_tokens: int = 0
    """The first N completion tokens of every sequence are masked out of the loss."""
    zero_advantage_rows_learn_nothing: bool = False
    """A row whose advantages are all exactly 0 adds exactly 0 to the gradient: the loss's only
    gradient is the advantage-weighted surrogate (no KL term, no divergence). The trainer then runs
    such rows without autograd (``policy/free_rows.py``)."""

    @property
    def plain_path_only(self) -> bool:
        """Logprobs at extra ids (sampler head, teacher top-k) come from the plain path only, so the
        prompt pass is never shared (``model.share_prompt_prefix``)."""
        return self.sampler_head or self.teacher_topk


def objective_spec(cfg: RunConfig) -> ObjectiveSpec:
    """The frozen GRPO-family objective description built from the config (the resume identity
    pins it, ``loop/resume.py``; an OPD config reads its fixed values of GRPO's own knobs)."""
    rl = cfg.rl
    return ObjectiveSpec(
        surrogate=rl.grpo_surrogate,
        importance_sampling_level=rl.importance_sampling_level,
        loss_type=rl.loss_type,
        epsilon_low=rl.epsilon_low,
        epsilon_high=rl.epsilon_high,
        kl_beta=rl.kl_beta,
        kl_coeff_clamp=rl.kl_coeff_clamp,
        max_tokens=cfg.rollout.max_tokens,
        score_centering=rl.score_centering.enabled,
        sc_compose=rl.score_centering.compose,
        is_threshold=rl.score_centering.is_threshold,
    )


def _spec_loss(inputs: LossInputs, norm: LossNormalizer, *, spec: ObjectiveSpec) -> tuple[Tensor, LossStats]:
    return policy_loss(inputs, spec, norm)


def spec_objective(
    spec: ObjectiveSpec, *, name: str = "grpo", build_ref: bool = False, reference_dir: str | None = None
) -> Objective:
    """The GRPO-family objective of ``spec``: the KL term needs the reference forward, score centering
    the sampler's head, the clipped surrogate a frozen pi_old under several mini-batches."""
    return Objective(
        name=name,
        loss=functools.partial(_spec_loss, spec=spec),
        old_logprobs_pass=spec.surrogate == "clipped",
        builds_reference=spec.kl_beta > 0 or build_ref,
        reference_logprobs=spec.kl_beta > 0,
        reference_dir=reference_dir,
        sampler_head=spec.score_centering,
        # the surrogate (clipped, GSPO, legacy; score-centred, TIS / MIS weighted) is A times a
        # finite factor; only the KL term moves a row whose A is 0
        zero_advantage_rows_learn_nothing=spec.kl_beta == 0,
    )


def grpo_objective(cfg: GRPOConfig) -> Objective:
    """GRPO and its variants as configured (``rl.*``; the reference from ``rl.ref``)."""
    return spec_objective(objective_spec(cfg), build_ref=cfg.rl.ref.build_ref, reference_dir=cfg.rl.ref.model_dir)


def advantage_distillation_objective(cfg: OPDConfig) -> Objective:
    """OPD advantage mode: the GRPO surrogate (``rl.grpo_surrogate``, clipped by default) with a
    token-level ratio on per-token advantages (``TrainBatch.token_advantages``); no reference, no KL
    term, no score centering."""
    rl = cfg.rl
    spec = ObjectiveSpec(
        surrogate=rl.grpo_surrogate,
        importance_sampling_level="token",
        loss_type=rl.loss_type,
        epsilon_low=rl.epsilon_low,
        epsilon_high=rl.epsilon_high,
        max_tokens=cfg.rollout.max_tokens,
    )
    return spec_objective(spec, name="opd-advantage")


def direct_distillation_objective(cfg: OPDConfig) -> Objective:
    """OPD direct mode: the generalized JSD (``rl.jsd_beta``) between the teacher's and the student's
    top-k + residual partitions, reduced with ``rl.loss_type``; the trajectory is fixed, so there is
    no importance ratio and no pi_old; ``rl.n_ignore_prefix_tokens`` leave the loss."""
    rl = cfg.rl
    if rl.jsd_beta is None:  # the preflight refuses this first
        raise ConfigError(["rl.jsd_beta=null: direct mode needs a beta in [0, 1] (1 = reverse KL, the usual choice)"])
    loss = functools.partial(
        direct_distillation_policy_loss,
        beta=float(rl.jsd_beta),
        loss_type=rl.loss_type,
        max_tokens=cfg.rollout.max_tokens,
    )
    return Objective(
        name="opd-direct",
        loss=loss,
        uses_old_logprobs=False,
        old_logprobs_pass=False,
        teacher_topk=True,
        ignore_prefix_tokens=rl.n_ignore_prefix_tokens,
    )


def opd_objective(cfg: OPDConfig) -> Objective:
    """The objective of ``rl.distillation_mode``."""
    if cfg.rl.distillation_mode == "direct":
        return direct_distillation_objective(cfg)
    return advantage_distillation_objective(cfg)
