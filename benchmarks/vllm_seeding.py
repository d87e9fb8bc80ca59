"""vLLM generation time with a seed per prompt against the engine's generators seeded per call.

    python benchmarks/vllm_seeding.py --reps 12 --out benchmarks/results/vllm_seeding_cpu.json

One in-process ``VLLMRolloutEngine`` built as ``posttrain grpo -- rollout.backend=vllm`` builds it
(the default recipe's model and its work: 4 prompts x 8 samples x 16 new tokens, arithmetic
prompts, sampler logprobs recorded), then ``--reps`` rounds of one ``generate`` call per scheme,
the two schemes alternating (and which goes first alternating too), so that whatever else the
machine does weighs on both alike. Prints and records each scheme's median and quartiles of the
engine's own ``rollout/gen_s`` and the process's CPU seconds per call (all threads; steadier
than wall time on a machine others load). ``--model``, ``--prompts``, ``--samples``, ``--max-tokens`` change
the work (issue 9's workload W on a GPU: ``--prompts 32 --max-tokens 256`` on a 0.4B model).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _texts(n: int, call: int) -> list[str]:
    rng = random.Random(call)
    return [f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}? Think step by step." for _ in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from posttrain.config.loading import build_config
    from posttrain.models.chat import render_prompt_ids
    from posttrain.models.loading import load_tokenizer, resolve_model_path
    from posttrain.rollout.factory import build_vllm_engine, vllm_dtype

    overrides = ["rollout.backend=vllm", f"rollout.max_tokens={args.max_tokens}"]
    if args.model:
        overrides.append(f"model.name_or_path={args.model}")
    cfg = build_config(None, overrides)
    path = resolve_model_path(cfg.model.name_or_path, cfg.model.revision)
    tokenizer = load_tokenizer(path)
    start = time.perf_counter()
    engine = build_vllm_engine(cfg, path, tokenizer, dtype=vllm_dtype(cfg))
    start_s = time.perf_counter() - start
    print(f"engine on {path} started in {start_s:.1f}s, default seeding: {engine.seeding}", flush=True)
    params = _params(cfg)
    times: dict[str, list[float]] = {"prompt": [], "call": []}
    cpu: dict[str, list[float]] = {"prompt": [], "call": []}  # this process's CPU seconds, all threads
    tokens: dict[str, list[int]] = {"prompt": [], "call": []}
    try:
        for rep in range(args.reps + 1):  # round 0 warms both paths up and is not counted
            prompts = [render_prompt_ids(tokenizer, t, use_chat_template=True) for t in _texts(args.prompts, rep)]
            order = ["prompt", "call"] if rep % 2 else ["call", "prompt"]
            for scheme in order:
                engine.seeding = scheme  # the scheme the engine was built with is "call" here
                cpu_start = time.process_time()
                out = engine.generate(prompts, args.samples, params)
                if rep:
                    cpu[scheme].append(time.process_time() - cpu_start)
                    times[scheme].append(out.stats["rollout/gen_s"])
                    tokens[scheme].append(int(out.stats["rollout/generated_tokens"]))
            if rep:
                print(f"round {rep}: " + ", ".join(f"{s} {times[s][-1]:.3f}s ({cpu[s][-1]:.3f} cpu)" for s in order))
    finally:
        engine.close()
    summary: dict[str, Any] = {
        s: _quartiles(v) | {"cpu_median_s": statistics.median(cpu[s]), "tokens_mean": statistics.mean(tokens[s])}
        for s, v in times.items()
    }
    summary["call_over_prompt_median"] = summary["call"]["median_s"] / summary["prompt"]["median_s"]
    summary["call_over_prompt_cpu_median"] = summary["call"]["cpu_median_s"] / summary["prompt"]["cpu_median_s"]
    return {
        "model": str(path),
        "work": {"prompts": args.prompts, "samples": args.samples, "max_tokens": args.max_tokens},
        "engine_start_s": start_s,
        "summary": summary,
        "gen_s": times,
        "cpu_s": cpu,
        **_versions(),
    }


def _params(cfg: Any) -> Any:
    from posttrain.loop.collect import sampling_params

    return sampling_params(cfg)


def _quartiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median_s": statistics.median(values), "q1_s": q[0], "q3_s": q[2], "n": len(values)}


def _versions() -> dict[str, str]:
    import torch
    import vllm

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "vllm": vllm.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the default recipe's model)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = p.parse_args(argv)
    result = run(args)
    s = result["summary"]
    for scheme in ("prompt", "call"):
        q = s[scheme]
        print(
            f"seeded per {scheme}: median {q['median_s']:.3f}s (q1 {q['q1_s']:.3f}, q3 {q['q3_s']:.3f}), "
            f"process CPU median {q['cpu_median_s']:.3f}s",
            flush=True,
        )
    print(
        f"per call / per prompt (medians): wall {s['call_over_prompt_median']:.2f}, "
        f"CPU {s['call_over_prompt_cpu_median']:.2f}",
        flush=True,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
