"""The GRPO loop: one iteration per collected batch.

    prompts -> rollout (group_size samples each) -> rewards -> group advantages
            -> policy update (pi_old / ref passes, micro-batches, optimizer) -> weights to rollout
            -> one metrics frame

Everything that varies between objectives lives in ``posttrain.algorithm`` and is chosen from the
config; the loop itself reads like the algorithm.

Several policy ranks (torchrun, ``grid.shapes.policy=[1,N]``) run this same loop, one data cell each
(``posttrain.distributed``): every rank draws the same prompts and samples and scores only its cell's whole
groups, trains its cell with the FSDP2-sharded policy, and refreshes its own rollout engine from the
gathered weights; rank 0 alone writes the run directory.
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from posttrain.algorithm.advantages import group_advantages, group_reward_spread, informative_groups
from posttrain.checkpoint.provenance import collect_provenance, write_provenance
from posttrain.checkpoint.rng import capture_rng, restore_rng
from posttrain.checkpoint.signals import GracefulStop
from posttrain.checkpoint.store import (
    CheckpointWriter,
    TrainingState,
    check_resume_compatible,
    load_checkpoint,
    read_training_state,
    resolve_resume,
    resume_identity,
)
from posttrain.config.schema import GRPOConfig
from posttrain.data.base import DataSource, PromptSample
from posttrain.data.build import build_data_source
from posttrain.distributed.cells import Cells
from posttrain.distributed.process_group import join_policy_world, leave_policy_world
from posttrain.loop.dynamic_sampling import DrawFn, ScoredGroup, collect_dynamic_for, dynamic_sampling_log_line
from posttrain.loop.pipeline import batch_source
from posttrain.loop.run_dir import create_run_dir, job_dir, write_resolved_config
from posttrain.metrics.sinks import MetricsLogger, OffRankLogger
from posttrain.metrics.timers import StepTimer, peak_memory_frame
from posttrain.models.chat import render_prompt_ids
from posttrain.models.loading import load_model_and_tokenizer, resolve_model_path
from posttrain.policy.trainer import PolicyTrainer, TrainBatch, build_reference
from posttrain.rewards.base import Reward, RewardInput
from posttrain.rewards.registry import get_reward, score_completions
from posttrain.rollout.base import Completion, ResumableEngine, RolloutBatch, RolloutEngine, SamplingParams
from posttrain.rollout.hf_engine import HFRolloutEngine


@dataclass
class Collected:
    """One collected batch: prompts, their rollouts, rewards and advantages."""

    prompts: list[PromptSample]
    rollout: RolloutBatch
    rewards_NG: torch.Tensor
    advantages_NG: torch.Tensor


@dataclass
class Roles:
    """What collecting a batch needs: the prompt source, the rollout engine, the reward, the tokenizer."""

    data: DataSource
    engine: RolloutEngine
    reward: Reward
    tokenizer: Any


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch RNGs (sampling has its own generator in the engine)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def sampling_params(cfg: GRPOConfig, cell: int = 0) -> SamplingParams:
    """The rollout section as engine sampling controls; score centering asks for the sampler's
    top-k head per generated token. Data cell ``c`` samples with ``rollout.seed + c``, so the cells'
    engines draw independent streams (cell 0, and a single process, use the seed itself)."""
    ro, sc = cfg.rollout, cfg.rl.score_centering
    return SamplingParams(
        max_tokens=ro.max_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        repetition_penalty=ro.repetition_penalty,
        seed=None if ro.seed is None else ro.seed + cell,
        sampler_logprobs_every=ro.sampler_logprobs_every,
        logprobs_topk=sc.top_k if sc.enabled else 0,
    )


def draw_groups(cfg: GRPOConfig, roles: Roles, num_prompts: int) -> Collected:
    """Draw prompts, sample ``group_size`` completions each, score them, compute advantages."""
    return sample_and_score(cfg, roles, roles.data.next_batch(num_prompts))


def sample_and_score(cfg: GRPOConfig, roles: Roles, prompts: list[PromptSample], cell: int = 0) -> Collected:
    """Sample ``group_size`` completions for each of ``prompts``, score them, compute advantages."""
    rl = cfg.rl
    prompt_ids = [
        render_prompt_ids(roles.tokenizer, p.prompt, use_chat_template=cfg.model.use_chat_template) for p in prompts
    ]
    rollout = roles.engine.generate(prompt_ids, rl.group_size, sampling_params(cfg, cell))
    inputs = [
        RewardInput(
            prompt=prompts[c.prompt_index].prompt,
            completion=c.text,
            ground_truth=prompts[c.prompt_index].ground_truth,
            finish_reason=c.finish_reason,
            metadata=prompts[c.prompt_index].metadata,
        )
        for c in rollout.completions
    ]
    uids = [f"{prompts[c.prompt_index].uid}#{k % rl.group_size}" for k, c in enumerate(rollout.completions)]
    scores = score_completions(roles.reward, inputs, uids)
    rewards_NG = torch.tensor(scores, dtype=torch.float32).view(len(prompts), rl.group_size)
    # Advantages are computed on the whole group here, before any completion is masked out of the loss.
    advantages_NG = group_advantages(rewards_NG, unbiased=rl.unbiased_advantage, eps=rl.advantage_eps)
    return Collected(prompts, rollout, rewards_NG, advantages_NG)


@dataclass
class GroupPayload:
    """One prompt's complete group, as dynamic sampling keeps or drops it."""

    prompt: PromptSample
    prompt_ids: list[int]
    completions: list[Completion]
    rewards_G: torch.Tensor
    advantages_G: torch.Tensor
    stats: dict[str, float]


def split_groups(collected: Collected, group_size: int) -> list[ScoredGroup]:
    """A drawn batch as groups stamped with their reward spread (the informative test reads only that)."""
    spread_N = group_reward_spread(collected.rewards_NG).tolist()
    comps = collected.rollout.completions
    return [
        ScoredGroup(
            spread=spread_N[i],
            payload=GroupPayload(
                prompt=collected.prompts[i],
                prompt_ids=collected.rollout.prompt_token_ids[i],
                completions=comps[i * group_size : (i + 1) * group_size],
                rewards_G=collected.rewards_NG[i],
                advantages_G=collected.advantages_NG[i],
                stats=collected.rollout.stats,
            ),
        )
        for i in range(len(collected.prompts))
    ]


def join_groups(groups: list[GroupPayload]) -> Collected:
    """The trained groups as one collected batch, completions renumbered by their new prompt index."""
    completions = [replace(c, prompt_index=i) for i, g in enumerate(groups) for c in g.completions]
    stats: dict[str, float] = {}
    for g in groups:  # the last dispatch's engine stats stand for the step
        stats = g.stats
    rollout = RolloutBatch(prompt_token_ids=[g.prompt_ids for g in groups], completions=completions, stats=stats)
    return Collected(
        prompts=[g.prompt for g in groups],
        rollout=rollout,
        rewards_NG=torch.stack([g.rewards_G for g in groups]),
        advantages_NG=torch.stack([g.advantages_G for g in groups]),
    )


def cell_groups(cfg: GRPOConfig, cells: Cells) -> list[int]:
    """Indices of the prompt groups of one collected batch that data cell ``cells.index`` trains on:
    its slice of whole groups of every mini-batch (``cell_rows``), so the k-th optimizer step of
    every rank holds its share of the global k-th mini-batch, as in one process."""
    from posttrain.distributed.cells import cell_rows

    g = cfg.rl.group_size
    rows = cell_rows(
        cfg.rl.batch_per_replica, group_size=g, mini_batch=cfg.rl.mini_batch, cell=cells.index, cells=cells.count
    )
    return [row // g for row in rows[::g]]


def draw_cell(cfg: GRPOConfig, roles: Roles, cells: Cells) -> Collected:
    """One collected batch without dynamic sampling: every rank draws the step's prompts (the same
    ones: same data source, same seed) and samples and scores its cell's groups only."""
    if not cells.multi:
        return draw_groups(cfg, roles, cfg.rl.groups_per_step)
    prompts = roles.data.next_batch(cfg.rl.groups_per_step)
    return sample_and_score(cfg, roles, [prompts[i] for i in cell_groups(cfg, cells)], cells.index)


def dynamic_draw(cfg: GRPOConfig, roles: Roles, cells: Cells) -> DrawFn:
    """The dynamic-sampling draw function of this rank.

    One process draws every cell itself. With several ranks, each draws the whole dispatch's prompts
    (cell 0's, then cell 1's, ...; the cursors stay equal), samples and scores its own cell's, and
    learns the other cells' reward spreads by an all-gather: the driver then makes the same refill
    and selection decisions on every rank, and each rank keeps the payloads of its own cell only.
    """
    g = cfg.rl.group_size
    if not cells.multi:
        return lambda counts: [split_groups(draw_groups(cfg, roles, n), g) if n else [] for n in counts]
    from posttrain.distributed.world import gather_objects

    def draw(counts: list[int]) -> list[list[ScoredGroup]]:
        total = sum(counts)
        prompts = roles.data.next_batch(total) if total else []
        start = sum(counts[: cells.index])
        mine = prompts[start : start + counts[cells.index]]
        own = split_groups(sample_and_score(cfg, roles, mine, cells.index), g) if mine else []
        spreads = gather_objects([group.spread for group in own])
        return [
            own if c == cells.index else [ScoredGroup(spread=s, payload=None) for s in spreads[c]]
            for c in range(cells.count)
        ]

    return draw


def collect(cfg: GRPOConfig, roles: Roles, cells: Cells | None = None) -> tuple[Collected, dict[str, float]]:
    """One collected batch (this rank's cell of it); with a dynamic-sampling quota, keep drawing until
    it holds enough informative groups (DAPO), train on those first and drop the rest."""
    rl, cells = cfg.rl, cells or Cells()
    if rl.effective_min_informative_groups == 0:
        return draw_cell(cfg, roles, cells), {}
    result = collect_dynamic_for(rl, dynamic_draw(cfg, roles, cells), num_cells=cells.count)
    # Train in draw order: selection order would put every informative group in the first mini-batch.
    mine = [g for g in result.groups if g.cell == cells.index]
    chosen = sorted(mine, key=lambda g: (g.draw_round, g.order))
    return join_groups([g.payload for g in chosen]), result.metrics


def to_train_batch(cfg: GRPOConfig, collected: Collected) -> TrainBatch:
    """The trainer's view; truncated completions leave the loss here when masking is on."""
    completions = collected.rollout.completions
    truncated = torch.tensor([c.finish_reason == "length" for c in completions])
    in_loss = ~truncated if cfg.rl.mask_truncated_completions else torch.ones_like(truncated)
    heads = cfg.rl.score_centering.enabled
    return TrainBatch(
        prompt_ids=[collected.rollout.prompt_token_ids[c.prompt_index] for c in completions],
        completion_ids=[c.token_ids for c in completions],
        advantages_B=collected.advantages_NG.reshape(-1),
        in_loss_B=in_loss,
        sampler_logprobs=[c.logprobs for c in completions],
        group_size=cfg.rl.group_size,
        head_ids=[c.extra["head_ids"] for c in completions] if heads else None,
        head_logprobs=[c.extra["head_logprobs"] for c in completions] if heads else None,
    )


def rollout_metrics(collected: Collected, cells: Cells | None = None) -> dict[str, float]:
    """Reward and response statistics of the collected batch (before any update); with several
    policy ranks, of the whole batch: every rank's rewards and lengths are gathered first."""
    rewards = collected.rewards_NG
    lengths = torch.tensor([len(c.token_ids) for c in collected.rollout.completions], dtype=torch.float32)
    truncated = [c.finish_reason == "length" for c in collected.rollout.completions]
    stats = {k: float(v) for k, v in collected.rollout.stats.items()}
    if cells is not None and cells.multi:
        from posttrain.distributed.world import gather_objects, merge_rank_metrics

        parts = gather_objects((rewards, lengths, truncated, stats))
        rewards = torch.cat([p[0] for p in parts])
        lengths = torch.cat([p[1] for p in parts])
        truncated = [t for p in parts for t in p[2]]
        stats = merge_rank_metrics([p[3] for p in parts])
    metrics = {
        "train/reward_mean": float(rewards.mean()),
        "train/reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "train/grpo_informative_group_count": float(informative_groups(rewards).sum()),
        "train/rollout_truncated_frac": sum(truncated) / max(1, len(truncated)),
        "train/response_len_mean": float(lengths.mean()),
        "train/response_len_max": float(lengths.max()),
    }
    metrics.update(stats)
    return metrics


@dataclass
class Run:
    """Everything one attempt of a run holds."""

    cfg: GRPOConfig
    run_dir: Path
    log: MetricsLogger
    roles: Roles
    trainer: PolicyTrainer
    identity: dict[str, Any]
    tokenizer: Any
    cells: Cells = field(default_factory=Cells)
    """This rank's data cell (cell 0 of 1 in a single process)."""


def build_engine(cfg: GRPOConfig, model: Any, tokenizer: Any, log: MetricsLogger) -> Any:
    """The rollout engine ``rollout.backend`` names, colocated with (and fed by) the policy; under
    ``grid.gpu_placement=disaggregated`` (Ray) a proxy to this rank's rollout replica instead."""
    ro = cfg.rollout
    if cfg.grid.gpu_placement == "disaggregated":
        import os

        from posttrain.launch.ray_backend import rollout_proxy

        return rollout_proxy(cfg, int(os.environ.get("RANK", "0")))
    if ro.backend != "vllm":
        return HFRolloutEngine(model, tokenizer, batch_size=ro.batch_size)
    from posttrain.rollout.vllm_engine import engine_from_config

    engine = engine_from_config(
        ro,
        resolve_model_path(cfg.model.name_or_path),
        tokenizer,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        policy=model,
    )
    log.info(f"vLLM engine started in {engine.start_s:.1f}s (logprobs_mode={engine.logprobs_mode})")
    return engine


def open_run_dir(cfg: GRPOConfig, argv: list[str], world: int) -> tuple[Path, MetricsLogger]:
    """The attempt's directory, provenance, resolved config and sinks. With several ranks rank 0
    creates and writes them and tells the others the path; they log nothing (``OffRankLogger``)."""
    from posttrain.distributed.world import broadcast_object, is_rank_zero

    if world > 1 and not is_rank_zero():
        return Path(broadcast_object(None)), OffRankLogger()
    run_dir = create_run_dir(cfg)
    if world > 1:
        broadcast_object(str(run_dir))
    provenance = collect_provenance(argv=argv, attempt_ts=run_dir.name)
    write_provenance(run_dir, provenance)
    write_resolved_config(run_dir, cfg, {"argv": argv, "provenance": provenance})
    log = MetricsLogger(
        run_dir,
        tensorboard=cfg.job.tensorboard,
        wandb=cfg.job.wandb,
        wandb_project=cfg.job.project,
        run_name=f"{cfg.job.group}/{cfg.job.name}/{run_dir.name}",
        config=cfg.model_dump(mode="json"),
        console_every=cfg.job.console_every,
        max_steps=cfg.rl.max_steps,
    )
    log.info(f"run directory: {run_dir}")
    if world > 1:
        log.info(f"{world} FSDP2 policy ranks (grid.backend={cfg.grid.backend}), one data cell each")
    return run_dir, log


def shard_for_ranks(cfg: GRPOConfig, model: Any, tokenizer: Any, log: MetricsLogger) -> tuple[Any, Any, Cells]:
    """Several policy ranks: the reference and this rank's rollout engine are built from the whole
    model first (the reference is a deep copy; the transformers engine cannot sample from a sharded
    module, so it gets its own unsharded copy), then the policy is sharded with FSDP2 in place.
    Returns ``(reference, engine, cells)``."""
    from posttrain.distributed.fsdp import build_dp_mesh, shard_policy

    reference = build_reference(model, cfg)
    remote = cfg.rollout.backend == "vllm" or cfg.grid.gpu_placement == "disaggregated"
    engine_model = model if remote else copy.deepcopy(model)
    engine = build_engine(cfg, engine_model, tokenizer, log)
    dp = shard_policy(model, build_dp_mesh(cfg.grid.dp_replicate, cfg.grid.dp_shard))
    return reference, engine, Cells(dp.cell, dp.size)


def start_run(cfg: GRPOConfig, argv: list[str], trainer_class: type[PolicyTrainer] = PolicyTrainer) -> Run:
    """Run directory, provenance, sinks, data, reward, model, engine and trainer (data and reward
    first: a malformed file or an unknown reward fails before minutes go into loading a model).
    Launched with ``WORLD_SIZE > 1`` it first joins the policy ranks' process group."""
    world = join_policy_world(cfg)
    run_dir, log = open_run_dir(cfg, argv, world)
    seed_everything(cfg.rl.seed)
    data = build_data_source(cfg.rl.data, cfg.data_seed)
    reward = get_reward(cfg.rl.reward)
    t0 = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    log.info(
        f"model {cfg.model.name_or_path}: {params / 1e6:.1f}M parameters on {device} in {dtype} "
        f"(loaded in {time.perf_counter() - t0:.1f}s)"
    )
    if world > 1:
        reference, engine, cells = shard_for_ranks(cfg, model, tokenizer, log)
    else:
        engine, cells = build_engine(cfg, model, tokenizer, log), Cells()
        reference = build_reference(model, cfg)
    roles = Roles(data=data, engine=engine, reward=reward, tokenizer=tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = trainer_class(model, cfg, pad_id=pad_id, ref_model=reference)
    return Run(cfg, run_dir, log, roles, trainer, resume_identity(cfg), tokenizer, cells)


def publish_weights(run: Run, version: int) -> None:
    """The policy's current weights to this rank's rollout engine, stamped ``version`` once the whole
    transfer succeeded. One process: the engine shares (or reads) the policy module itself. Several
    ranks: the FSDP2 shards are gathered into a full state dict on every rank (a collective) and
    copied into the rank's own engine."""
    engine = run.roles.engine
    remote = bool(getattr(engine, "needs_barrier", False))  # a disaggregated replica (launch/ray_backend.py)
    if not run.cells.multi and not remote:
        engine.load_weights(None, version=version)
        return
    from posttrain.distributed.fsdp import full_state_dict
    from posttrain.distributed.world import any_rank

    engine.load_weights(full_state_dict(run.trainer.model, to_cpu=False, rank0_only=False), version=version)
    if remote and run.cells.multi:
        any_rank(False)  # a barrier: no rank samples from a shared replica before its new version is in


def restore(run: Run) -> int:
    """Continue from ``rl.resume``'s checkpoint, if any; returns the number of batches already done."""
    path = resolve_resume(run.cfg.rl.resume, job_dir(run.cfg))
    if path is None:
        if run.cfg.rl.resume == "auto":
            run.log.info("rl.resume=auto: no complete checkpoint of this job yet, starting fresh")
        return 0
    check_resume_compatible(read_training_state(path), run.identity, run.cfg.rl.n_mini)
    trainer = run.trainer
    state = load_checkpoint(path, trainer.model, trainer.optimizer, trainer.scheduler)
    trainer.optimizer_step = state.optimizer_step
    trainer.zero_grad_skips_total = state.zero_grad_skips_total
    run.roles.data.load_state_dict(state.data_state)
    cast(ResumableEngine, run.roles.engine).load_state_dict(state.engine_state)
    publish_weights(run, state.optimizer_step)
    restore_rng(state.rng)  # last: nothing after this may draw random numbers before step 1
    if not isinstance(run.log, OffRankLogger):
        copy_metrics_history(path, run.run_dir, state.step)
    run.log.info(f"resumed from {path}: {state.step} collected batches done, optimizer step {state.optimizer_step}")
    return state.step


def save(run: Run, writer: CheckpointWriter, step: int) -> None:
    """A checkpoint of everything an exact resume needs."""
    trainer = run.trainer
    state = TrainingState(
        step=step,
        optimizer_step=trainer.optimizer_step,
        zero_grad_skips_total=trainer.zero_grad_skips_total,
        data_state=run.roles.data.state_dict(),
        engine_state=cast(ResumableEngine, run.roles.engine).state_dict(),
        rng=capture_rng(),
        identity=run.identity,
    )
    path = writer.save(step, trainer.model, trainer.optimizer, trainer.scheduler, state, tokenizer=run.tokenizer)
    run.log.info(f"checkpoint: {path}")


def grpo_batch(cfg: GRPOConfig, run: Run, timer: StepTimer) -> tuple[TrainBatch, dict[str, float]]:
    """One GRPO collected batch (this rank's cell of it) as the trainer's input, and the rollout
    metrics of the whole batch. The dynamic-sampling metrics are the driver's, already global."""
    with timer.phase("rollout"):
        collected, sampling_metrics = collect(cfg, run.roles, run.cells)
    return to_train_batch(cfg, collected), {**rollout_metrics(collected, run.cells), **sampling_metrics}


MakeBatch = Callable[[StepTimer], tuple[TrainBatch, dict[str, float]]]


def train(cfg: GRPOConfig, argv: list[str] | None = None) -> Path:
    """Run GRPO as configured; returns the run directory."""
    run = start_run(cfg, argv or [])
    rl = cfg.rl
    headline = (
        f"GRPO ({cfg.algorithm}): {rl.max_steps} steps x {rl.groups_per_step} prompts x {rl.group_size} "
        f"samples, reward={rl.reward}, data={rl.data.kind}, n_mini={rl.n_mini}, lr={rl.optimizer.lr:g}"
    )
    if quota_line := dynamic_sampling_log_line(rl, run.cells.count):
        headline += f"\n{quota_line}"
    return run_loop(run, lambda timer: grpo_batch(cfg, run, timer), headline)


def run_loop(run: Run, make_batch: MakeBatch, headline: str, close_first: Sequence[Any] = ()) -> Path:
    """The online loop shared by GRPO and OPD: per collected batch, build the trainer's batch, update
    the policy, publish the weights to the rollout engine, log one frame, checkpoint on cadence.

    At the end, finished or not, the engines are shut down (``close_first``, e.g. OPD's teacher, then
    the rollout engine) BEFORE the policy ranks leave their process group: an in-process vLLM engine
    built under torchrun made its groups inside that world, and tearing them down after the world is
    gone raises at interpreter exit."""
    cfg, log, trainer = run.cfg, run.log, run.trainer
    rl = cfg.rl
    writer = CheckpointWriter(
        run.run_dir / "checkpoints",
        fmt=rl.checkpoint_format,
        keep_model_last=rl.keep_model_last,
        keep_optim_last=rl.keep_optim_last,
        async_save=rl.save_async,
    )
    finished = False
    try:
        done = restore(run)
        for line in headline.splitlines():
            log.info(line)
        timer = StepTimer()
        source = batch_source(rl.max_off_policy_steps, make_batch)
        with GracefulStop() as stop, writer, log, closing(source):
            for step in range(done + 1, rl.max_steps + 1):
                batch, batch_metrics = source.next(timer)
                with timer.phase("train"):
                    train_metrics = trainer.train_on(batch, step)
                source.settle()  # off-policy: the rollout in flight ends before the weights change
                with timer.phase("weight_sync"):
                    publish_weights(run, trainer.optimizer_step)
                log.log(step, {**batch_metrics, **train_metrics, **timer.frame(), **peak_memory_frame()})
                stopping = _stop_requested(stop, run.cells)
                if stopping or (rl.save_every and (step % rl.save_every == 0 or step == rl.max_steps)):
                    save(run, writer, step)
                if stopping:
                    log.info(
                        f"{stop.signal_name}: stopped after step {step} with a checkpoint; resume with rl.resume=auto"
                    )
                    break
        finished = True
    finally:
        try:
            close_engines(*close_first, run.roles.engine)
        finally:
            leave_policy_world(finished=finished)
    if not isinstance(log, OffRankLogger):
        _finish(run.run_dir)
    return run.run_dir


def close_engines(*engines: Any) -> None:
    """Shut engines down in order. Two in-process vLLM engines share vLLM's global parallel state: the
    first shutdown tears it down and the second one's teardown of the same groups raises; left to
    interpreter exit, both would print tracebacks after a finished run."""
    for engine in engines:
        close = getattr(engine, "close", None)
        if close is None:
            continue
        try:
            close()
        except ValueError as exc:  # "Invalid process group specified": already torn down
            if "process group" not in str(exc):
                raise


def _stop_requested(stop: GracefulStop, cells: Cells) -> bool:
    """A signal on any rank stops every rank after the same step (each rank checkpoints its shards)."""
    if not cells.multi:
        return stop.requested
    from posttrain.distributed.world import any_rank

    return any_rank(stop.requested)


def copy_metrics_history(checkpoint: Path, run_dir: Path, upto_step: int) -> None:
    """Start this attempt's metrics.jsonl with the resumed attempt's frames up to the checkpoint, so
    every attempt's file holds the run's whole history."""
    source = checkpoint.parent.parent / "metrics.jsonl"
    if not source.is_file():
        return
    kept = []
    for line in source.read_text().splitlines():
        try:
            if json.loads(line).get("step", upto_step + 1) <= upto_step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the crash that made this resume necessary
    (run_dir / "metrics.jsonl").write_text("".join(f"{line}\n" for line in kept))


def _finish(run_dir: Path) -> None:
    """Best-effort report PNG and summary at the end of a run."""
    try:
        from posttrain.metrics.report import write_report

        png, summary = write_report(run_dir)
        print(summary)
        print(f"reward curve: {png}")
    except Exception as exc:  # the report is a convenience; a failure must not fail a finished run
        print(f"warning: could not write the run report: {exc}")
    print(f"metrics: {run_dir / 'metrics.jsonl'}")
