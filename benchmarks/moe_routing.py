"""What rollout routing replay (R3) fixes on a sparse-MoE policy: routing mismatch and logprob gap
between the sampler and the trainer, with and without replay.

For sampled completions it reports

* ``routing mismatch``: the share of (position, MoE layer) pairs whose top-k expert SET differs
  between the sampler's routing and the trainer's own forward, and the share of positions where
  any layer differs (over the prompt + completion - 1 positions the sampler ran);
* ``logprob gap``: mean and max |trainer - sampler| logprob over completion tokens, with the
  trainer's forward routing by itself (replay off) and pinned to the sampler's routing (replay on).

Samplers:

* ``--sampler vllm`` on a GPU: vLLM with ``enable_return_routed_experts`` (what the run uses).
* ``--sampler vllm`` on vLLM's CPU build: it returns no routing (its capture needs Model Runner V2,
  which needs Triton), so only the gap without replay is reported.
* ``--sampler hf`` (CPU stand-in): completions are drawn by transformers, then the sampler's
  routing and logprobs come from a forward of each sequence alone in ``--sampler-dtype`` (bf16 by
  default), like a sampler on other kernels; the trainer runs the padded fp32 batch.

Usage (from the repository root)::

    .venv/bin/python benchmarks/moe_routing.py --sampler hf                  # CPU, tiny random MoE
    python benchmarks/moe_routing.py --sampler vllm --model-dir DIR          # GPU, vLLM 0.24
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from posttrain.models.precision import compute_weights, resolve_precision
from posttrain.models.routing_replay import pin_routing, record_routing
from posttrain.models.tiny import make_tiny_moe_model
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.policy.routing import batch_routing
from posttrain.policy.train_batch import RoutingTrace
from posttrain.rollout.base import SamplingParams

TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "smollm2_tokenizer"


def _prompts(n: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(100, vocab, (int(torch.randint(4, 12, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


def _hf_sampler(model_dir: str, prompts: list[list[int]], group: int, max_tokens: int, dtype: str):
    """Completions from transformers; the sampler's routing and logprobs from a forward of each
    sequence alone in ``dtype``."""
    from posttrain.models.loading import load_tokenizer
    from posttrain.rollout.hf_engine import HFRolloutEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = HFRolloutEngine(model, load_tokenizer(model_dir), batch_size=64)
    out = engine.generate(prompts, group, SamplingParams(max_tokens=max_tokens, seed=1))
    sampler = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    seqs, traces, logprobs = [], [], []
    for c in out.completions:
        prompt = out.prompt_token_ids[c.prompt_index]
        with record_routing(sampler) as rec, torch.no_grad():
            logits = sampler(torch.tensor([prompt + c.token_ids])).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        seqs.append((prompt, c.token_ids))
        traces.append(rec[0][:-1])  # the sampler never runs the last sampled token
        logprobs.append(lp)
    return seqs, traces, logprobs


def _vllm_sampler(model_dir: str, prompts: list[list[int]], group: int, max_tokens: int):
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine
    from posttrain.rollout.vllm_runtime import on_cuda

    cuda = on_cuda()
    engine = VLLMRolloutEngine(
        model_dir, dtype="auto" if cuda else "float32", max_model_len=512, return_routed_experts=cuda
    )
    out = engine.generate(prompts, group, SamplingParams(max_tokens=max_tokens, seed=1))
    engine.close()
    seqs = [(out.prompt_token_ids[c.prompt_index], c.token_ids) for c in out.completions]
    traces = [c.extra["routed_experts"].long() for c in out.completions] if cuda else None
    return seqs, traces, [torch.tensor(c.logprobs) for c in out.completions]


def _gap(trainer_BT: torch.Tensor, seqs, sampler) -> tuple[float, float]:
    diffs = torch.cat(
        [(trainer_BT[b, : len(c)].float().cpu() - sampler[b].float()).abs() for b, (_, c) in enumerate(seqs)]
    )
    return float(diffs.mean()), float(diffs.max())


def measure(model_dir: str, seqs, traces, sampler_logprobs, device: str) -> dict[str, float]:
    """The trainer's side: its own routing and logprobs on the padded batch, then pinned. fp32
    weights; on CUDA the forward computes on bf16 copies of them, as a run's default precision does
    (under autocast up to 2026-12-01, when the recorded results were taken)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    prompts, comps = [p for p, _ in seqs], [c for _, c in seqs]
    pb = build_policy_batch(prompts, comps, pad_id=0, device=device)
    precision = resolve_precision("float32", "auto", torch.device(device))
    with compute_weights(model, precision), record_routing(model) as rec, torch.no_grad():
        free_BT = completion_logprobs(model, pb)
    result: dict[str, float] = {}
    result["gap_mean_off"], result["gap_max_off"] = _gap(free_BT, seqs, sampler_logprobs)
    if traces is None:
        return result
    own_NMK = rec[0].cpu()
    differs_pairs, differs_tokens, pairs, tokens = 0, 0, 0, 0
    for b, (p, c) in enumerate(seqs):
        n = len(p) + len(c) - 1
        start = pb.seq_start_B[b]
        own = own_NMK[start : start + n].sort(-1).values
        theirs = traces[b][:n].long().sort(-1).values
        diff_NM = (own != theirs).any(-1)
        differs_pairs += int(diff_NM.sum())
        differs_tokens += int(diff_NM.any(-1).sum())
        pairs, tokens = pairs + diff_NM.numel(), tokens + n
    result["topk_mismatch_pairs"] = differs_pairs / pairs
    result["topk_mismatch_tokens"] = differs_tokens / tokens
    calls = [t.to(device) for t in batch_routing(pb, RoutingTrace(traces), prompts, comps)]
    with compute_weights(model, precision), pin_routing(model, calls), torch.no_grad():
        pinned_BT = completion_logprobs(model, pb)
    result["gap_mean_on"], result["gap_max_on"] = _gap(pinned_BT, seqs, sampler_logprobs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sampler", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--model-dir", help="a sparse-MoE model directory (default: a tiny random Qwen3-MoE)")
    parser.add_argument("--sampler-dtype", default="bfloat16", help="--sampler hf: the sampler forward's dtype")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the random MoE")
    parser.add_argument("--moe-intermediate", type=int, default=32, help="each expert's intermediate size")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    model_dir = args.model_dir or make_tiny_moe_model(
        tempfile.mkdtemp(prefix="moe_routing_"),
        str(TOKENIZER),
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_experts=args.experts,
        top_k=args.top_k,
        moe_intermediate_size=args.moe_intermediate,
    )
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    prompts = _prompts(args.prompts, vocab)
    if args.sampler == "hf":
        seqs, traces, logprobs = _hf_sampler(model_dir, prompts, args.group, args.max_tokens, args.sampler_dtype)
        where = f"transformers {args.sampler_dtype} forward per sequence (stand-in sampler)"
    else:
        seqs, traces, logprobs = _vllm_sampler(model_dir, prompts, args.group, args.max_tokens)
        where = "vLLM" + ("" if traces is not None else " CPU build (returns no routing: replay not measurable)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    r = measure(model_dir, seqs, traces, logprobs, device)
    tokens = sum(len(c) for _, c in seqs)
    compute = "fp32 weights read as bf16 copies" if device == "cuda" else "fp32"
    print(f"sampler: {where}; trainer: {compute}, padded batch on {device}; {len(seqs)} completions, {tokens} tokens")
    print("| replay | top-k differs (pos x layer) | top-k differs (positions) | logprob gap mean | logprob gap max |")
    print("|---|---|---|---|---|")
    mism = (
        (f"{r['topk_mismatch_pairs']:.2%}", f"{r['topk_mismatch_tokens']:.2%}")
        if "topk_mismatch_pairs" in r
        else ("n/a", "n/a")
    )
    print(f"| off | {mism[0]} | {mism[1]} | {r['gap_mean_off']:.3g} | {r['gap_max_off']:.3g} |")
    if "gap_mean_on" in r:
        print(f"| on | 0 (pinned) | 0 (pinned) | {r['gap_mean_on']:.3g} | {r['gap_max_on']:.3g} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"sampler": where, "device": device, **r}, indent=2))


if __name__ == "__main__":
    main()
