"""The GRPO preflight: the shared model-free checks plus the rules of GRPO's own knobs (the KL
reference, score centering, the importance-sampling level, the dynamic-sampling quota).

``grpo_preflight(config)`` is what ``posttrain grpo`` (and its ``--validate-manifest``) runs before
any model loads; it returns every problem at once. Nothing here imports torch (a test checks it).
"""

from __future__ import annotations

from posttrain.config.schema import GRPOConfig
from posttrain.preflight.common import (
    check_reduction,
    check_rollout_logprob_modes,
    check_surrogate,
    check_temperature_match,
    run_checks,
)
from posttrain.preflight.findings import Findings
from posttrain.preflight.moe import check_routing_replay
from posttrain.preflight.paths import check_model_path


def check_reference(cfg: GRPOConfig, out: Findings) -> None:
    """The KL term needs a built reference; an anchor needs the reference built and a model there."""
    rl = cfg.rl
    if rl.kl_beta > 0 and not rl.ref.build_ref:
        out.errors.append(f"rl.kl_beta={rl.kl_beta} needs a frozen reference: set rl.ref.build_ref=true")
    if rl.kl_beta > 0 and rl.kl_coeff_clamp is None:
        out.warnings.append(
            f"rl.kl_beta={rl.kl_beta} with rl.kl_coeff_clamp unset: the k3 gradient coefficient is unbounded; "
            "5.0 is recommended"
        )
    if rl.ref.model_dir is not None:
        if not rl.ref.build_ref:
            out.errors.append("rl.ref.model_dir is set but rl.ref.build_ref=false: the reference is never built")
        check_model_path("rl.ref.model_dir", rl.ref.model_dir, out, revision=rl.ref.revision)
    elif rl.ref.revision is not None:
        out.errors.append(f"rl.ref.revision={rl.ref.revision} pins a hub id rl.ref.model_dir, which is not set")


def check_objective(cfg: GRPOConfig, out: Findings) -> None:
    """Rules tying the objective's knobs together: GRPO's own and the shared ones, in one order."""
    rl = cfg.rl
    check_reference(cfg, out)
    check_rollout_logprob_modes(cfg, out, score_centering=rl.score_centering.enabled)
    sc = rl.score_centering
    if sc.compose != "none" and not sc.enabled:
        out.errors.append(
            f"rl.score_centering.compose={sc.compose} needs rl.score_centering.enabled=true "
            "(TIS / MIS are composed with score centering); enable it or set compose=none"
        )
    check_temperature_match(cfg, out)
    if rl.grpo_surrogate == "legacy_pg" and rl.importance_sampling_level == "sequence":
        out.errors.append(
            "rl.importance_sampling_level=sequence needs rl.grpo_surrogate=clipped (legacy_pg has no ratio)"
        )
    check_surrogate(cfg, out)
    check_reduction(cfg, out)
    if cfg.algorithm == "gspo" and rl.importance_sampling_level != "sequence":
        out.warnings.append("algorithm=gspo but rl.importance_sampling_level=token: this runs GRPO, not GSPO")


def check_dynamic_sampling(cfg: GRPOConfig, out: Findings) -> None:
    """The DAPO quota: one spelling at a time, within the batch, and not a quietly tiny floor; and
    groups of one completion, which never carry an advantage."""
    rl = cfg.rl
    if rl.min_informative_groups is not None and rl.min_informative_groups_frac is not None:
        out.errors.append(
            "rl.min_informative_groups and rl.min_informative_groups_frac are both set: keep one "
            "(the fraction ports across batch layouts)"
        )
        return
    quota, groups = rl.effective_min_informative_groups, rl.groups_per_step
    if rl.group_size == 1:
        if quota > 0:
            out.errors.append(
                f"dynamic sampling (a quota of {quota} informative group(s)) with rl.group_size=1: a group of one "
                "completion never has a reward spread, so the quota can never be met; use rl.group_size >= 2"
            )
            return
        out.guard(
            "rl.group_size=1: each group holds one completion, so every group-relative advantage is 0 and only "
            "the KL term (rl.kl_beta) can move the policy; sample at least 2 completions per prompt",
            rl.recipe_guard_severity,
        )
    if quota > groups:
        out.errors.append(
            f"rl.min_informative_groups={quota} exceeds groups_per_step={groups} "
            f"(rl.batch_per_replica // rl.group_size): the quota can never be met"
        )
    literal = rl.min_informative_groups
    if literal and literal < groups / 2:
        out.guard(
            f"rl.min_informative_groups={literal} is below half of groups_per_step={groups} "
            f"({literal / groups:.0%} of the batch); spell the quota as rl.min_informative_groups_frac "
            "if it should scale with the batch",
            rl.recipe_guard_severity,
        )


def grpo_preflight(cfg: GRPOConfig) -> Findings:
    """Every model-free check of a GRPO run, all problems at once."""
    return run_checks(cfg, (check_objective, check_dynamic_sampling, check_routing_replay))
