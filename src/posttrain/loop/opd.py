"""The on-policy distillation loop: GRPO's loop with a frozen teacher between rollout and update.

    prompts -> student rollout (group_size samples each) -> rewards, group advantages
            -> teacher scores the realized completions (all-or-nothing, bounded retries)
            -> direct: generalized JSD to the teacher's top-k + residual (DistillationTrainer)
               advantage: clipped surrogate with A(t) = A_reward + kl_penalty_coef * A_teacher(t)
            -> weights to rollout -> one metrics frame

The teacher is frozen and has no weight-sync edge. Everything else (run directory, checkpoints,
resume, signals, metrics) is the GRPO loop's (``loop/grpo.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from posttrain.config.opd import OPDConfig
from posttrain.distributed.world import gathered_metrics
from posttrain.errors import ConfigError
from posttrain.loop.grpo import Collected, Run, draw_cell, rollout_metrics, run_loop, start_run, to_train_batch
from posttrain.metrics.sinks import MetricsLogger
from posttrain.metrics.timers import StepTimer
from posttrain.models.loading import load_model_and_tokenizer, load_tokenizer, resolve_model_path
from posttrain.policy.distill_trainer import DistillationTrainer
from posttrain.policy.trainer import PolicyTrainer, TrainBatch
from posttrain.teacher.base import Teacher
from posttrain.teacher.hf_teacher import HFTeacher
from posttrain.teacher.signals import TeacherSignal, TeacherSignals


def check_shared_vocabulary(cfg: OPDConfig) -> None:
    """A same-vocabulary teacher must tokenize exactly like the student: its top-k ids and its scores
    of the student's ids mean nothing otherwise. Checked before either model loads."""
    if cfg.rl.teacher.input_mode != "shared_vocab" or cfg.rl.teacher.name_or_path is None:
        return
    student = load_tokenizer(resolve_model_path(cfg.model.name_or_path))
    teacher = load_tokenizer(resolve_model_path(cfg.rl.teacher.name_or_path))
    if student.get_vocab() != teacher.get_vocab():
        raise ConfigError(
            [
                f"rl.teacher.input_mode=shared_vocab but the teacher's tokenizer ({len(teacher)} tokens) differs from "
                f"the student's ({len(student)} tokens); use input_mode=cross_token_text with signal_mode=dpca"
            ]
        )


def build_teacher(cfg: OPDConfig, log: MetricsLogger) -> Teacher:
    """The frozen teacher on the configured scoring engine."""
    t = cfg.rl.teacher
    if t.name_or_path is None:  # refused by the preflight; narrows the type
        raise ConfigError(["rl.teacher.name_or_path is required"])
    started = time.perf_counter()
    teacher: Teacher
    if t.backend == "vllm":
        from posttrain.teacher.vllm_teacher import VLLMTeacher

        teacher = VLLMTeacher(
            resolve_model_path(t.name_or_path),
            gpu_memory_utilization=t.gpu_memory_utilization,
            tensor_parallel_size=t.tensor_parallel_size,
            max_model_len=t.max_model_len,
            tokenizer=load_tokenizer(resolve_model_path(t.name_or_path)),
        )
    else:
        model, tokenizer = load_model_and_tokenizer(cfg.model.model_copy(update={"name_or_path": t.name_or_path}))
        teacher = HFTeacher(
            model,
            tokenizer,
            batch_size=t.batch_size,
            chunk_tokens=cfg.model.logprob_chunk_tokens,
            max_model_len=t.max_model_len,
        )
    log.info(
        f"teacher {t.name_or_path} ({t.backend}, {t.input_mode}/{t.signal_mode}) ready in "
        f"{time.perf_counter() - started:.1f}s"
    )
    return teacher


def opd_train_batch(cfg: OPDConfig, collected: Collected, signal: TeacherSignal) -> tuple[TrainBatch, dict[str, float]]:
    """The trainer's batch with the teacher signal attached, and the advantage metrics."""
    batch = to_train_batch(cfg, collected)
    rl = cfg.rl
    if rl.distillation_mode == "direct":
        batch.teacher_topk_ids, batch.teacher_topk_logprobs = signal.topk_ids, signal.topk_logprobs
        return batch, {}
    credit = signal.credit or []
    lengths = [len(c) for c in credit]
    flat_credit = torch.tensor([v for row in credit for v in row], dtype=torch.float64)
    # The group (reward) advantage of each completion, broadcast over its tokens.
    reward_adv = torch.repeat_interleave(batch.advantages_B.double(), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0)
    counted = positions >= rl.n_ignore_prefix_tokens
    flat_credit = torch.where(counted, flat_credit, 0.0)
    final = reward_adv + rl.kl_penalty_coef * flat_credit
    batch.token_advantages = [row.tolist() for row in final.split(lengths)]
    metrics = {
        "train/opd_advantage": float(final.sum()) / max(1, final.numel()),
        "train/opd_teacher_credit": float(flat_credit.sum()) / max(1, int(counted.sum())),
        "train/opd_divergence": 0.0,  # no same-token divergence is formed in advantage mode
    }
    return batch, metrics


def opd_batch(
    cfg: OPDConfig, run: Run, signals: TeacherSignals, timer: StepTimer
) -> tuple[TrainBatch, dict[str, float]]:
    """One OPD collected batch: sample, score with the teacher, attach the signal. With several
    policy ranks each rank samples and its teacher scores that rank's cell; the metrics are merged."""
    with timer.phase("rollout"):
        collected = draw_cell(cfg, run.roles, run.cells)
    with timer.phase("teacher"):
        signal = signals.score(collected.rollout, [p.prompt for p in collected.prompts])
    batch, adv_metrics = opd_train_batch(cfg, collected, signal)
    teacher_metrics = gathered_metrics({**signal.metrics, **adv_metrics})
    return batch, {**rollout_metrics(collected, run.cells), **teacher_metrics}


def train(cfg: OPDConfig, argv: list[str] | None = None) -> Path:
    """Run on-policy distillation as configured; returns the run directory."""
    check_shared_vocabulary(cfg)
    trainer_class: type[PolicyTrainer] = DistillationTrainer if cfg.rl.distillation_mode == "direct" else PolicyTrainer
    run = start_run(cfg, argv or [], trainer_class)
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
    return run_loop(run, lambda timer: opd_batch(cfg, run, signals, timer), headline, close_first=[teacher])


def _output_rows(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])
