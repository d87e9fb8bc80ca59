"""Where vLLM's generation time goes on issue 9's workload: one engine, request variants, timed.

    python benchmarks/vllm_gen_variants.py --model /tmp/m05 [--multiprocessing] [--no-gc] [--out variants.json]

256 sequences (32 prompts x 8) of 256 tokens at temperature 1, as posttrain's engine asks for them
(``detokenize=False``), varying one thing at a time: a seed per request (posttrain seeds every
prompt's stream so a resumed run samples what the uninterrupted one did) or none, the sampled token's
logprob or none, and Python's garbage collector on, off or frozen while a large heap of Python
objects (like a trainer process holds) is alive. Each variant runs three times; the median counts.
"seeded+first sample's logprobs" is what posttrain sends by default since the twenty-first session
(``rollout.sampler_logprobs_samples=auto``: a prompt's first sample records, its other seven go as a
second request). ``VLLM_USE_V2_MODEL_RUNNER=0`` in the environment runs vLLM's V1 model runner instead
of its V2 one (vLLM 0.24's default for a Llama; side_by_side.sh part ``runners27`` times both).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--multiprocessing", action="store_true", help="vLLM's engine core in its own process")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--heap", type=int, default=3_000_000, help="Python objects kept alive for the gc variants")
    p.add_argument("--out", default=None)
    p.add_argument("--no-gc", action="store_true", help="leave out the garbage-collector variants")
    p.add_argument(
        "--greedy-out", default=None, help="also write the prompts' greedy 64-token completions (ids, logprobs) here"
    )
    p.add_argument("--only", default=None, help="comma-separated request variants to run (by name prefix)")
    p.add_argument(
        "--engine-arg", action="append", default=[], help="KEY=VALUE for vllm.LLM (a Python literal), repeatable"
    )
    a = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.multiprocessing else "0"
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in w_prompt_ids(tok, a.prompts)]
    import torch

    cuda = {"attention_backend": "FLASH_ATTN", "dtype": "bfloat16"} if torch.cuda.is_available() else {}
    llm = LLM(model=a.model, gpu_memory_utilization=0.3, max_model_len=1024, seed=0,
              logprobs_mode="raw_logprobs", **cuda, **engine_args(a.engine_arg))  # fmt: skip

    def params(seeded: bool, logprobs: bool | str) -> list[SamplingParams]:
        if logprobs == "first":  # posttrain's default since the twenty-first session: each group's first sample
            return [SamplingParams(n=n, max_tokens=a.tokens, temperature=1.0, detokenize=False,
                                   logprobs=0 if first else None,
                                   seed=1000 + i + (0 if first else 1) if seeded else None)
                    for i in range(len(prompts)) for first, n in ((True, 1), (False, 7))]  # fmt: skip
        return [SamplingParams(n=8, max_tokens=a.tokens, temperature=1.0, detokenize=False,
                               logprobs=0 if logprobs else None, seed=1000 + i if seeded else None)
                for i in range(len(prompts))]  # fmt: skip

    def timed(seeded: bool, logprobs: bool | str, reps: int = 3) -> dict[str, float]:
        times, tokens = [], 0
        sent = [p for p in prompts for _ in range(2)] if logprobs == "first" else prompts
        for _ in range(reps):
            start = time.perf_counter()
            outs = llm.generate(sent, params(seeded, logprobs), use_tqdm=False)
            times.append(time.perf_counter() - start)
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        med = statistics.median(times)
        return {"median_s": round(med, 3), "all_s": [round(t, 3) for t in times], "tok_per_s": round(tokens / med)}

    llm.generate(prompts[:2], params(False, False)[:2], use_tqdm=False)  # warm-up
    res: dict[str, object] = {
        "multiprocessing": a.multiprocessing,
        "v2_model_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "vLLM's default"),
    }
    variants: list[tuple[str, bool, bool | str]] = [
        ("seeded+first sample's logprobs (posttrain now)", True, "first"), ("seeded+logprobs", True, True),
        ("seeded", True, False), ("logprobs", False, True), ("neither", False, False)]  # fmt: skip
    if a.only:
        variants = [v for v in variants if any(v[0].startswith(o) for o in a.only.split(","))]
    res["engine_args"] = engine_args(a.engine_arg)
    for name, seeded, logprobs in variants:
        res[name] = timed(seeded, logprobs)
        print("RESULT", name, res[name], flush=True)
    if a.greedy_out:  # to compare two engines' numerics (model runners) on the same weights
        write_greedy(llm, prompts, a.greedy_out)
    if a.no_gc:
        _write(res, a.out)
        return
    junk = [{"i": i, "s": str(i)} for i in range(a.heap)]  # a trainer-sized heap of Python objects
    res["heap, gc on"] = timed(True, True)
    print("RESULT heap gc on", res["heap, gc on"], flush=True)
    gc.disable()
    res["heap, gc off"] = timed(True, True)
    print("RESULT heap gc off", res["heap, gc off"], flush=True)
    gc.enable()
    gc.freeze()
    res["heap, gc frozen"] = timed(True, True)
    print("RESULT heap gc frozen", res["heap, gc frozen"], flush=True)
    del junk
    _write(res, a.out)


def w_prompt_ids(tok: Any, count: int) -> list[list[int]]:
    """Workload W's first ``count`` prompts (arithmetic questions in the model's chat template), as token ids."""
    import random

    rng = random.Random(0)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}? Think step by step."}],
            add_generation_prompt=True, tokenize=False)
        for _ in range(count)
    ]  # fmt: skip
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def write_greedy(llm: Any, prompts: list[Any], path: str) -> None:
    """The prompts' greedy 64-token completions, their ids and the sampled tokens' logprobs, as JSON."""
    from vllm import SamplingParams

    greedy = SamplingParams(n=1, max_tokens=64, temperature=0.0, detokenize=False, logprobs=0)
    samples = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    with open(path, "w") as f:
        json.dump(
            {
                "token_ids": [list(c.token_ids) for c in samples],
                "logprobs": [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] for c in samples],
            },
            f,
        )


def engine_args(pairs: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` strings as ``vllm.LLM`` keyword arguments (values read as Python literals)."""
    import ast

    return {key: ast.literal_eval(value) for key, _, value in (pair.partition("=") for pair in pairs)}


def _write(res: dict[str, object], out: str | None) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
