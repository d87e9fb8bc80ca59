"""What vLLM's flat logprobs save on the host: a rollout call's sampled-token logprobs and a teacher
call's prompt logprobs, each as the per-token dicts posttrain asked for before and as the flat
lists it asks for now, read back the way posttrain reads each.

    python benchmarks/vllm_flat_logprobs.py [--prompts 32 --samples 8 --tokens 256 --reps 5] [--out F.json]
    python benchmarks/vllm_flat_logprobs.py --model /tmp/m05 --dtype bfloat16 ...   # a GPU, W's model

Score centering's arms ask for a top-``--head-k`` head per token on ``--head-tokens``-token
completions. The model is a 2-layer, 128-wide random Llama with a 512-token vocabulary and no
tokenizer (``skip_tokenizer_init``): on vLLM's CPU build its compute is small, so, as on a GPU at
workload W (docs/benchmarks.md), the host's per-token work decides the call's time.

Arms, interleaved, the median of ``--reps`` after a warm-up: rollout without logprobs (a seed per
prompt, as posttrain sends them, and unseeded), with dict logprobs (+ the reading posttrain did
before: the sampled id's entry per token), with flat logprobs (+ ``completion_of``), with flat
logprobs for each group's first sample only (``rollout.sampler_logprobs_samples=1``'s two requests
per prompt); teacher scoring (``prompt_logprobs=K``, ``--teacher-k``) with dict entries (+ the rank sort posttrain did
before) and flat ones (+ ``_flat_scores``). Each reports the wall time, the process's CPU time, and
the garbage collector's passes and time during the call (``gc.callbacks``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from gc_clock import GcClock  # this script's directory (sys.path[0])


def build_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def read_dicts_before(outputs: list[Any], k: int = 0) -> int:
    """posttrain's reading of dict logprobs before flat ones: the sampled id's entry per token, and
    with ``k`` the top-k head by a rank sort of each token's dict."""
    n = 0
    for out in outputs:
        for sample in out.outputs:
            lps = [float(entry[t].logprob) for t, entry in zip(sample.token_ids, sample.logprobs)]
            if k:
                for entry in sample.logprobs:
                    ranked = sorted(entry.items(), key=lambda item: (item[1].rank, -item[1].logprob))[:k]
                    _ = [int(i) for i, _ in ranked], [float(lp.logprob) for _, lp in ranked]
            n += len(lps)
    return n


def read_teacher_dicts_before(outputs: list[Any], prompts: list[list[int]], k: int) -> int:
    """The vLLM teacher's reading of dict prompt logprobs before flat ones (a rank sort per position)."""
    n = 0
    for out, ids in zip(outputs, prompts):
        for i in range(1, len(ids)):
            entry = out.prompt_logprobs[i]
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None)
            head = [(t, lp) for rank, t, lp in ranked if rank <= k][:k]
            _ = float(entry[ids[i]].logprob), [int(t) for t, _ in head], [float(v) for _, v in head]
            n += 1
    return n


def run_arms(arms: dict[str, Any], reps: int) -> tuple[dict[str, dict[str, float]], dict[str, list[dict[str, float]]]]:
    """Each arm ``reps`` times after a warm-up round, interleaved; the medians, printed, and every sample."""
    clock = GcClock()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    for rep in range(reps + 1):
        for name, arm in arms.items():
            clock.take()
            wall, cpu = time.perf_counter(), time.process_time()
            outputs, read = arm()
            generated = time.perf_counter()
            read(outputs)
            done = time.perf_counter()
            gc_s, gc_passes = clock.take()
            row = {
                "call_s": generated - wall, "read_s": done - generated, "total_s": done - wall,
                "cpu_s": time.process_time() - cpu, "gc_passes": gc_passes, "gc_s": gc_s,
            }  # fmt: skip
            del outputs
            if rep > 0:  # the first round warms up
                samples[name].append(row)
    medians = {
        name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for name, rows in samples.items()
    }
    width = max(len(n) for n in medians)
    print(f"{'arm':<{width}}  total_s  call_s  read_s  cpu_s  gc_passes  gc_s")
    for name, m in medians.items():
        print(
            f"{name:<{width}}  {m['total_s']:7.3f}  {m['call_s']:6.3f}  {m['read_s']:6.3f}  {m['cpu_s']:5.2f}  "
            f"{m['gc_passes']:9.0f}  {m['gc_s']:.3f}"
        )
    return medians, samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--head-k", type=int, default=128, help="score centering's head (rl.score_centering.top_k)")
    p.add_argument("--head-tokens", type=int, default=32, help="completion length of the head arms")
    p.add_argument("--teacher-seqs", type=int, default=64)
    p.add_argument("--teacher-len", type=int, default=512)
    p.add_argument("--teacher-k", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--model-dir", default="/tmp/posttrain_flat_logprobs_model", help="where the tiny model is built")
    p.add_argument("--model", default=None, help="an HF model directory instead of the tiny model (W's on a GPU)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--only", default=None, help="run only the arms whose name starts with this (e.g. 'rollout, ')")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # posttrain's default: engine core in-process
    model = Path(a.model or a.model_dir)
    if a.model is None and not (model / "config.json").exists():
        build_model(model)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from posttrain.rollout.vllm_requests import completion_of
    from posttrain.rollout.vllm_runtime import cuda_attention_backend
    from posttrain.teacher.base import ScoreRequest
    from posttrain.teacher.vllm_teacher import _flat_scores

    llm = LLM(
        str(model), skip_tokenizer_init=True, dtype=a.dtype, max_model_len=2048, seed=0,
        enforce_eager=not torch.cuda.is_available(),
        max_num_seqs=max(256, a.prompts * a.samples), max_num_batched_tokens=16384, max_logprobs=max(20, a.head_k),
        **(cuda_attention_backend("auto", a.dtype) if torch.cuda.is_available() else {}),
    )  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 500 + 1 for j in range(32)]) for i in range(a.prompts)]
    seqs = [[(13 * i + 5 * j) % 500 + 1 for j in range(a.teacher_len)] for i in range(a.teacher_seqs)]

    def rollout(logprobs: str, k: int = 0, seeded: bool = True) -> list[Any]:
        tokens = a.head_tokens if k else a.tokens
        kw: dict[str, Any] = dict(n=a.samples, max_tokens=tokens, min_tokens=tokens, temperature=1.0)
        kw |= dict(detokenize=False, ignore_eos=True)
        if logprobs != "none":
            kw |= dict(logprobs=k, flat_logprobs=logprobs == "flat")
        params = [SamplingParams(seed=i if seeded else None, **kw) for i in range(a.prompts)]
        return llm.generate(prompts, params, use_tqdm=False)

    def rollout_first_records() -> list[Any]:
        """As ``rollout.sampler_logprobs_samples=1`` sends them (``vllm_requests.call_requests``): each
        prompt's group as two requests, its first sample with flat logprobs, the others without."""
        kw: dict[str, Any] = dict(
            max_tokens=a.tokens, min_tokens=a.tokens, temperature=1.0, detokenize=False, ignore_eos=True
        )
        params = []
        for i in range(a.prompts):
            params += [SamplingParams(n=1, seed=i, logprobs=0, flat_logprobs=True, **kw)]
            params += [SamplingParams(n=a.samples - 1, seed=i + 1, **kw)]
        return llm.generate([p for p in prompts for _ in range(2)], params, use_tqdm=False)

    def read_rollout(outputs: list[Any], k: int = 0) -> int:
        return sum(len(completion_of(0, s, k, True).logprobs or []) for out in outputs for s in out.outputs)

    def teacher(flat: bool) -> list[Any]:
        params = SamplingParams(
            max_tokens=1, temperature=1.0, prompt_logprobs=a.teacher_k, flat_logprobs=flat, detokenize=False
        )
        return llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)

    def read_teacher(outputs: list[Any]) -> int:
        reqs = [ScoreRequest(token_ids=s, score_from=1) for s in seqs]
        return sum(
            len(_flat_scores(o.prompt_logprobs, r, a.teacher_k, i).logprobs)
            for i, (o, r) in enumerate(zip(outputs, reqs))
        )

    arms: dict[str, Any] = {
        "rollout, no logprobs": lambda: (rollout("none"), lambda outs: 0),
        "rollout, no logprobs, unseeded": lambda: (rollout("none", seeded=False), lambda outs: 0),
        "rollout, dict logprobs (before)": lambda: (rollout("dict"), read_dicts_before),
        "rollout, flat logprobs (now)": lambda: (rollout("flat"), read_rollout),
        "rollout, flat logprobs, first sample only": lambda: (
            rollout_first_records(),
            lambda outs: sum(  # the outputs alternate: a prompt's recording request, then its other one
                len(completion_of(0, s, 0, j % 2 == 0).logprobs or [])
                for j, out in enumerate(outs)
                for s in out.outputs
            ),
        ),
        f"rollout, head of {a.head_k}, dicts (before)": lambda: (
            rollout("dict", a.head_k),
            lambda outs: read_dicts_before(outs, a.head_k),
        ),
        f"rollout, head of {a.head_k}, flat (now)": lambda: (
            rollout("flat", a.head_k),
            lambda outs: read_rollout(outs, a.head_k),
        ),
        f"teacher, prompt_logprobs={a.teacher_k}, dicts (before)": lambda: (
            teacher(False),
            lambda outs: read_teacher_dicts_before(outs, seqs, a.teacher_k),
        ),
        f"teacher, prompt_logprobs={a.teacher_k}, flat (now)": lambda: (teacher(True), read_teacher),
    }
    if a.only:
        arms = {name: arm for name, arm in arms.items() if name.startswith(a.only)}
    medians, samples = run_arms(arms, a.reps)
    if a.out:
        import vllm

        meta = {
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "host": platform.node(),
            "cpus": os.cpu_count(), "vllm": vllm.__version__, "args": vars(a),
        }  # fmt: skip
        Path(a.out).write_text(json.dumps({"meta": meta, "medians": medians, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
