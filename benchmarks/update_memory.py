"""Peak GPU memory and time of posttrain's policy update, by model shape and precision.

    python benchmarks/update_memory.py --shape 1.5b --dtype float32 --ac --out $OUT/mem.json
    python benchmarks/update_memory.py --sweep --out-dir $OUT      # the table of docs/gpu.md

One measurement builds a random-weight Llama of a named shape (``make_random_model.SHAPES``, the
SmolLM2 tokenizer's 49,152-token vocabulary) straight on the device in the parameter dtype, wraps it
in posttrain's ``PolicyTrainer`` exactly as a run does (``model.dtype``; ``model.compute_dtype=auto``,
so fp32 parameters compute in bf16 on CUDA; AdamW), and runs ``--steps`` updates of a GRPO batch
with random tokens and advantages: ``--seqs`` sequences of ``--prompt-len`` + ``--completion-len``
tokens in micro-batches of ``--micro-batch``. ``--ac`` turns on activation checkpointing the way
``model.gradient_checkpointing`` does. Reported: ``torch.cuda.max_memory_allocated`` over the
updates (weights, gradients, optimizer state, activations, the autocast weight casts) and the
median update time.

``--lora-rank R`` wraps the model in LoRA adapters of rank R on every linear layer
(``model.lora``, peft) before the trainer is built; ``--lora-sweep`` compares full fine-tuning of
the 1.5B shape with ranks 16 and 64.

``--sweep`` runs each configuration in a subprocess of its own (a clean allocator each time, and an
out-of-memory failure is one row, not the end of the sweep): the 1.5B shape in four settings
(bf16 or fp32 parameters, with and without activation checkpointing), then the larger shapes of
the family in the default GPU precision with activation checkpointing until one does not fit.
On one GPU there is one policy rank, so FSDP2 shards nothing: ``grid`` FSDP2 over one rank holds
the same bytes as the plain module, and the largest model found here is the one-GPU limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_random_model import SHAPES

TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "smollm2_tokenizer"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.config.schema import GRPOConfig
    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer, TrainBatch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mcfg = LlamaConfig.from_pretrained(TOKENIZER)
    for key, value in SHAPES[args.shape].items():
        setattr(mcfg, key, value)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    with torch.device(device):
        model = LlamaForCausalLM(mcfg).to(dtype)
    if args.ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(p.numel() for p in model.parameters())
    cfg = GRPOConfig()
    if args.lora_rank:
        from posttrain.models.lora import apply_lora

        cfg.model.lora.rank = args.lora_rank
        cfg.model.lora.alpha = 2.0 * args.lora_rank
        model = apply_lora(model, cfg.model.lora)
    build_s = time.perf_counter() - t0
    cfg.model.dtype = args.dtype
    cfg.model.gradient_checkpointing = args.ac
    cfg.rl.group_size = 8
    cfg.rl.batch_per_replica = args.seqs
    cfg.rl.micro_batch_per_replica = args.micro_batch
    cfg.rl.kl_beta = 0.0
    cfg.rl.optimizer.lr = 1e-6
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=0)
    gen = torch.Generator().manual_seed(0)
    vocab = mcfg.vocab_size
    rows: list[dict[str, float]] = []
    for step in range(1, args.steps + 1):
        # one prompt per group of 8, like a GRPO batch (the shared-prefix forward may use it)
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.seqs // 8)]
        batch = TrainBatch(
            prompt_ids=[prompts[i // 8] for i in range(args.seqs)],
            completion_ids=[
                torch.randint(0, vocab, (args.completion_len,), generator=gen).tolist() for _ in range(args.seqs)
            ],
            advantages_B=torch.randn(args.seqs, generator=gen),
            in_loss_B=torch.ones(args.seqs, dtype=torch.bool),
            sampler_logprobs=[None] * args.seqs,
            group_size=8,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        trainer.train_on(batch, step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append(
            {
                "update_s": time.perf_counter() - t0,
                "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
            }
        )
        print(
            f"step {step}: update {rows[-1]['update_s']:.2f} s, peak {rows[-1]['peak_alloc_gib']:.1f} GiB", flush=True
        )
    tokens = args.seqs * (args.prompt_len + args.completion_len)
    later = rows[1:] or rows
    update_s = statistics.median(r["update_s"] for r in later)
    return {
        "shape": args.shape,
        "params": n_params,
        "param_dtype": args.dtype,
        "compute_dtype": str(trainer.precision.compute_dtype).removeprefix("torch."),
        "activation_checkpointing": args.ac,
        "lora_rank": args.lora_rank,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "seqs": args.seqs,
        "tokens_per_step": tokens,
        "micro_batch": args.micro_batch,
        "build_s": build_s,
        "update_s": update_s,
        "mfu_update": 6 * n_params * tokens / update_s / 989e12,
        "peak_alloc_gib": max(r["peak_alloc_gib"] for r in rows),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "fits": True,
    }


def _one(out: Path, argv: list[str], timeout: float) -> dict[str, Any]:
    """One configuration in a subprocess; an out-of-memory failure or timeout is a row, not a crash."""
    cmd = [sys.executable, __file__, *argv, "--out", str(out)]
    print("+", " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr)[-1500:]
        print(tail, flush=True)
    except subprocess.TimeoutExpired:
        return {"argv": argv, "fits": False, "why": f"timeout after {timeout:.0f} s"}
    if proc.returncode == 0 and out.exists():
        return json.loads(out.read_text())
    why = "out of memory" if "OutOfMemoryError" in tail or "out of memory" in tail else f"rc {proc.returncode}"
    return {"argv": argv, "fits": False, "why": why}


def lora_sweep(out_dir: Path, timeout: float) -> list[dict[str, Any]]:
    """The 1.5B shape in the default GPU precision: full fine-tuning against LoRA ranks 16 and 64."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for rank in (0, 16, 64):
        argv = [
            "--shape",
            "1.5b",
            "--dtype",
            "float32",
            "--micro-batch",
            "32",
            "--steps",
            "3",
            "--lora-rank",
            str(rank),
        ]
        rows.append(_one(out_dir / f"mem_1.5b_lora{rank}.json", argv, timeout))
    (out_dir / "update_memory_lora.json").write_text(json.dumps(rows, indent=1))
    _table(rows)
    return rows


def sweep(out_dir: Path, timeout: float) -> list[dict[str, Any]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype in ("bfloat16", "float32"):
        for ac in (False, True):
            argv = ["--shape", "1.5b", "--dtype", dtype, "--micro-batch", "32"] + (["--ac"] if ac else [])
            rows.append(_one(out_dir / f"mem_1.5b_{dtype}_{'ac' if ac else 'noac'}.json", argv, timeout))
    for shape in ("3b", "7b", "10b"):
        argv = ["--shape", shape, "--dtype", "float32", "--ac", "--micro-batch", "8", "--seqs", "64"]
        row = _one(out_dir / f"mem_{shape}_float32_ac.json", argv, timeout)
        rows.append(row)
        if not row.get("fits"):
            break
    (out_dir / "update_memory.json").write_text(json.dumps(rows, indent=1))
    _table(rows)
    return rows


def _table(rows: list[dict[str, Any]]) -> None:
    print("| shape | params | parameters | compute | act. ckpt | LoRA | micro-batch | peak allocated | update | MFU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r.get("fits"):
            print(
                f"| {r['shape']} | {r['params'] / 1e9:.2f}B | {r['param_dtype']} | {r['compute_dtype']} | "
                f"{'on' if r['activation_checkpointing'] else 'off'} | {r.get('lora_rank') or '-'} | "
                f"{r['micro_batch']} | "
                f"{r['peak_alloc_gib']:.1f} GiB | {r['update_s']:.2f} s | {100 * r['mfu_update']:.0f} % |"
            )
        else:
            print(f"| {' '.join(r['argv'])} | | | | | | | {r['why']} | | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model.dtype")
    p.add_argument("--ac", action="store_true", help="model.gradient_checkpointing")
    p.add_argument("--seqs", type=int, default=256, help="sequences per update (32 prompts x 8)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lora-rank", type=int, default=0, help="model.lora.rank (alpha 2 x rank, all linear layers)")
    p.add_argument("--out", type=Path)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--lora-sweep", action="store_true", help="1.5B: full fine-tuning against LoRA ranks 16, 64")
    p.add_argument("--out-dir", type=Path, default=Path("."))
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per sweep configuration")
    args = p.parse_args()
    if args.sweep or args.lora_sweep:
        (lora_sweep if args.lora_sweep else sweep)(args.out_dir, args.timeout)
        return
    result = measure(args)
    print("RESULT " + json.dumps(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
