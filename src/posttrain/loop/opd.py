"""The on-policy distillation loop: GRPO's loop with a frozen teacher between rollout and update.

    prompts -> student rollout (group_size samples each) -> rewards, group advantages
            -> teacher scores the realized completions (all-or-nothing, bounded retries)
            -> direct: generalized JSD to the teacher's top-k + residual (policy/objective.py)
               advantage: clipped surrogate with A(t) = A_reward + kl_penalty_coef * A_teacher(t)
            -> weights to rollout -> one metrics frame

The teacher is frozen and has no weight-sync edge (``teacher/factory.py`` builds it). Batches are
drawn as GRPO draws them without dynamic sampling (``loop/collect.py``); the run around them
(directory, checkpoints, resume, signals, metrics) is ``loop/run.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrain.algorithm.credit import opd_token_advantages
from posttrain.config.opd import OPDConfig
from posttrain.distributed.world import gathered_metrics
from posttrain.loop.collect import (
    Collected,
    completion_rows,
    completions_log,
    draw_cell,
    rollout_metrics,
    to_train_batch,
)
from posttrain.loop.run import Run, run_loop, start_run
from posttrain.metrics.completions import CompletionsLog
from posttrain.metrics.timers import StepTimer
from posttrain.policy.objective import opd_objective
from posttrain.policy.train_batch import TeacherTopK, TokenAdvantages, TrainBatch
from posttrain.preflight.opd import check_shared_vocabulary
from posttrain.teacher.factory import build_teacher
from posttrain.teacher.scoring import TeacherSignal, TeacherSignals


def opd_train_batch(cfg: OPDConfig, collected: Collected, signal: TeacherSignal) -> tuple[TrainBatch, dict[str, float]]:
    """The trainer's batch with the teacher signal attached, and the advantage metrics."""
    batch = to_train_batch(cfg, collected)
    rl = cfg.rl
    if rl.distillation_mode == "direct":
        if signal.topk_ids is not None and signal.topk_logprobs is not None:  # else the trainer says what is missing
            batch.teacher_topk = TeacherTopK(ids=signal.topk_ids, logprobs=signal.topk_logprobs)
        return batch, {}
    credit = signal.credit or []
    lengths = [len(c) for c in credit]
    token_adv_N, means = opd_token_advantages(
        batch.advantages_B,
        torch.tensor([v for row in credit for v in row], dtype=torch.float64),
        torch.tensor(lengths, dtype=torch.long),
        rl.kl_penalty_coef,
        rl.n_ignore_prefix_tokens,
    )
    batch.token_advantages = TokenAdvantages([row.tolist() for row in token_adv_N.split(lengths)])
    metrics = {
        "train/opd_advantage": float(means["advantage_mean"]),
        "train/opd_teacher_credit": float(means["teacher_credit_mean"]),
        "train/opd_divergence": 0.0,  # no same-token divergence is formed in advantage mode
    }
    return batch, metrics


def opd_batch(
    cfg: OPDConfig, run: Run, signals: TeacherSignals, timer: StepTimer, completions: CompletionsLog | None = None
) -> tuple[TrainBatch, dict[str, float]]:
    """One OPD collected batch: sample, score with the teacher, attach the signal. With several
    policy ranks each rank samples and its teacher scores that rank's cell; the metrics are merged.
    ``completions``: ``job.log_completions_every``'s log (the rewards are OPD's diagnostic)."""
    with timer.phase("rollout"):
        collected = draw_cell(cfg, run.roles, run.cells)
    if completions is not None:
        completions.record(lambda: completion_rows(collected))
    with timer.phase("teacher"):
        signal = signals.score(collected.rollout, [p.prompt for p in collected.prompts])
    batch, adv_metrics = opd_train_batch(cfg, collected, signal)
    teacher_metrics = gathered_metrics({**signal.metrics, **adv_metrics})
    return batch, {**rollout_metrics(collected, mask_truncated=cfg.rl.mask_truncated_completions), **teacher_metrics}


def train(cfg: OPDConfig, argv: list[str] | None = None) -> Path:
    """Run on-policy distillation as configured; returns the run directory."""
    check_shared_vocabulary(cfg)
    run = start_run(cfg, argv or [], opd_objective(cfg))
    teacher = build_teacher(cfg, run.log)
    vocab = _output_rows(run.trainer.model)
    signals = TeacherSignals(cfg, teacher, run.tokenizer, vocab)
    rl = cfg.rl
    t = rl.teacher
    objective = f"JSD beta={rl.jsd_beta}" if rl.distillation_mode == "direct" else f"coef={rl.kl_penalty_coef}"
    headline = (
        f"OPD ({rl.distillation_mode}, {t.input_mode}/{t.signal_mode}, {objective}): {rl.max_steps} steps x "
        f"{rl.groups_per_step} prompts x {rl.group_size} samples, teacher={t.name_or_path}, reward={rl.reward}, "
        f"lr={rl.optimizer.lr:g}"
    )
    # The teacher closes first: see close_engines.
    completions = completions_log(cfg, run.run_dir, run.trainer, run.log.log_completions)
    return run_loop(
        run, lambda timer: opd_batch(cfg, run, signals, timer, completions), headline, close_first=[teacher]
    )


def _output_rows(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])
