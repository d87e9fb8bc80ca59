"""One GRPO step of issue 9's workload, timed phase by phase, with posttrain's trainer and either engine.

    python benchmarks/grpo_step.py --model /tmp/m05 --engine vllm --steps 5 --out $OUT/step_vllm.json

The workload (defaults): 32 prompts ("What is a + b? Think step by step.", chat-rendered, about 45
tokens) x 8 samples, up to 256 new tokens at temperature 1, bf16 on a GPU, AdamW lr 1e-6, one optimizer
step per collected batch (micro-batches of 32 sequences), no KL, random rewards (the timing does not
depend on them). A random-weight model almost never samples EOS, so completions run the full 256 tokens.

Per step it prints and records: generation seconds and tokens/s, the trainer's extra logprob pass
(pi_old; none when one optimizer step uses the whole batch), the policy update (forward, backward,
optimizer), weight sync into the engine, the rest, training tokens/s, MFU of the update (6 N per
trained token, N = parameters, against 989 TFLOP/s, the H200's dense bf16 rate) and peak GPU memory.
Step 1 carries warm-ups (CUDA graphs, autotuning); the summary is the median of steps 2.. .
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gc_clock import GcClock  # this script's directory (sys.path[0])
from gpu_profile import profile_call
from logprob_heads import HEADS, use_logprob_head

PEAK_BF16_FLOPS = 989e12  # H200 SXM dense bf16 (datasheet); ~790e12 measured on the device


# the garbage collector's pauses inside each train phase: the fortieth lease's update ran 0.3 s slower after the
# graphed decode (which allocates almost nothing per token) than after the eager one, and a full collection
# landing in the update is one candidate
GC_PAUSES = GcClock()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(acc: dict[str, float], key: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _sync()
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - start

    return wrapper


def _used_gib() -> float:
    """GPU memory in use by every allocator (vLLM's pool included), from the driver."""
    if not torch.cuda.is_available():
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def _allocator_counts() -> dict[str, int]:
    """torch's caching allocator counters: retries after a failed cudaMalloc (each frees the cache and
    synchronizes) and the device allocations and frees themselves; zeros on a CPU."""
    if not torch.cuda.is_available():
        return {"alloc_retries": 0, "device_allocs": 0, "device_frees": 0}
    stats = torch.cuda.memory_stats()
    return {
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "device_allocs": int(stats.get("num_device_alloc", 0)),
        "device_frees": int(stats.get("num_device_free", 0)),
    }


def _prompt_texts(n_total: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}? Think step by step." for _ in range(n_total)]


def build(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    from posttrain.config.schema import GRPOConfig
    from posttrain.models.loading import load_model_and_tokenizer
    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer

    cfg = GRPOConfig()
    cfg.model.name_or_path = args.model
    cfg.model.dtype = args.dtype
    cfg.rl.group_size = args.samples
    cfg.rl.batch_per_replica = args.prompts * args.samples
    cfg.rl.micro_batch_per_replica = args.micro_batch
    cfg.model.share_prompt_prefix = {"auto": "auto", "on": True, "off": False}[args.share_prefix]
    cfg.model.compile = args.compile
    cfg.model.fused_kernels = {"auto": "auto", "on": True, "off": False}[args.fused_kernels]
    cfg.model.cuda_graphs = args.cuda_graphs
    cfg.rl.optimizer.lr = args.lr
    cfg.rl.kl_beta = 0.0
    # one-step off-policy as a run does it: the ratio against the sampler's logprobs (a batch is one update
    # stale); before 2026-12-07 this script's off-policy arms took the ratio as one (pi_old = the current
    # policy) and recorded only each group's first sample's logprobs, which a run refuses
    cfg.rl.max_off_policy_steps = int(args.off_policy)
    cfg.rl.use_rollout_logprobs_for_loss = args.off_policy
    cfg.rollout.max_tokens = args.max_tokens
    cfg.rollout.temperature = 1.0
    t0 = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if args.engine == "vllm":
        from posttrain.rollout.factory import vllm_dtype
        from posttrain.rollout.vllm_engine import VLLMRolloutEngine
        from posttrain.rollout.vllm_fleet import VLLMEngineFleet

        def vllm_engine(share: float) -> VLLMRolloutEngine:
            return VLLMRolloutEngine(
                args.model,
                tokenizer,
                temperature=1.0,
                gpu_memory_utilization=share,
                max_model_len=args.max_model_len,
                enforce_eager=args.enforce_eager,
                seed=0,
                # the dtype a run's engine gets (the policy's compute dtype: bf16 beside fp32 master
                # weights); the parameters' dtype gave an fp32 engine in the W runs of 2026-12-01 (evening)
                dtype=vllm_dtype(cfg),
                enable_sleep_mode=args.sleep,
                async_scheduling=True if args.async_scheduling else None,
                separate_process=args.separate_engine_process,
                # --call-seeds: seeded per call (CPU build only; not off-policy: the trainer runs meanwhile)
                call_seeds=args.call_seeds and not args.off_policy,
                # --max-num-seqs: vLLM's cap on running sequences (1,024 by default on an H200, where CUDA
                # graphs are captured up to 512 only)
                launcher_args=_engine_extras(args),
                # --cudagraph-max: rollout.cudagraph_capture_max, the largest decode batch vLLM graphs
                cudagraph_capture_max=args.cudagraph_max or None,
            )

        # --engines N: rollout.engines_per_device, N engine processes sharing the GPU's vLLM memory
        engine = (
            vllm_engine(args.gpu_memory_utilization)
            if args.engines == 1
            else VLLMEngineFleet(vllm_engine, args.engines, args.gpu_memory_utilization)
        )
        print(f"vLLM seeding: {engine.seeding} (rollout/vllm_seeding.py)", flush=True)
    else:
        from posttrain.rollout.factory import build_hf_engine

        # as a run builds it: the policy's compute dtype, rollout.cuda_graphs=auto (graphed decode on CUDA)
        engine = build_hf_engine(cfg, model, tokenizer)
        print(f"hf engine: {engine.decode_note}", flush=True)
    engine_s = time.perf_counter() - t0
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=pad_id)
    print(f"model {args.model}: loaded in {load_s:.1f}s; {args.engine} engine started in {engine_s:.1f}s", flush=True)
    return cfg, model, tokenizer, (engine, trainer, {"model_load_s": load_s, "engine_start_s": engine_s})


def _engine_extras(args: argparse.Namespace) -> dict[str, Any] | None:
    """The vLLM ``LLM`` argument of --max-num-seqs (None: vLLM's default)."""
    return {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else None


ARM_KEYS = {
    "steps": int,
    "prompts": int,
    "max_tokens": int,
    "micro_batch": int,
    "unseeded": lambda v: v in ("1", "true", "yes"),
    "sampler_logprobs_every": int,
    "sampler_logprobs_samples": lambda v: None if v in ("", "none", "null") else int(v),
    "compile": lambda v: v in ("1", "true", "yes"),
    "fused_kernels": lambda v: v in ("1", "true", "yes"),  # turns them on (off cannot undo the patch)
    "cuda_graphs": lambda v: v in ("1", "true", "yes"),  # model.cuda_graphs, on or off per arm
    "rollout_graphs": lambda v: v in ("1", "true", "yes"),  # the hf engine's graphed decode (rollout.cuda_graphs)
    # the logprob head per arm: shipped, log_softmax, triton or logsumexp (benchmarks/logprob_heads.py)
    "head": str,
    # the graphed decode's step through torch.compile before it is recorded (graphed_decode.DecodeGraphs.compiled)
    "decode_compile": lambda v: v in ("1", "true", "yes"),
    "profile_step": int,  # --profile-step per arm (0: none)
    "profile_phases": lambda v: v.split("+"),  # --profile-phases per arm, "+"-separated (generation+train)
}


def parse_arms(spec: str, base: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """``"name:key=value,key=value;name2:..."`` as one Namespace per arm: the command line's settings
    with the arm's keys (``ARM_KEYS``) replaced. Arms run in order in one process, on one engine."""
    arms = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, body = part.partition(":")
        arm = argparse.Namespace(**vars(base))
        for item in filter(None, (x.strip() for x in body.split(","))):
            key, _, value = item.partition("=")
            if key not in ARM_KEYS:
                raise SystemExit(f"--arms: unknown key {key!r} in arm {name!r} (known: {', '.join(ARM_KEYS)})")
            setattr(arm, key, ARM_KEYS[key](value))
        arms.append((name, arm))
    return arms


def _set_decode(engine: Any, decode_graphs: Any, arm: argparse.Namespace) -> None:
    """The hf engine's decode for this arm: graphed or eager, its step compiled or not."""
    engine.graphs = decode_graphs if arm.rollout_graphs else None
    if decode_graphs is not None and decode_graphs.compiled != arm.decode_compile:
        decode_graphs.compiled = arm.decode_compile
        decode_graphs.graphs.clear()  # recorded again, through torch.compile or not


def run(
    args: argparse.Namespace,
    arms: list[tuple[str, argparse.Namespace]] | None = None,
    on_result: Any = None,
) -> list[dict[str, Any]]:
    """Build the model, engine and trainer once, then run each arm's steps on them (one arm: the
    command line's settings); one result per arm, each also handed to ``on_result`` when it is done
    (so a run cut short keeps the arms it finished)."""
    cfg, model, tokenizer, (engine, trainer, setup) = build(args)
    acc: dict[str, float] = {}  # the trainer's passes, timed (every arm clears it per step)
    trainer._old_logprobs = _timed(acc, "logprob_pass_s", trainer._old_logprobs)
    trainer._optimizer_step = _timed(acc, "optimizer_s", trainer._optimizer_step)
    results = []
    compiled, fused = args.compile, trainer.fused_kernels  # fused: as model.fused_kernels (auto) chose
    decode_graphs = getattr(engine, "graphs", None)  # the hf engine's, kept for the arms that graph
    try:
        for name, arm in arms or [("run", args)]:
            if arm.fused_kernels is True and not fused:  # turned on from this arm on: the patch stays in
                from posttrain.models.fused_kernels import apply_fused_kernels

                apply_fused_kernels(trainer.model)
                fused = True
            arm.fused_kernels = fused
            if arm.compile and not compiled:  # likewise: compiled layers stay compiled
                if fused:  # what the preflight refuses a run (compiling through Liger's kernels)
                    raise SystemExit(
                        f"--arms: arm {name!r} compiles a model with Liger's kernels in; run it in a "
                        "process of its own with --fused-kernels off"
                    )
                from posttrain.models.structure import compile_layers

                compile_layers(trainer.model)
                compiled = True
            arm.compile = compiled
            if arm.cuda_graphs and trainer.graphs is None:  # model.cuda_graphs for this arm
                from posttrain.models.cuda_graphs import GraphedBody
                from posttrain.models.structure import split_body_and_head

                trainer.graphs = GraphedBody(split_body_and_head(trainer.model)[0], trainer.precision)
            elif not arm.cuda_graphs:
                trainer.graphs = None  # its recorded graphs, and their memory pools, go
            if args.engine == "hf":
                _set_decode(engine, decode_graphs, arm)
            use_logprob_head(arm.head)
            cfg.rl.batch_per_replica = arm.prompts * arm.samples
            cfg.rl.micro_batch_per_replica = arm.micro_batch
            print(f"== arm {name}: {json.dumps({k: getattr(arm, k) for k in ARM_KEYS})}", flush=True)
            results.append(
                run_arm(
                    arm,
                    model=model,
                    tokenizer=tokenizer,
                    engine=engine,
                    trainer=trainer,
                    setup=setup,
                    acc=acc,
                    name=name,
                )
            )
            if on_result is not None:
                on_result(results[-1])
        if getattr(args, "gen_probe", False) and args.engine == "vllm":
            results.append(generation_probe(engine, tokenizer, args))
            if on_result is not None:
                on_result(results[-1])
    finally:
        if args.engine == "vllm":
            engine.close()
    return results


def generation_probe(engine: Any, tokenizer: Any, args: argparse.Namespace, repeats: int = 3) -> dict[str, Any]:
    """After the arms, on the same engine in the same (trained-in) process: W's generation alone,
    once as bare ``LLM.generate`` requests (n samples per prompt, no seed, no logprobs, as
    benchmarks/vllm_gen_variants.py sends them) and once each through posttrain's engine unseeded
    without logprobs and with the shipped settings; then the shipped call under cProfile (its top
    functions by own time), to tell vLLM's host cost from ours and from the trainer's process state."""
    import cProfile
    import io
    import pstats

    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    from posttrain.models.chat import render_prompt_ids
    from posttrain.rollout.base import SamplingParams

    texts = _prompt_texts(args.prompts, seed=12345)
    prompt_ids = [render_prompt_ids(tokenizer, t, use_chat_template=True) for t in texts]
    bare_params = VLLMSamplingParams(
        n=args.samples, max_tokens=args.max_tokens, temperature=1.0, detokenize=False, stop_token_ids=engine.eos_ids
    )
    calls = {
        "bare LLM.generate (n per prompt, unseeded, no logprobs)": lambda: engine._llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], bare_params, use_tqdm=False
        ),
        "engine.generate, unseeded, no logprobs": lambda: engine.generate(
            prompt_ids,
            args.samples,
            SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=None, sampler_logprobs_every=0),
        ),
        "engine.generate, shipped (seed per prompt, first sample's logprobs)": lambda: engine.generate(
            prompt_ids,
            args.samples,
            SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=7, sampler_logprobs_samples=1),
        ),
    }
    timings: dict[str, list[float]] = {}
    for name, call in calls.items():
        for _ in range(repeats):
            _sync()
            start = time.perf_counter()
            call()
            _sync()
            timings.setdefault(name, []).append(round(time.perf_counter() - start, 4))
        print(f"probe {name}: {timings[name]}", flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    list(calls.values())[-1]()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue()[:6000], flush=True)
    return {
        "arm": "gen_probe",
        "prompts": args.prompts,
        "samples": args.samples,
        "max_tokens": args.max_tokens,
        "seconds": timings,
        "median_s": {name: statistics.median(t) for name, t in timings.items()},
        "profile_top_tottime": text.getvalue(),
    }


def run_arm(  # noqa: PLR0915 - one flat sequence of timed phases
    args: argparse.Namespace,
    *,
    model: Any,
    tokenizer: Any,
    engine: Any,
    trainer: Any,
    setup: dict[str, float],
    acc: dict[str, float],
    name: str,
) -> dict[str, Any]:
    """One arm's steps: sample, train, sync, each timed; its per-step rows and their medians."""
    from posttrain.algorithm.advantages import group_advantages
    from posttrain.distributed.fsdp import PolicyWeights
    from posttrain.models.chat import render_prompt_ids
    from posttrain.policy.trainer import TrainBatch
    from posttrain.rollout.base import SamplingParams

    n_params = sum(p.numel() for p in model.parameters())
    texts = _prompt_texts(args.prompts * (args.steps + 1), seed=0 if name == "run" else len(name) * 7919 + args.prompts)
    rng = torch.Generator().manual_seed(0)
    rows = []
    profiles: dict[str, Any] = {}  # --profile-step: "generation" and "train", gpu_profile.profile_call's summaries
    calls = {"n": 0}

    def make_batch(_timer: Any) -> tuple[Any, dict[str, float]]:
        """Sample one batch (in the caller's thread, or the off-policy pipeline's)."""
        calls["n"] += 1
        k = calls["n"]
        batch_texts = texts[(k - 1) * args.prompts : k * args.prompts]
        prompt_ids = [render_prompt_ids(tokenizer, t, use_chat_template=True) for t in batch_texts]
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=1.0,
            seed=None if args.unseeded else k,
            sampler_logprobs_every=args.sampler_logprobs_every,
            sampler_logprobs_samples=args.sampler_logprobs_samples,
        )
        t0 = time.perf_counter()
        rollout = engine.generate(prompt_ids, args.samples, params)
        _sync()
        gen_s = time.perf_counter() - t0
        comps = rollout.completions
        rewards_NG = torch.randn(args.prompts, args.samples, generator=rng)
        advantages = group_advantages(rewards_NG, unbiased=False).reshape(-1)
        batch = TrainBatch(
            prompt_ids=[rollout.prompt_token_ids[c.prompt_index] for c in comps],
            completion_ids=[c.token_ids for c in comps],
            advantages_B=advantages,
            in_loss_B=torch.ones(len(comps), dtype=torch.bool),
            sampler_logprobs=[c.logprobs for c in comps],
            group_size=args.samples,
        )
        return (batch, rollout), {"gen_s": gen_s, "engine_gen_s": rollout.stats.get("rollout/gen_s", gen_s)}

    from posttrain.loop.pipeline import batch_source
    from posttrain.metrics.timers import StepTimer

    source = batch_source(1 if args.off_policy else 0, make_batch)
    timer = StepTimer()
    for step in range(1, args.steps + 1):
        acc.clear()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        _sync()
        t_step = time.perf_counter()
        t0 = time.perf_counter()
        profiled = step == args.profile_step
        # --profile-step: this step's phases under torch.profiler; the row is left out of the medians
        if profiled and "generation" in args.profile_phases:
            ((batch, rollout), gen_metrics), profiles["generation"] = profile_call(lambda: source.next(timer))
        else:
            (batch, rollout), gen_metrics = source.next(timer)
        wait_s = time.perf_counter() - t0
        gen_s = gen_metrics["gen_s"]
        comps = rollout.completions
        _sync()
        allocator_before = _allocator_counts()
        GC_PAUSES.take()
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if profiled and "train" in args.profile_phases:
            metrics, profiles["train"] = profile_call(functools.partial(trainer.train_on, batch, step))
        else:
            metrics = trainer.train_on(batch, step)
        _sync()
        train_s, train_cpu_s = time.perf_counter() - t0, time.thread_time() - cpu0
        train_gc_s, train_gc_count = GC_PAUSES.take()
        allocator_during = {k: v - allocator_before[k] for k, v in _allocator_counts().items()}
        source.settle()
        t0 = time.perf_counter()
        engine.receive_weights(PolicyWeights(trainer.model), version=trainer.optimizer_step)
        _sync()
        sync_s = time.perf_counter() - t0
        step_s = time.perf_counter() - t_step
        gen_tokens = sum(len(c.token_ids) for c in comps)
        train_tokens = sum(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids))
        logprob_s = acc.get("logprob_pass_s", 0.0)
        update_s = train_s - logprob_s
        row = {
            "step": step,
            "profiled": profiled,
            "step_s": step_s,
            "generation_s": gen_s,
            "engine_gen_s": gen_metrics["engine_gen_s"],
            "rollout_wait_s": wait_s,
            "sleep_s": rollout.stats.get("rollout/sleep_s", 0.0),
            "logprob_pass_s": logprob_s,
            "update_s": update_s,
            "optimizer_s": acc.get("optimizer_s", 0.0),
            # the trainer thread's own CPU time over the train phase: near train_s when the host sets the pace
            "train_thread_cpu_s": train_cpu_s,
            # the garbage collector's pauses inside the train phase, and how many collections ran there
            "train_gc_s": train_gc_s,
            "train_gc_collections": train_gc_count,
            **allocator_during,
            "weight_sync_s": sync_s,
            "wake_s": getattr(engine, "last_wake_s", 0.0) if args.sleep else 0.0,
            "other_s": step_s - wait_s - train_s - sync_s,
            "generated_tokens": gen_tokens,
            "gen_tokens_per_s": gen_tokens / gen_s,
            "train_tokens": train_tokens,
            "train_tokens_per_s": train_tokens / update_s,
            "mfu_update": 6 * n_params * train_tokens / update_s / PEAK_BF16_FLOPS,
            "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
            "used_gib": _used_gib(),
            "logprob_gap_mean": metrics.get("train/logprob_gap_mean", float("nan")),
            "logprob_gap_max": metrics.get("train/logprob_gap_max", float("nan")),
        }
        # an engine core apart's sync by phase (mapping the buffer, the copy, the worker's write), per engine
        members = getattr(engine, "members", [engine])
        if any(getattr(m, "last_sync_phases", None) for m in members):
            row["sync_phases"] = [{k: round(v, 4) for k, v in m.last_sync_phases.items()} for m in members]
        rows.append(row)
        print(
            f"step {step}: {step_s:.2f}s | gen {gen_s:.2f}s ({row['gen_tokens_per_s']:.0f} tok/s, {gen_tokens} tok) | "
            f"logprob pass {logprob_s:.2f}s | update {update_s:.2f}s (opt {row['optimizer_s']:.2f}s, "
            f"MFU {100 * row['mfu_update']:.1f}%, host {train_cpu_s:.2f}s, gc {train_gc_s:.3f}s, "
            f"retries {row['alloc_retries']}, cudaMalloc {row['device_allocs']}) | sync {sync_s:.3f}s | "
            f"other {row['other_s']:.2f}s | peak {row['peak_alloc_gib']:.1f} GiB, used {row['used_gib']:.1f} GiB | "
            f"gap mean "
            f"{row['logprob_gap_mean']:.4f} max {row['logprob_gap_max']:.3f}",
            flush=True,
        )
        if "sync_phases" in row and step <= 2:
            print(f"step {step} sync phases: {row['sync_phases']}", flush=True)
    timed = [r for r in rows if not r["profiled"]]
    later = timed[1:] or timed
    summary = {
        k: statistics.median(r[k] for r in later)
        for k, v in rows[0].items()
        if isinstance(v, float | int) and not isinstance(v, bool)
    }
    result = {
        "arm": name,
        "engine": args.engine,
        "decode_graphs": args.engine == "hf" and getattr(engine, "graphs", None) is not None,
        "model": args.model,
        "params": n_params,
        "dtype": str(next(model.parameters()).dtype),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "seeding": "none" if args.unseeded else getattr(engine, "seeding", "call"),
        "torch": torch.__version__,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **setup,
        "median_steps_2_on": summary,
        "steps": rows,
    }
    if profiles:
        result["profile_step"] = args.profile_step
        result["profiles"] = profiles
        for phase, prof in profiles.items():
            top = "; ".join(f"{k['name'][:60]} x{k['count']} {k['gpu_s'] * 1e3:.1f}ms" for k in prof["top_kernels"][:6])
            print(
                f"profile {name} step {args.profile_step} {phase}: wall {prof['wall_s']:.3f}s, host "
                f"{prof['thread_cpu_s']:.3f}s, GPU busy {prof['gpu_busy_s']:.3f}s (union {prof['gpu_union_s']:.3f}s), "
                f"{prof['kernels']} kernels, {prof['graph_launches']} graph launches; top: {top}",
                flush=True,
            )
    if args.engine == "vllm":
        import vllm

        result["vllm"] = vllm.__version__
    source.close()
    print(
        "SUMMARY " + json.dumps({"arm": name, "engine": args.engine, **{k: round(v, 4) for k, v in summary.items()}}),
        flush=True,
    )
    return result


def _settle_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve ``--sampler-logprobs-samples auto`` as a run would, and refuse combinations that cannot run."""
    if args.sampler_logprobs_samples == "auto":  # as a run resolves it: off-policy's loss reads every sample's
        from posttrain.config.schema import GRPOConfig

        run_cfg = GRPOConfig()
        run_cfg.rl.use_rollout_logprobs_for_loss = args.off_policy
        args.sampler_logprobs_samples = run_cfg.sampler_logprobs_samples
    if args.off_policy and args.sampler_logprobs_samples is not None:
        p.error("--off-policy: its loss reads every sample's sampler logprobs; leave --sampler-logprobs-samples auto")
    if args.off_policy and args.profile_step:
        p.error("--profile-step profiles an on-policy step (its generation runs in the caller's thread)")
    if args.off_policy and args.engine != "vllm":
        p.error("--off-policy needs --engine vllm (the transformers engine samples with the trained module)")
    if args.trl and not args.out:
        p.error("--trl needs --out (TRL's figures are written beside it)")
    if args.engines > 1 and not args.separate_engine_process:
        p.error("--engines above 1 needs --separate-engine-process (each engine core in a process of its own)")
    if args.arms and (args.off_policy or args.trl or not args.out_dir):
        p.error("--arms needs --out-dir and takes neither --off-policy (its sampler runs ahead) nor --trl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (e.g. /tmp/m05 from make_random_models.py)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="vllm")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--sleep", action="store_true", help="vLLM sleep mode: release its memory during the update")
    p.add_argument("--share-prefix", choices=["auto", "on", "off"], default="auto", help="model.share_prompt_prefix")
    p.add_argument("--compile", action="store_true", help="model.compile: torch.compile the decoder layers")
    p.add_argument(
        "--fused-kernels",
        choices=["auto", "on", "off"],
        default="auto",
        help="model.fused_kernels (Liger's RMSNorm, SwiGLU, RoPE; auto: the shipped default, on for a CUDA llama "
        "with liger-kernel installed); off to compare against an arm with fused_kernels=1",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="model.cuda_graphs: the policy body's forward and backward replayed as CUDA graphs per padded shape",
    )
    p.add_argument(
        "--head",
        default="shipped",
        choices=HEADS,
        help="the policy's logprob head: shipped (as model.triton_logprob_head says: Triton on CUDA), log_softmax "
        "(torch's), triton or logsumexp (the earlier one); benchmarks/logprob_heads.py",
    )
    p.add_argument("--async-scheduling", action="store_true", help="vLLM async scheduling")
    p.add_argument(
        "--no-rollout-graphs",
        dest="rollout_graphs",
        action="store_false",
        help="--engine hf: decode eagerly (rollout.cuda_graphs=false; auto graphs it on CUDA)",
    )
    p.add_argument("--off-policy", action="store_true", help="rl.max_off_policy_steps=1: sample k+1 while k trains")
    p.add_argument(
        "--engines",
        type=int,
        default=1,
        help="rollout.engines_per_device: vLLM engines sharing the GPU, each core in its own process (needs "
        "--separate-engine-process when above 1)",
    )
    p.add_argument(
        "--separate-engine-process",
        action="store_true",
        help="rollout.separate_engine_process: vLLM's engine core in a process of its own (weights by CUDA IPC)",
    )
    p.add_argument("--unseeded", action="store_true", help="rollout.seed=null: no vLLM seeding at all")
    p.add_argument("--max-num-seqs", type=int, default=0, help="vLLM max_num_seqs (0: vLLM's default)")
    p.add_argument(
        "--cudagraph-max",
        type=int,
        default=0,
        help="rollout.cudagraph_capture_max, vLLM's max_cudagraph_capture_size (0: vLLM's min(2 x max_num_seqs, 512))",
    )
    p.add_argument(
        "--gen-probe",
        action="store_true",
        help="after the arms: W's generation alone on the same engine, bare and through posttrain, and profiled "
        "(written as gen_probe.json with --arms)",
    )
    p.add_argument(
        "--call-seeds",
        action="store_true",
        help="rollout.per_prompt_seeds=false: the engine's generators seeded per call (CPU build only; a CUDA "
        "engine refuses it: it did not replay on vLLM 0.24; default: a request seed per prompt)",
    )
    p.add_argument(
        "--sampler-logprobs-every", type=int, default=1, help="rollout.sampler_logprobs_every (0: never record)"
    )
    p.add_argument(
        "--sampler-logprobs-samples",
        type=lambda v: None if v in ("none", "null") else v if v == "auto" else int(v),
        default="auto",
        help="rollout.sampler_logprobs_samples (null: every sample records; default auto, as a run resolves it: "
        "1, or every sample under --off-policy, whose loss reads them)",
    )
    p.add_argument(
        "--arms",
        help='several settings in one process on one engine: "name:key=value,...;name2:..." with keys '
        + ", ".join(ARM_KEYS)
        + " (compile and fused_kernels, once on, stay on); each arm writes NAME.json under --out-dir",
    )
    p.add_argument(
        "--decode-compile",
        action="store_true",
        help="--engine hf: the graphed decode's step through torch.compile before it is recorded",
    )
    p.add_argument(
        "--profile-step",
        type=int,
        default=0,
        help="run this step's generation and train phases under torch.profiler (gpu_profile.py; the step's row "
        "is left out of the medians; on-policy only)",
    )
    p.add_argument(
        "--profile-phases",
        type=lambda v: v.split(","),
        default=["generation", "train"],
        help="with --profile-step: which phases (comma-separated; an eager hf decode's profile takes minutes)",
    )
    p.add_argument("--out-dir", type=Path, help="with --arms: one JSON per arm here")
    p.add_argument("--out", type=Path, help="write the per-step figures as JSON here")
    p.add_argument(
        "--trl",
        type=Path,
        help="then run TRL's peer script (../shared/peers/trl_grpo_gpu_step.py) on the same model in this call "
        "and print both side by side (needs --out; TRL's wheels installed)",
    )
    p.add_argument("--trl-mode", default="vllm", choices=["vllm", "hf", "hf_bf16"], help="TRL's generation path")
    args = p.parse_args(argv)
    _settle_args(p, args)
    if args.arms:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        out_dir = args.out_dir

        def write(result: dict[str, Any]) -> None:
            (out_dir / f"{result['arm']}.json").write_text(json.dumps(result, indent=1))

        run(args, parse_arms(args.arms, args), on_result=write)
        return 0
    (result,) = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if args.trl:
        run_trl_beside(args)
    return 0


def run_trl_beside(args: argparse.Namespace) -> None:
    """TRL's GRPOTrainer on the same model, in a process of its own after ours released the GPU,
    then one table of both (``side_by_side.py``)."""
    import os
    import subprocess

    out_dir = args.out.parent
    env = {**os.environ, "OUT": str(out_dir)}
    subprocess.run([sys.executable, str(args.trl), args.model, args.trl_mode], env=env, check=True)
    side_by_side = Path(__file__).with_name("side_by_side.py")
    subprocess.run(
        [sys.executable, str(side_by_side), str(args.out), str(out_dir / f"trl_{args.trl_mode}.json")], check=True
    )


if __name__ == "__main__":
    sys.exit(main())
