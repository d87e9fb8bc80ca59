"""Fixed per-step costs of the default recipe's small step, each measured in isolation.

On the default job's work (SmolLM2-135M, 4 prompts x 8 samples x 16 tokens) the step's fixed costs
(weight sync of a weight set the engine already holds, per-step object construction, host round
trips, recompiles, the optimizer's passes over every parameter, metrics) are a large share of the
step. This script assembles the default recipe exactly as ``posttrain grpo`` does (``start_run``),
runs two warm-up steps through the loop's own pieces, then times each cost on its own, ``--repeats``
times, and prints a markdown table (median and min wall milliseconds, median CPU milliseconds of
the process: under contention from other processes the CPU time moves less than the wall time).
The whole rollout and the whole update are timed too, for scale.

    .venv/bin/python benchmarks/step_overheads.py                       # the CPU default job
    python3 benchmarks/step_overheads.py --device cuda                  # the same recipe on a GPU
    python3 benchmarks/step_overheads.py --device cuda --engine vllm    # ... with the vLLM engine
    python3 benchmarks/step_overheads.py --device cuda --compile        # ... compiled layers: recompiles

On CUDA every timing synchronizes the device before and after, so it is the cost, not the enqueue
time. Host round trips are counted (``Tensor.item`` / ``float`` / ``int`` / ``bool`` / ``tolist`` /
``cpu``: each one a device synchronization when its tensor is on CUDA) over one rollout and one
update, by the tensor's device. Recompiles are
counted with ``--compile`` over steps whose shapes differ (``torch._dynamo``'s counters). Nothing
lands in the repository: the run directory is a temporary one unless ``POSTTRAIN_OUTPUT_ROOT`` is set.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

ROUND_TRIPS = {"item", "__float__", "__int__", "__bool__", "tolist", "cpu", "__index__"}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(fn: Callable[[], Any], repeats: int, device: str, *, warm_up: bool = True) -> dict[str, float]:
    """Median / min wall ms and median process-CPU ms of ``fn`` over ``repeats`` calls (after one
    warm-up call unless ``warm_up`` is False)."""
    if warm_up:
        fn()
    walls, cpus = [], []
    for _ in range(repeats):
        _sync(device)
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        _sync(device)
        walls.append((time.perf_counter() - w0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
    return {"median_ms": statistics.median(walls), "min_ms": min(walls), "cpu_ms": statistics.median(cpus)}


class RoundTrips(TorchFunctionMode):
    """Counts the tensor calls that bring a value to the host (a device sync each on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in ROUND_TRIPS:
            # by the tensor's device: on a CPU tensor (AdamW's step counters, say) it is no device sync
            device = args[0].device.type if args and isinstance(args[0], torch.Tensor) else "?"
            self.counts[f"{name} ({device})"] += 1
        return func(*args, **(kwargs or {}))


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The default recipe's run, assembled as ``posttrain grpo`` assembles it."""
    from posttrain.config.loading import build_config
    from posttrain.loop.run import start_run
    from posttrain.policy.objective import grpo_objective

    overrides = [f"model.device={args.device}", f"rollout.backend={args.engine}", *args.overrides]
    if args.compile:
        overrides.append("model.compile=true")
    cfg = build_config("default", overrides)
    # a real file, not a StringIO: vLLM's engine start asks sys.stdout for its fileno (it failed so
    # on the GPU, 2026-12-02)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        run = start_run(cfg, [], grpo_objective(cfg))
    return cfg, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="rollout.backend")
    parser.add_argument("--repeats", type=int, default=7, help="calls per fixed cost (after one warm-up call)")
    parser.add_argument("--step-repeats", type=int, default=3, help="calls of the whole rollout / update")
    parser.add_argument("--warmup-steps", type=int, default=2, help="loop steps before anything is timed")
    parser.add_argument("--compile", action="store_true", help="model.compile=true; counts recompiles")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (key=value)")
    args = parser.parse_args(argv)
    os.environ.setdefault("POSTTRAIN_OUTPUT_ROOT", tempfile.mkdtemp(prefix="step_overheads_"))
    cfg, run = build(args)
    rows, extra = time_costs(cfg, run, args)
    print(table(rows, cfg, args, extra))
    if args.out is not None:
        args.out.write_text(json.dumps({"device": describe_device(args.device), "rows": rows, **extra}, indent=1))
    return 0


def time_costs(cfg: Any, run: Any, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every row of the table: (name, the measurement, how often per step)."""
    from posttrain.loop.collect import (
        collect,
        rollout_metrics,
        sampling_params,
        to_train_batch,
    )
    from posttrain.loop.grpo import grpo_batch
    from posttrain.loop.run import publish_weights
    from posttrain.metrics.timers import StepTimer, peak_memory_frame
    from posttrain.models.chat import render_prompt_ids

    trainer, roles, reps, dev = run.trainer, run.roles, args.repeats, args.device
    timer = StepTimer()
    step = 0
    for _ in range(args.warmup_steps):  # warm-up: the loop's own pieces, weights moving
        step += 1
        batch, _metrics = grpo_batch(cfg, run, timer)
        trainer.train_on(batch, step)
        publish_weights(run, trainer.optimizer_step)
    collected, _ = collect(cfg, roles, run.cells)
    batch = to_train_batch(cfg, collected)
    prompts = collected.prompts
    rows: list[dict[str, Any]] = []

    def add(
        name: str, fn: Callable[[], Any], per_step: str, note: str = "", *, repeats: int = reps, warm_up: bool = True
    ) -> None:
        rows.append({"cost": name, **measure(fn, repeats, dev, warm_up=warm_up), "per_step": per_step, "note": note})

    def step_rollout() -> None:
        grpo_batch(cfg, run, timer)

    def step_update() -> None:
        trainer.train_on(batch, step)

    # whole phases, already warm from the warm-up steps: a few repeats are enough for scale
    add("rollout: collect one batch (for scale)", step_rollout, "1", repeats=args.step_repeats, warm_up=False)
    add("update: train_on one batch (for scale)", step_update, "1", repeats=args.step_repeats, warm_up=False)
    version = trainer.optimizer_step
    add(
        "weight sync, weights unchanged since the last sync",
        lambda: publish_weights(run, version),
        "1",
        type(roles.engine).__name__,
    )
    add(
        "prompt rendering (chat template) + sampling params",
        lambda: (
            [
                render_prompt_ids(
                    roles.tokenizer,
                    p.prompt,
                    use_chat_template=cfg.model.use_chat_template,
                    chat_template_kwargs=cfg.model.chat_template_kwargs,
                )
                for p in prompts
            ],
            sampling_params(cfg),
        ),
        "1",
    )
    add("rollout -> TrainBatch (to_train_batch)", lambda: to_train_batch(cfg, collected), "1")
    add("rollout metrics (rollout_metrics)", lambda: rollout_metrics(collected), "1")
    add_engine_rows(add, run, cfg, prompts)
    add_update_rows(add, trainer, batch)
    sink = io.StringIO()

    def log_frame() -> None:
        with contextlib.redirect_stdout(sink):
            run.log.log(step, {**rollout_metrics(collected), **timer.frame(), **peak_memory_frame()})

    add("metrics frame: timers + jsonl/console sinks", log_frame, "1", "console to a buffer")
    extra = {"round_trips": count_round_trips(cfg, run, batch, step)}
    if args.compile:
        extra["recompiles"] = count_recompiles(cfg, run, step)
    return rows, extra


def add_engine_rows(add: Callable[..., None], run: Any, cfg: Any, prompts: list[Any]) -> None:
    """The transformers engine's per-call setup: generator seeding, chunk plan, KV cache object."""
    from posttrain.rollout.hf_engine import HFRolloutEngine, call_seed, plan_chunks

    engine = run.roles.engine
    if not isinstance(engine, HFRolloutEngine):
        return
    device = next(engine.model.parameters()).device

    def setup() -> None:
        from transformers import DynamicCache

        generator = torch.Generator(device=device)
        generator.manual_seed(call_seed(cfg.rollout.seed or 0, 7))
        plan_chunks(len(prompts), cfg.rl.group_size, engine.batch_size)
        DynamicCache(config=engine.model.config)

    add("engine call setup (generator, chunk plan, KV cache object)", setup, "1", "HFRolloutEngine")


def add_update_rows(add: Callable[..., None], trainer: Any, batch: Any) -> None:
    """The update's fixed parts: the model batch, the optimizer's passes over every parameter."""
    rows = list(range(len(batch.completion_ids)))
    trainer._decide_sharing(batch)
    add("model batch construction (sharing decision + tensors)", lambda: trainer._model_batch(batch, rows), "1")
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    add("grad norm + clip (dp.clip_grad_norm)", lambda: trainer.dp.clip_grad_norm(params, 1.0), "1")
    add("finite-weights check (dp.all_finite)", lambda: trainer.dp.all_finite(list(params)), "1")
    saved = [(p.grad.clone(), p.detach().clone()) for p in params]
    lr = [g["lr"] for g in trainer.optimizer.param_groups]
    for g in trainer.optimizer.param_groups:
        g["lr"] = 0.0  # the benchmark steps the optimizer; a zero lr moves no weight (decay is lr-scaled)

    def opt_step() -> None:
        trainer.optimizer.step()

    add(f"optimizer.step ({type(trainer.optimizer).__name__}, as configured)", opt_step, "n_mini")
    if isinstance(trainer.optimizer, torch.optim.AdamW):  # the candidate default: torch's fused kernel
        fused = torch.optim.AdamW(params, lr=0.0, fused=True)
        add("optimizer.step (AdamW fused=True, not the default)", fused.step, "n_mini", "rounds differently by an ulp")
        del fused
    add("zero_grad(set_to_none) + fresh grads", lambda: _refill_grads(trainer, params), "n_mini")
    for g, value in zip(trainer.optimizer.param_groups, lr):
        g["lr"] = value
    with torch.no_grad():
        for p, (grad, weight) in zip(params, saved):
            p.copy_(weight)
            p.grad = grad


def _refill_grads(trainer: Any, params: list[torch.Tensor]) -> None:
    trainer.optimizer.zero_grad(set_to_none=True)
    for p in params:
        p.grad = torch.zeros_like(p)


def count_round_trips(cfg: Any, run: Any, batch: Any, step: int) -> dict[str, Any]:
    """Host round trips of one rollout and one update, by kind. Not under vLLM (its engine core and
    compiled graphs are its own) nor compiled layers (the counting mode would change what dynamo
    traces); a failure is reported in the table, not raised."""
    from posttrain.loop.grpo import grpo_batch
    from posttrain.metrics.timers import StepTimer
    from posttrain.rollout.hf_engine import HFRolloutEngine

    out: dict[str, Any] = {}
    for what, fn, countable in (
        ("rollout", lambda: grpo_batch(cfg, run, StepTimer()), isinstance(run.roles.engine, HFRolloutEngine)),
        ("update", lambda: run.trainer.train_on(batch, step), not cfg.model.compile),
    ):
        if not countable:
            out[what] = {"not counted": 0}
            continue
        mode = RoundTrips()
        try:
            with mode:
                fn()
        except Exception as exc:  # the timings above must still be printed
            out[what] = {f"counting failed: {type(exc).__name__}": 0}
            continue
        out[what] = dict(mode.counts)
    return out


def count_recompiles(cfg: Any, run: Any, step: int) -> dict[str, Any]:
    """Graphs dynamo compiled over three more steps, whose batches differ in shape."""
    from torch._dynamo.utils import counters

    from posttrain.loop.grpo import grpo_batch
    from posttrain.metrics.timers import StepTimer

    before = dict(counters["stats"])
    t0 = time.perf_counter()
    for k in range(3):
        batch, _ = grpo_batch(cfg, run, StepTimer())
        run.trainer.train_on(batch, step + 1 + k)
    after = dict(counters["stats"])
    return {
        "unique_graphs_added": after.get("unique_graphs", 0) - before.get("unique_graphs", 0),
        "calls_captured_added": after.get("calls_captured", 0) - before.get("calls_captured", 0),
        "seconds_for_3_steps": time.perf_counter() - t0,
    }


def describe_device(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def table(rows: list[dict[str, Any]], cfg: Any, args: argparse.Namespace, extra: dict[str, Any]) -> str:
    lines = [
        f"device: {describe_device(args.device)}; torch {torch.__version__}; engine {args.engine}; "
        f"model {cfg.model.name_or_path}; {cfg.rl.groups_per_step} prompts x {cfg.rl.group_size} samples x "
        f"{cfg.rollout.max_tokens} tokens; {args.repeats} repeats",
        "",
        "| cost | median ms | min ms | CPU ms (median) | per step | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['cost']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['cpu_ms']:.2f} | {r['per_step']} | "
            f"{r['note']} |"
        )
    trips = extra["round_trips"]
    lines.append("")
    for what, counts in trips.items():
        total = sum(counts.values())
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        lines.append(f"host round trips, one {what}: {total} ({kinds or 'none'})")
    if "recompiles" in extra:
        lines.append(f"recompiles over 3 more steps: {extra['recompiles']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
