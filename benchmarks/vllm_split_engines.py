"""W's generation split over K vLLM engines in K processes sharing one GPU: does the host-bound decode
go faster when K schedulers share the work?

    python benchmarks/vllm_split_engines.py --model /tmp/m05 [--engines 1,2] [--rounds 3] [--out r.json]

On one H100 the whole of W's generation (32 prompts x 8 samples x 256 tokens) takes 1.07-1.20 s
in one engine, at about 4.2 ms per decode step for 256 running requests, most of it vLLM's scheduler
and KV-cache bookkeeping on the host (docs/benchmarks.md, twenty-seventh session), while the GPU's
work per step is a fraction of that. K engines, each in its own process with its own scheduler, each
given 32/K of the prompts, run their host work in parallel on the host's other cores and share the GPU.

For each K the engines start one after another (vLLM sizes its memory from what is free when it
starts; each takes ``0.3 / K`` of the GPU), warm up, then run ``--rounds`` rounds: all start together
at a barrier, each generates its prompts as posttrain asks (a seed per prompt; each group's first
sample's logprob, ``rollout.sampler_logprobs_samples=auto``), and the round's time is the parent's from
the barrier to the last engine's end. Each engine is in-process in its worker
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one process, one scheduler. ``--unseeded`` drops the seeds, for
vLLM's CPU build (which fails on seeded requests whose prefill spans steps), where this script was
checked on a tiny model.

On one H100 (2026-12-06, ``results/split28_h100_2026-12-06/``): one engine 1.26-1.40 s, two engines
0.90-0.91 s, four 1.46 s (docs/benchmarks.md, twenty-eighth session).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

PROMPTS = 32
SAMPLES = 8
BARRIER_S = 300.0  # a round's longest wait: a worker that died leaves the others at the barrier


def _requests(tok: Any, tokens: int, first: int, count: int, seeded: bool) -> tuple[list[Any], list[Any]]:
    """Prompts ``first .. first + count - 1`` of W's 32, each sent as its first sample (logprob
    recorded) and its other seven (none), seeded per prompt as posttrain seeds them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_gen_variants import w_prompt_ids  # this directory's: the same prompts as its variants

    all_ids = w_prompt_ids(tok, PROMPTS)
    prompts, params = [], []
    for i in range(first, first + count):
        prompt = TokensPrompt(prompt_token_ids=all_ids[i])
        for is_first, n in ((True, 1), (False, SAMPLES - 1)):
            prompts.append(prompt)
            params.append(
                SamplingParams(
                    n=n, max_tokens=tokens, temperature=1.0, detokenize=False,
                    logprobs=0 if is_first else None, seed=1000 + 2 * i + (0 if is_first else 1) if seeded else None,
                )
            )  # fmt: skip
    return prompts, params


def _worker(rank: int, engines: int, args: dict[str, Any], ready: Any, barrier: Any, results: Any) -> None:  # noqa: PLR0917
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM

    tok = AutoTokenizer.from_pretrained(args["model"])
    cuda = {"attention_backend": "FLASH_ATTN", "dtype": "bfloat16"} if torch.cuda.is_available() else {}
    llm = LLM(
        model=args["model"], gpu_memory_utilization=0.3 / engines, max_model_len=1024, seed=0,
        logprobs_mode="raw_logprobs", **cuda,
    )  # fmt: skip
    per = PROMPTS // engines
    prompts, params = _requests(tok, args["tokens"], rank * per, per, args["seeded"])
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    ready.put(rank)
    times = []
    for _ in range(args["rounds"]):
        barrier.wait(timeout=BARRIER_S)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        barrier.wait(timeout=BARRIER_S)
    results.put({"rank": rank, "times": times, "tokens": tokens})


def _wait_ready(ready: Any, proc: Any, limit_s: float = 400.0) -> None:
    """Until ``proc``'s engine reports ready; a worker that died on the way fails the run at once."""
    import queue

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            ready.get(timeout=2)
            return
        except queue.Empty:
            if not proc.is_alive():
                raise SystemExit(f"an engine's worker exited with code {proc.exitcode} before it was ready") from None
    raise SystemExit(f"an engine was not ready within {limit_s:.0f} s")


def run(engines: int, args: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    barrier = ctx.Barrier(engines + 1)
    procs = []
    for rank in range(engines):  # one at a time: each sizes its memory from what the others left
        proc = ctx.Process(target=_worker, args=(rank, engines, args, ready, barrier, results))
        proc.start()
        procs.append(proc)
        _wait_ready(ready, proc)
    rounds = []
    for _ in range(args["rounds"]):  # a worker that fails breaks the barrier here within BARRIER_S
        barrier.wait(timeout=BARRIER_S)
        start = time.perf_counter()
        barrier.wait(timeout=BARRIER_S)
        rounds.append(time.perf_counter() - start)
    per_engine = sorted((results.get(timeout=60) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(timeout=120)
    tokens = sum(r["tokens"] for r in per_engine)
    med = statistics.median(rounds)
    return {
        "engines": engines,
        "round_s": [round(t, 3) for t in rounds],
        "median_s": round(med, 3),
        "tok_per_s": round(tokens / med),
        "engine_s": [[round(t, 3) for t in r["times"]] for r in per_engine],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--engines", default="1,2", help="comma-separated engine counts, each a divisor of 32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--unseeded",
        action="store_true",
        help="no seeds (vLLM's CPU build fails on seeded requests whose prefill spans steps; docs/vllm.md)",
    )
    a = p.parse_args()
    args = {"model": a.model, "rounds": a.rounds, "tokens": a.tokens, "seeded": not a.unseeded}
    res = []
    for engines in (int(k) for k in a.engines.split(",")):
        res.append(run(engines, args))
        print("RESULT", json.dumps(res[-1]), flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
