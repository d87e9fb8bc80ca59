"""What posttrain's vLLM requests cost the engine's host side: seeds and sampler logprobs, timed
through posttrain's own engine (``VLLMRolloutEngine.generate``, the rollout's exact call).

    python benchmarks/vllm_request_costs.py --model DIR [--prompts 32 --samples 8 --tokens 256] [--out F.json]

Variants, one thing at a time: a seed per prompt or none; the sampled token's logprob recorded for
every sample, for the first of each prompt's group (``rollout.sampler_logprobs_samples=1``) or for
none (``rollout.sampler_logprobs_every=0``). Each runs ``--reps`` times after a warm-up, the variants
interleaved; the median counts. On a GPU the engine is host-bound at issue 9's workload (docs/benchmarks.md); on a CPU a
tiny model (``--tiny``: 2 layers, hidden 64, built here) keeps the model's compute small enough that
the same host-side costs show.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

VARIANTS = [
    ("seed per prompt, logprobs of every sample (the default before)", True, "all"),
    ("seed per prompt, logprobs of the first sample", True, "first"),
    ("seed per prompt, no logprobs", True, "none"),
    ("no seed, logprobs of every sample", False, "all"),
    ("no seed, logprobs of the first sample", False, "first"),
    ("no seed, no logprobs", False, "none"),
]


def _params(seeded: bool, logprobs: str, tokens: int) -> Any:
    from posttrain.rollout.base import SamplingParams

    return SamplingParams(
        max_tokens=tokens,
        temperature=1.0,
        seed=0 if seeded else None,
        sampler_logprobs_every=0 if logprobs == "none" else 1,
        sampler_logprobs_samples=1 if logprobs == "first" else None,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model directory (default with --tiny: one built here)")
    p.add_argument("--tiny", action="store_true", help="build a 2-layer, 64-wide random model on the SmolLM2 tokenizer")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import torch
    from transformers import AutoTokenizer

    from posttrain.models.chat import render_prompt_ids
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    model_dir = a.model
    if a.tiny:
        from posttrain.models.tiny import make_tiny_model

        model_dir = make_tiny_model("/tmp/vllm_request_costs_tiny", "tests/fixtures/smollm2_tokenizer", num_heads=2,
                                    num_kv_heads=1, seed=3)  # fmt: skip
    if model_dir is None:
        p.error("--model or --tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    texts = [f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}? Think step by step." for _ in range(a.prompts)]
    prompts = [render_prompt_ids(tokenizer, t, use_chat_template=True) for t in texts]
    gpu = torch.cuda.is_available()
    engine = VLLMRolloutEngine(
        model_dir, tokenizer, temperature=1.0, seed=0, gpu_memory_utilization=0.3, max_model_len=a.tokens + 128,
        dtype="bfloat16" if gpu else "float32", enforce_eager=not gpu,
    )  # fmt: skip
    engine.generate(prompts[:2], 2, _params(True, "all", 8))  # warm-up
    results: dict[str, Any] = {"model": model_dir, "device": "cuda" if gpu else "cpu", "prompts": a.prompts,
                               "samples": a.samples, "tokens": a.tokens}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name, _, _ in VARIANTS}
    tokens: dict[str, int] = {}
    try:
        for _ in range(a.reps):  # the variants interleaved, so a drift in the machine's load hits each alike
            for name, seeded, logprobs in VARIANTS:
                start = time.perf_counter()
                out = engine.generate(prompts, a.samples, _params(seeded, logprobs, a.tokens))
                times[name].append(time.perf_counter() - start)
                tokens[name] = sum(len(c.token_ids) for c in out.completions)
        for name, _, _ in VARIANTS:
            med = statistics.median(times[name])
            results[name] = {"median_s": round(med, 3), "all_s": [round(t, 3) for t in times[name]],
                             "tokens": tokens[name], "tok_per_s": round(tokens[name] / med)}  # fmt: skip
            print(f"| {name} | {med:.3f} s | {tokens[name] / med:,.0f} |", flush=True)
    finally:
        engine.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
