"""The trainer's objectives: what each builder asks the trainer to prepare, and which loss it runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from posttrain.algorithm.distillation import direct_distillation_loss
from posttrain.algorithm.objectives import LossInputs, LossNormalizer, policy_loss
from posttrain.config.loading import apply_overrides, build_config, parse_overrides
from posttrain.config.opd import OPDConfig
from posttrain.errors import ConfigError
from posttrain.policy.objective import (
    direct_distillation_objective,
    grpo_objective,
    objective_spec,
    opd_objective,
)

B, T, K = 3, 5, 4


def _opd(*overrides: str) -> OPDConfig:
    cfg = OPDConfig()
    cfg.rl.teacher.name_or_path = "x"
    return apply_overrides(cfg, parse_overrides(overrides)) if overrides else cfg  # type: ignore[return-value]


def _inputs() -> LossInputs:
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(B, T, generator=gen) - 0.1
    mask = torch.ones(B, T)
    mask[1, 3:] = 0.0
    teacher = torch.log_softmax(torch.randn(B, T, K + 1, generator=gen), dim=-1)[..., :K]
    student = torch.log_softmax(torch.randn(B, T, K + 1, generator=gen), dim=-1)[..., :K]
    return LossInputs(
        logprobs_BT=lp.requires_grad_(),
        old_logprobs_BT=lp.detach() + 0.05 * torch.randn(B, T, generator=gen),
        advantages_B=torch.tensor([1.0, -0.5, 0.25]),
        mask_BT=mask,
        sampler_logprobs_BT=lp.detach() - 0.01,
        token_advantages_BT=torch.randn(B, T, generator=gen),
        teacher_topk_logprobs_BTK=teacher,
        student_topk_logprobs_BTK=student.requires_grad_(),
    )


NORM = LossNormalizer(num_tokens=13.0, num_seqs=3.0)


def test_grpo_objective_asks_for_what_its_knobs_need() -> None:
    plain = grpo_objective(build_config(None, []))
    assert (plain.name, plain.uses_old_logprobs, plain.old_logprobs_pass) == ("grpo", True, True)
    assert not (plain.builds_reference or plain.reference_logprobs or plain.sampler_head or plain.teacher_topk)
    assert not plain.plain_path_only and plain.ignore_prefix_tokens == 0
    assert not grpo_objective(build_config(None, ["rl.grpo_surrogate=legacy_pg"])).old_logprobs_pass
    kl = grpo_objective(build_config(None, ["rl.kl_beta=0.1", "rl.ref.build_ref=true", "rl.ref.model_dir=/ckpt"]))
    assert kl.builds_reference and kl.reference_logprobs and kl.reference_dir == "/ckpt"
    built_only = grpo_objective(build_config(None, ["rl.ref.build_ref=true"]))
    assert built_only.builds_reference and not built_only.reference_logprobs
    sc = grpo_objective(build_config(None, ["rl.score_centering.enabled=true"]))
    assert sc.sampler_head and sc.plain_path_only


def test_grpo_objective_runs_policy_loss_of_its_spec() -> None:
    cfg = build_config(None, ["rl.loss_type=seq-mean-token-mean", "rl.epsilon_high=0.01"])
    inputs = dataclasses.replace(_inputs(), token_advantages_BT=None)
    loss, stats = grpo_objective(cfg).loss(inputs, NORM)
    expected, expected_stats = policy_loss(inputs, objective_spec(cfg), NORM)
    assert torch.equal(loss, expected) and stats == expected_stats


def test_advantage_mode_is_the_spec_the_resume_identity_pins() -> None:
    cfg = _opd("rl.distillation_mode=advantage", "rl.jsd_beta=null", "rl.epsilon_low=0.1")
    objective = opd_objective(cfg)
    assert objective.name == "opd-advantage" and objective.old_logprobs_pass and objective.uses_old_logprobs
    assert not (objective.builds_reference or objective.sampler_head or objective.teacher_topk)
    inputs = _inputs()
    loss, stats = objective.loss(inputs, NORM)
    expected, expected_stats = policy_loss(inputs, objective_spec(cfg), NORM)
    assert torch.equal(loss, expected) and stats == expected_stats


def test_direct_mode_runs_direct_distillation_loss() -> None:
    cfg = _opd("rl.jsd_beta=0.5", "rl.n_ignore_prefix_tokens=2", "rl.loss_type=seq-mean-token-sum-fixed")
    objective = opd_objective(cfg)
    assert objective.name == "opd-direct" and objective.teacher_topk and objective.plain_path_only
    assert not objective.uses_old_logprobs and not objective.old_logprobs_pass and not objective.builds_reference
    assert objective.ignore_prefix_tokens == 2
    inputs = _inputs()
    loss, stats = objective.loss(inputs, NORM)
    assert inputs.teacher_topk_logprobs_BTK is not None and inputs.student_topk_logprobs_BTK is not None
    expected, sums = direct_distillation_loss(
        inputs.student_topk_logprobs_BTK,
        inputs.teacher_topk_logprobs_BTK,
        inputs.mask_BT,
        0.5,
        "seq-mean-token-sum-fixed",
        NORM,
        max_tokens=cfg.rollout.max_tokens,
    )
    assert torch.equal(loss, expected)
    assert stats.opd_divergence_sum is not None and torch.equal(stats.opd_divergence_sum, sums["divergence_sum"])
    assert float(stats.loss_tokens) == 13.0 and float(stats.seqs) == 3.0 and float(stats.clipped_tokens) == 0.0
    # the sampler's logprobs sit 0.01 below the current ones at every loss token
    assert stats.gap_tokens is not None and stats.logprob_gap_abs_sum is not None
    assert float(stats.logprob_gap_abs_sum) / float(stats.gap_tokens) == pytest.approx(0.01, abs=1e-6)
    metrics = stats.to_metrics()
    assert float(metrics["train/opd_divergence"]) == pytest.approx(float(sums["divergence_sum"]) / 13.0, rel=1e-6)


def test_direct_mode_needs_a_beta() -> None:
    cfg = _opd("rl.distillation_mode=advantage", "rl.jsd_beta=null")
    with pytest.raises(ConfigError, match=r"rl\.jsd_beta=null"):
        direct_distillation_objective(cfg)
