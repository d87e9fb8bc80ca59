"""Weight sync to a vLLM engine: full weights (``load_weights``) against a LoRA adapter (``AdapterSync``).

Two vLLM engines, one after the other, each as its kind of run builds it: an engine WITHOUT LoRA
receives the policy's full state dict (what a full fine-tuning run sends after every optimizer
step), and is closed; then an engine built with LoRA enabled receives the adapters of LoRA policies
of several ranks (what a ``model.lora`` run sends: the adapter written in peft's format, loaded as a
new LoRA request, the previous one removed). A LoRA run never reloads full weights into its engine,
and vLLM 0.24's GPU loader cannot (reloading a full state dict into a LoRA-enabled Llama engine
raised ``KeyError: 'embed_tokens.weight'``: the LoRA wrapper renames the modules it resolves), so
the full-weight arm has an engine of its own. Each sync is repeated and the median reported, with
the bytes moved and the times of two short generations after the last sync (the first includes any
lazy load of the adapter; the full-weight engine samples without LoRA kernels at all). Prints a
markdown table (``--out`` also writes it to a file).

    .venv/bin/python benchmarks/lora_sync.py                      # SmolLM2-135M, CPU (fp32)
    .venv/bin/python benchmarks/lora_sync.py --ranks 16 64 --model DIR --dtype bfloat16   # on a GPU

Results: benchmarks/lora.md.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch


def _policy(model_dir: str, rank: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from posttrain.config.lora import LoraConfig
    from posttrain.models.lora import apply_lora

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    policy = apply_lora(base, LoraConfig(rank=rank, alpha=2.0 * rank))
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_" in name:  # as after some training (B is zero at initialisation)
                p.copy_((0.01 * torch.randn(p.shape, generator=gen)).to(p.device, p.dtype))
    return policy.eval()


def _generate_s(engine, prompts: list[list[int]]) -> float:
    from posttrain.rollout.base import SamplingParams

    start = time.perf_counter()
    engine.generate(prompts, 4, SamplingParams(max_tokens=16, temperature=1.0, seed=0))
    return time.perf_counter() - start


def _engine(model_dir: str, dtype: str, lora_rank: int):
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(model_dir, dtype=dtype, enforce_eager=True, max_model_len=512, lora_rank=lora_rank)


def _close(engine) -> None:
    """Shut ``engine`` down and give its memory back before the next engine is built."""
    engine.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(model_dir: str, ranks: list[int], repeats: int, dtype: str, device: str) -> list[dict[str, object]]:
    """One row per transfer kind: median sync seconds, MB moved, generate seconds right after the
    last sync (each row is also printed as soon as it is measured)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.distributed.fsdp import PolicyWeights
    from posttrain.models.chat import render_prompt_ids

    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [render_prompt_ids(tokenizer, f"What is {a} + 7?", use_chat_template=True) for a in range(4)]
    rows: list[dict[str, object]] = []

    def record(engine, what: str, syncs: list[float], mb: float) -> None:
        first = _generate_s(engine, prompts)  # includes any lazy load of what was just synced
        row = {"what": what, "sync_s": statistics.median(syncs), "mb": mb, "gen_first_s": first}
        rows.append({**row, "gen_s": _generate_s(engine, prompts)})
        print(rows[-1], flush=True)

    engine = _engine(model_dir, dtype, lora_rank=0)  # what a full fine-tuning run builds
    try:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device)
        full = {k: v.detach() for k, v in base.state_dict().items()}
        syncs = []
        for version in range(1, repeats + 1):
            engine.load_weights(full, version)
            syncs.append(engine.last_sync_s)
        record(
            engine,
            "full weights (engine without LoRA)",
            syncs,
            sum(t.numel() * t.element_size() for t in full.values()) / 2**20,
        )
        del base, full
    finally:
        _close(engine)
    engine = _engine(model_dir, dtype, lora_rank=max(ranks))  # what a model.lora run builds
    try:
        version = 0
        for rank in ranks:
            policy = _policy(model_dir, rank, torch_dtype, device)
            syncs = []
            for _ in range(repeats):
                version += 1
                engine.receive_weights(PolicyWeights(policy), version)
                syncs.append(engine.last_sync_s)
            assert engine._adapters is not None
            record(engine, f"LoRA adapter, rank {rank}", syncs, engine._adapters.last_bytes / 2**20)
    finally:
        _close(engine)
    return rows


def table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| transfer | sync (median) | moved | generate right after (16 x 16 tokens) | generate again |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['what']} | {r['sync_s']:.3f} s | {r['mb']:.1f} MB | {r['gen_first_s']:.2f} s | {r['gen_s']:.2f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct", help="model directory or name")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="float32 on CPU; bfloat16 on a GPU")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    from posttrain.models.loading import resolve_model_path

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = resolve_model_path(args.model)
    text = table(measure(model_dir, args.ranks, args.repeats, args.dtype, device))
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
