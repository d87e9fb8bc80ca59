"""One run of the online loop, shared by GRPO and OPD: assembly, the loop, weights, checkpoints.

``start_run`` assembles the roles (run directory, data, reward, model, rollout engine, reference,
trainer), ``run_loop`` iterates one collected batch at a time:

    make the batch (the recipe's ``MakeBatch``) -> policy update -> weights to the rollout engine
            -> one metrics frame -> checkpoint on cadence (and on a stop signal)

Several policy ranks (torchrun or Ray, ``grid.shapes.policy=[1,N]``) run this same code, one data
cell each; ``posttrain.distributed`` makes every collective trivial in one process, so nothing
here asks how many processes there are. Rank 0 alone writes the run directory.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from posttrain.checkpoint import (
    CheckpointWriter,
    GracefulStop,
    TrainingState,
    capture_rng,
    collect_provenance,
    load_checkpoint,
    read_training_state,
    resolve_resume,
    restore_rng,
    write_provenance,
)
from posttrain.checkpoint.failed_saves import remove_unfinished_saves
from posttrain.checkpoint.reader import describe_fresh_start
from posttrain.checkpoint.upload import fetch_from_destination, start_uploads
from posttrain.config.schema import RunConfig
from posttrain.data.build import build_data_source
from posttrain.data.prompt_length import positions_in, prompt_budget
from posttrain.distributed.cells import Cells
from posttrain.distributed.fsdp import PolicyWeights, shard_for_world
from posttrain.distributed.process_group import join_policy_world, leave_policy_world
from posttrain.distributed.reference import shard_reference_for_world
from posttrain.distributed.world import broadcast_object, is_rank_zero
from posttrain.loop.collect import Roles
from posttrain.loop.evaluate import build_evaluator
from posttrain.loop.pipeline import MakeBatch, batch_source
from posttrain.loop.resume import check_resume_compatible, resume_identity
from posttrain.loop.run_dir import create_run_dir, job_dir, write_resolved_config
from posttrain.loop.vision import prepare_vision_policy, vision_run
from posttrain.metrics.sinks import MetricsLogger, OffRankLogger
from posttrain.metrics.timers import StepTimer, peak_memory_frame
from posttrain.models.cpu_heap import keep_freed_memory_in_heap
from posttrain.models.loading import load_model_and_tokenizer
from posttrain.models.lora import apply_lora, checkpoint_module, trainable_count
from posttrain.models.precision import resolve_precision
from posttrain.policy.objective import Objective
from posttrain.policy.trainer import PolicyTrainer, build_reference
from posttrain.rewards.registry import get_reward
from posttrain.rollout.base import ResumableEngine
from posttrain.rollout.factory import build_rollout_engine


@dataclass
class Run:
    """Everything one attempt of a run holds."""

    cfg: RunConfig
    run_dir: Path
    log: MetricsLogger
    roles: Roles
    trainer: PolicyTrainer
    identity: dict[str, Any]
    tokenizer: Any
    cells: Cells = field(default_factory=Cells)
    """This rank's data cell (cell 0 of 1 in a single process)."""


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch RNGs (sampling has its own generator in the engine)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def open_run_dir(cfg: RunConfig, argv: list[str], world: int) -> tuple[Path, MetricsLogger]:
    """The attempt's directory, provenance, resolved config and sinks. Rank 0 creates and writes them
    and tells the other ranks the path; they log nothing (``OffRankLogger``)."""
    if not is_rank_zero():
        return Path(broadcast_object(None)), OffRankLogger()
    run_dir = create_run_dir(cfg)
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
        wandb_resume=cfg.rl.resume != "off",  # every attempt of the job logs to its one W&B run
    )
    log.info(f"run directory: {run_dir}")
    log.info(f"policy ranks: {world} (grid.backend={cfg.grid.backend}), one data cell each")
    return run_dir, log


def start_run(cfg: RunConfig, argv: list[str], objective: Objective) -> Run:
    """Run directory, provenance, sinks, data, reward, model, engine and trainer (data and reward
    first: a malformed file or an unknown reward fails before minutes go into loading a model).
    Launched with ``WORLD_SIZE > 1`` it first joins the policy ranks' process group; the rollout
    engine and the reference are built from the whole model, then the policy and the reference are
    sharded in place.
    ``objective``: what the trainer optimises, chosen by the recipe (``policy/objective.py``)."""
    world = join_policy_world(cfg)
    run_dir, log = open_run_dir(cfg, argv, world)
    seed_everything(cfg.rl.seed)
    vision = vision_run(cfg)  # a vision-language policy: image rows, image sampling (loop/vision.py)
    data = build_data_source(cfg.rl.data, cfg.data_seed, images=vision)
    reward = get_reward(cfg.rl.reward, timeout_s=cfg.rl.reward_timeout_s, weights=cfg.rl.reward_weights)
    t0 = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    model = apply_lora(model, cfg.model.lora)  # the model itself unless model.lora.rank > 0
    params = sum(p.numel() for p in model.parameters())
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    if device.type == "cpu":
        keep_freed_memory_in_heap()  # no page faults on each step's big tensors (models/cpu_heap.py)
    log.info(
        f"model {cfg.model.name_or_path}: {params / 1e6:.1f}M parameters on {device} in {dtype} "
        f"(loaded in {time.perf_counter() - t0:.1f}s)"
    )
    if cfg.model.lora.enabled:
        trainable, total = trainable_count(model)
        log.info(f"LoRA rank {cfg.model.lora.rank}: {trainable / 1e6:.2f}M of {total / 1e6:.1f}M parameters train")
    sampler = prepare_vision_policy(cfg, model, tokenizer, log) if vision else None  # freezes before any copy
    engine = build_rollout_engine(cfg, model, tokenizer, log)
    reference = build_reference(model, cfg, objective)
    precision = resolve_precision(cfg.model.dtype, cfg.model.compute_dtype, device)
    dp = shard_for_world(model, cfg.grid.dp_replicate, cfg.grid.dp_shard, compute_dtype=precision.compute_dtype)
    if not getattr(reference, "runs_policy", False):  # a LoRA reference is the policy itself: sharded already
        reference = shard_reference_for_world(reference, dp, compute_dtype=precision.compute_dtype)  # like the policy
    budget = prompt_budget(positions_in(model.config.to_dict()), cfg.rollout)
    roles = Roles(data=data, engine=engine, reward=reward, tokenizer=tokenizer, vision=sampler, prompt_budget=budget)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = PolicyTrainer(model, cfg, objective=objective, pad_id=pad_id, ref_model=reference)
    if trainer.fused_kernels:
        log.info(f"{trainer.fused_kernels_note}: the policy's RMSNorm, SwiGLU, RoPE run Liger-Kernel's Triton kernels")
    elif trainer.device.type == "cuda":  # on the CPU they never run: no line
        log.info(trainer.fused_kernels_note)
    if trainer.graphs is not None:
        log.info(
            f"{trainer.cuda_graphs_note}: the policy body's forward and backward replay as CUDA graphs, "
            "one recording per padded shape"
        )
    elif trainer.device.type == "cuda":
        log.info(trainer.cuda_graphs_note)
    if trainer.device.type == "cuda":  # on the CPU the kernels never run: no line
        log.info(f"{trainer.triton_head_note} (the logprob head's softmax as two Triton kernels)")
    else:
        log.info(f"{trainer.packed_update_note} (the update's linear forwards over oneDNN-packed weights)")
    return Run(cfg, run_dir, log, roles, trainer, resume_identity(cfg), tokenizer, Cells(dp.cell, dp.size))


def publish_weights(run: Run, version: int) -> None:
    """The policy's current weights to this rank's rollout engine, stamped ``version`` once the whole
    transfer succeeded (``RolloutEngine.receive_weights``: an engine sharing the policy module copies
    nothing; the others take its full tensors, gathered on every rank when it is sharded)."""
    run.roles.engine.receive_weights(PolicyWeights(run.trainer.model), version=version)


def restore(run: Run) -> int:
    """Continue from ``rl.resume``'s checkpoint, if any; returns the number of batches already done.
    First the ``.tmp-`` directories of killed saves are removed (named in the log); a fresh start
    over checkpoints that are all corrupt says how many it skipped."""
    if is_rank_zero():
        for line in remove_unfinished_saves(job_dir(run.cfg)):
            run.log.info(line)
    skipped: list[tuple[Path, str]] = []
    verify = run.cfg.rl.checkpoint_verify  # sizes against the manifest, or sizes and sha256
    path = resolve_resume(run.cfg.rl.resume, job_dir(run.cfg), skipped=skipped, verify=verify)
    if run.cfg.rl.resume == "auto" and run.cfg.rl.upload.enabled:  # the archive may hold a newer one
        path = fetch_from_destination(run.cfg, job_dir(run.cfg), path, run.log.info)
    if path is None:
        if run.cfg.rl.resume == "auto":
            run.log.info(describe_fresh_start(skipped))
        return 0
    check_resume_compatible(read_training_state(path), run.identity, run.cfg.rl.n_mini)
    trainer = run.trainer
    # checkpoint_module: a LoRA policy's checkpoint holds the adapter alone (models/lora.py)
    state = load_checkpoint(path, checkpoint_module(trainer.model), trainer.optimizer, trainer.scheduler, verify=verify)
    trainer.optimizer_step = state.optimizer_step
    trainer.zero_grad_skips_total = state.zero_grad_skips_total
    run.roles.data.load_state_dict(state.data_state)
    cast(ResumableEngine, run.roles.engine).load_state_dict(state.engine_state)
    publish_weights(run, state.optimizer_step)
    restore_rng(state.rng)  # last: nothing after this may draw random numbers before step 1
    if is_rank_zero():
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
    module = checkpoint_module(trainer.model)  # a LoRA policy: the adapter alone
    path = writer.save(step, module, trainer.optimizer, trainer.scheduler, state, tokenizer=run.tokenizer)
    run.log.info(f"checkpoint: {path}")


def run_loop(run: Run, make_batch: MakeBatch, headline: str, close_first: Sequence[Any] = ()) -> Path:
    """The online loop shared by GRPO and OPD: per collected batch, build the trainer's batch, update
    the policy, publish the weights to the rollout engine, log one frame, checkpoint on cadence.

    At the end, finished or not, the engines are shut down (``close_first``, e.g. OPD's teacher, then
    the rollout engine) BEFORE the policy ranks leave their process group: an in-process vLLM engine
    built under torchrun made its groups inside that world, and tearing them down after the world is
    gone raises at interpreter exit."""
    cfg, log, trainer = run.cfg, run.log, run.trainer
    rl = cfg.rl
    main = is_rank_zero()  # asked now: once the ranks have left their group, every rank reads as rank 0
    keep = {"keep_model_last": rl.keep_model_last, "keep_optim_last": rl.keep_optim_last}
    uploads = start_uploads(cfg, run.run_dir, log.info, **keep)  # None unless rl.upload.enabled
    writer = CheckpointWriter(
        run.run_dir / "checkpoints",
        fmt=rl.checkpoint_format,
        **keep,
        async_save=rl.save_async,
        on_published=uploads.on_published if uploads is not None else None,
    )
    finished = False
    try:
        done = restore(run)
        evaluator = build_evaluator(cfg, run.roles)  # None unless rl.eval.enabled
        for line in headline.splitlines():
            log.info(line)
        source = batch_source(rl.max_off_policy_steps, make_batch)
        with GracefulStop() as stop, writer, log, closing(source):
            if evaluator is not None and done == 0:  # step 0: the initial weights, before any update
                log.log(0, evaluator.at_step(0, log))
            timer = StepTimer()  # after the step-0 evaluation, which is no part of step 1's time
            for step in range(done + 1, rl.max_steps + 1):
                batch, batch_metrics = source.next(timer)
                if not bool(batch.in_loss_B.any()):
                    log.info(
                        f"warning: step {step}: no completion of this batch is in the loss (every one was truncated "
                        "at rollout.max_tokens and rl.mask_truncated_completions=true leaves them out): nothing "
                        "trains this step; raise rollout.max_tokens (train/masked_truncated_count counts them)"
                    )
                with timer.phase("train"):
                    train_metrics = trainer.train_on(batch, step)
                source.settle()  # off-policy: the rollout in flight ends before the weights change
                with timer.phase("weight_sync"):
                    publish_weights(run, trainer.optimizer_step)
                # After the weight sync (off-policy: nothing is in flight once settled), so it sees update `step`.
                evaluated = evaluator.at_step(step, log) if evaluator is not None and evaluator.due(step) else {}
                log.log(step, {**batch_metrics, **train_metrics, **timer.frame(), **peak_memory_frame(), **evaluated})
                stopping = stop.should_stop()  # a signal on any rank stops every rank after this step
                if stopping or (rl.save_every and (step % rl.save_every == 0 or step == rl.max_steps)):
                    save(run, writer, step)
                if uploads is not None:
                    uploads.check()  # rl.upload.required: an upload that failed for good stops every rank here
                if stopping:
                    log.info(
                        f"{stop.signal_name}: stopped after step {step} with a checkpoint; resume with rl.resume=auto"
                    )
                    break
            if uploads is not None:
                writer.wait()  # the last save is published, then its upload waited for (logged while the log is open)
                uploads.finish()
        finished = True
    finally:
        if uploads is not None:
            uploads.close()
        try:
            close_engines(*close_first, run.roles.engine)
        finally:
            leave_policy_world(finished=finished)
    if main:
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
