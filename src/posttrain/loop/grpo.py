"""GRPO: one iteration per collected batch.

    prompts -> rollout (group_size samples each) -> rewards -> group advantages
            -> [dynamic sampling: refill until enough informative groups (DAPO)]
            -> policy update (pi_old / ref passes, micro-batches, optimizer) -> weights to rollout
            -> one metrics frame

How a batch is collected is ``loop/collect.py``; the run around it (assembly, checkpoints, the
loop itself) is ``loop/run.py``. Everything that varies between objectives lives in
``posttrain.algorithm`` and is chosen from the config.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.config.schema import GRPOConfig
from posttrain.loop.collect import collect, completion_rows, completions_log, rollout_metrics, to_train_batch
from posttrain.loop.dynamic_sampling import dynamic_sampling_log_line
from posttrain.loop.run import Run, run_loop, start_run
from posttrain.metrics.completions import CompletionsLog
from posttrain.metrics.timers import StepTimer
from posttrain.policy.objective import grpo_objective
from posttrain.policy.trainer import TrainBatch


def grpo_batch(
    cfg: GRPOConfig, run: Run, timer: StepTimer, completions: CompletionsLog | None = None
) -> tuple[TrainBatch, dict[str, float]]:
    """One GRPO collected batch (this rank's cell of it) as the trainer's input, and the rollout
    metrics of the whole batch. The dynamic-sampling metrics are the driver's, already global.
    ``completions``: ``job.log_completions_every``'s log, handed the trained samples."""
    with timer.phase("rollout"):
        collected, sampling_metrics = collect(cfg, run.roles, run.cells)
    if completions is not None:
        completions.record(lambda: completion_rows(collected))
    return to_train_batch(cfg, collected), {
        **rollout_metrics(collected, mask_truncated=cfg.rl.mask_truncated_completions),
        **sampling_metrics,
    }


def train(cfg: GRPOConfig, argv: list[str] | None = None) -> Path:
    """Run GRPO as configured; returns the run directory."""
    run = start_run(cfg, argv or [], grpo_objective(cfg))
    rl = cfg.rl
    headline = (
        f"GRPO ({cfg.algorithm}): {rl.max_steps} steps x {rl.groups_per_step} prompts x {rl.group_size} "
        f"samples, reward={rl.reward}, data={rl.data.kind}, n_mini={rl.n_mini}, lr={rl.optimizer.lr:g}"
    )
    if quota_line := dynamic_sampling_log_line(rl, run.cells.count):
        headline += f"\n{quota_line}"
    completions = completions_log(cfg, run.run_dir, run.trainer, run.log.log_completions)
    return run_loop(run, lambda timer: grpo_batch(cfg, run, timer, completions), headline)
