"""Where vLLM's generation time goes on issue 9's workload: one engine, request variants, timed.

    python benchmarks/vllm_gen_variants.py --model /tmp/m05 [--multiprocessing] [--out variants.json]

256 sequences (32 prompts x 8) of 256 tokens at temperature 1, as posttrain's engine asks for them
(``detokenize=False``), varying one thing at a time: a seed per request (posttrain seeds every
prompt's stream so a resumed run samples what the uninterrupted one did) or none, the sampled token's
logprob or none, and Python's garbage collector on, off or frozen while a large heap of Python
objects (like a trainer process holds) is alive. Each variant runs three times; the median counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--multiprocessing", action="store_true", help="vLLM's engine core in its own process")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--heap", type=int, default=3_000_000, help="Python objects kept alive for the gc variants")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.multiprocessing else "0"
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(a.model)
    import random

    rng = random.Random(0)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}? Think step by step."}],
            add_generation_prompt=True, tokenize=False)
        for _ in range(a.prompts)
    ]  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    import torch

    cuda = {"attention_backend": "FLASH_ATTN", "dtype": "bfloat16"} if torch.cuda.is_available() else {}
    llm = LLM(model=a.model, gpu_memory_utilization=0.3, max_model_len=1024, seed=0,
              logprobs_mode="raw_logprobs", **cuda)  # fmt: skip

    def params(seeded: bool, logprobs: bool) -> list[SamplingParams]:
        return [SamplingParams(n=8, max_tokens=a.tokens, temperature=1.0, detokenize=False,
                               logprobs=0 if logprobs else None, seed=1000 + i if seeded else None)
                for i in range(len(prompts))]  # fmt: skip

    def timed(seeded: bool, logprobs: bool, reps: int = 3) -> dict[str, float]:
        times, tokens = [], 0
        for _ in range(reps):
            start = time.perf_counter()
            outs = llm.generate(prompts, params(seeded, logprobs), use_tqdm=False)
            times.append(time.perf_counter() - start)
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        med = statistics.median(times)
        return {"median_s": round(med, 3), "all_s": [round(t, 3) for t in times], "tok_per_s": round(tokens / med)}

    llm.generate(prompts[:2], params(False, False)[:2], use_tqdm=False)  # warm-up
    res: dict[str, object] = {"multiprocessing": a.multiprocessing}
    for name, seeded, logprobs in [("seeded+logprobs (posttrain)", True, True), ("seeded", True, False),
                                   ("logprobs", False, True), ("neither", False, False)]:  # fmt: skip
        res[name] = timed(seeded, logprobs)
        print("RESULT", name, res[name], flush=True)
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
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
