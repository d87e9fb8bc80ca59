"""Where the policy update's time goes: posttrain's trainer on issue 9's batch, variant by variant.

    python benchmarks/profile_update.py [--shape 0.5b|135m] [--out update.json] [--trace]

Builds the random-weight model in memory (Qwen2.5-0.5B body on SmolLM2's 49,152 vocabulary, bf16,
or the SmolLM2-135M shape) and a synthetic collected batch of issue 9's size (32 prompts of 44
tokens x 8 completions of 256 tokens, random ids and advantages), then times
``PolicyTrainer.train_on`` (forward, backward, AdamW) under several settings, median of 3 after a
warm-up, with the MFU (6 N per trained token). A bare ``body -> mean(hidden)`` forward and
backward over the same padded tokens gives the ceiling of the transformers model itself. With
``--trace`` the first variant is also run under torch.profiler and its top CUDA kernels printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

PEAK_BF16_FLOPS = 989e12


def make_model(shape: str, device: str = "cuda") -> Any:
    """The random-weight model of ``shape`` on ``device``: bf16 on a GPU, fp32 on a CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    )
    if shape == "0.5b":
        cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 896, 4864, 24
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 14, 2, 64
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32)
    return model


def make_batch(prompts: int, samples: int, prompt_len: int, completion_len: int) -> Any:
    from posttrain.policy.trainer import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(100, 40000, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    completions = [torch.randint(100, 40000, (completion_len,), generator=g).tolist() for _ in range(prompts * samples)]
    return TrainBatch(
        prompt_ids=[prompt_ids[i // samples] for i in range(prompts * samples)],
        completion_ids=completions,
        advantages_B=torch.randn(prompts * samples, generator=g),
        in_loss_B=torch.ones(prompts * samples, dtype=torch.bool),
        sampler_logprobs=[[-10.0] * completion_len for _ in completions],
        group_size=samples,
    )


def trainer_for(model: Any, batch: Any, **knobs: Any) -> Any:
    from posttrain.config.schema import GRPOConfig
    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer

    cfg = GRPOConfig()
    cfg.rl.group_size = batch.group_size
    cfg.rl.batch_per_replica = len(batch.completion_ids)
    cfg.rl.micro_batch_per_replica = knobs.get("micro", 32)
    cfg.rl.optimizer.lr = 1e-6
    cfg.model.share_prompt_prefix = knobs.get("share", True)
    cfg.model.logprob_chunk_tokens = knobs.get("chunk", 1024)
    cfg.model.gradient_checkpointing = knobs.get("checkpointing", False)
    cfg.rollout.max_tokens = len(batch.completion_ids[0])
    return PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=0)


def timed(fn: Any, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bare_body(model: Any, batch: Any, micro: int) -> None:
    """Forward + backward of the transformers body alone on padded prompt+completion rows."""
    body = model.get_decoder()
    rows = [p + c for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True)]
    for start in range(0, len(rows), micro):
        ids = torch.tensor(rows[start : start + micro], device="cuda")
        hidden = body(input_ids=ids, use_cache=False).last_hidden_state
        hidden.float().mean().backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="0.5b", choices=["0.5b", "135m"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", action="store_true")
    args = parser.parse_args()
    model = make_model(args.shape)
    params = sum(p.numel() for p in model.parameters())
    batch = make_batch(32, 8, 44, 256)
    tokens = sum(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True))
    variants: list[tuple[str, dict[str, Any]]] = [
        ("shared prompt, micro 32", {"share": True, "micro": 32}),
        ("plain, micro 32", {"share": False, "micro": 32}),
        ("shared prompt, micro 64", {"share": True, "micro": 64}),
        ("plain, micro 64", {"share": False, "micro": 64}),
        ("plain, micro 64, chunk 8192", {"share": False, "micro": 64, "chunk": 8192}),
        ("shared prompt, micro 256", {"share": True, "micro": 256}),
    ]
    results: dict[str, Any] = {"shape": args.shape, "params": params, "trained_tokens": tokens, "variants": {}}
    for micro in (32, 64):
        seconds = timed(lambda micro=micro: bare_body(model, batch, micro))
        results["variants"][f"bare body fwd+bwd, micro {micro}"] = {"seconds": seconds}
    for name, knobs in variants:
        trainer = trainer_for(model, batch, **knobs)
        torch.cuda.reset_peak_memory_stats()
        try:
            seconds = timed(lambda trainer=trainer: trainer.train_on(batch, 1))
        except torch.OutOfMemoryError:
            results["variants"][name] = {"error": "out of memory"}
            torch.cuda.empty_cache()
            continue
        results["variants"][name] = {
            "seconds": seconds,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        del trainer
        torch.cuda.empty_cache()
    for row in results["variants"].values():
        if "seconds" in row:
            row["mfu"] = 6 * params * tokens / row["seconds"] / PEAK_BF16_FLOPS
    print(json.dumps(results, indent=2), flush=True)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        trainer = trainer_for(model, batch, **variants[0][1])
        trainer.train_on(batch, 1)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.train_on(batch, 1)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        print(table)
        results["trace_top"] = table
        cpu_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=20)
        print(cpu_table)
        results["trace_cpu_top"] = cpu_table
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
