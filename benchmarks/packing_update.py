"""Sequence packing against padding in the policy update, on a batch whose lengths vary.

    python benchmarks/packing_update.py [--prompts 4] [--samples 4] [--max-completion 96]
                                        [--repeats 2] [--tied-groups 0] [--out benchmarks/results/packing_cpu.json]

Builds a random-weight model of SmolLM2-135M's shape in memory (``profile_update.make_model``: fp32
on a CPU, bf16 on a GPU) and a synthetic collected batch: prompts of 20-60 tokens, completions of
lengths drawn like an RL batch's (most stop early, a few run to ``--max-completion``: a log-uniform
draw from 4 to the cap, and one in eight at the cap). Then times ``PolicyTrainer.train_on``
(forward, backward, AdamW) on the plain per-sequence path, padded and packed
(``model.sequence_packing``), with the whole batch in one micro-batch and in micro-batches of a
quarter of it (split as the trainer splits: runs by length, or with packing whichever split packs
into fewer cells). Prints, per variant, the token cells the model computed (rows x width, summed
over micro-batches) next to the real tokens, and the median time after one warm-up.
``--tied-groups N`` gives every other group, up to N of them, all-zero advantages (rows that learn
nothing, ``policy/free_rows.py``), so the passes without autograd are timed too.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from typing import Any

import torch
from profile_update import make_model  # this directory: the same random SmolLM2-135M shape


def completion_lengths(count: int, cap: int, gen: torch.Generator) -> list[int]:
    """RL-like lengths: log-uniform in [4, cap], and every eighth completion cut at the cap."""
    draws = torch.rand(count, generator=gen).tolist()
    return [
        cap if i % 8 == 7 else int(math.exp(math.log(4) + u * (math.log(cap) - math.log(4))))
        for i, u in enumerate(draws)
    ]


def make_batch(prompts: int, samples: int, cap: int, tied_groups: int = 0) -> Any:
    from posttrain.policy.trainer import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompt_ids = [
        torch.randint(100, 40000, (int(torch.randint(20, 61, (1,), generator=g)),), generator=g).tolist()
        for _ in range(prompts)
    ]
    lengths = completion_lengths(prompts * samples, cap, g)
    completions = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]
    advantages_B = torch.randn(prompts * samples, generator=g)
    for group in [*range(0, prompts, 2), *range(1, prompts, 2)][:tied_groups]:  # spread, as rewards tie
        advantages_B[group * samples : (group + 1) * samples] = 0.0
    return TrainBatch(
        prompt_ids=[prompt_ids[i // samples] for i in range(prompts * samples)],
        completion_ids=completions,
        advantages_B=advantages_B,
        in_loss_B=torch.ones(prompts * samples, dtype=torch.bool),
        sampler_logprobs=[[-10.0] * n for n in lengths],
        group_size=samples,
    )


def computed_cells(trainer: Any, batch: Any) -> int:
    """Token cells (rows x width) the body computes over the batch's micro-batches."""
    cells = 0
    for mini in trainer._mini_batches(len(batch.completion_ids)):
        for rows in trainer._micro_batches(batch, mini):
            cells += trainer._model_batch(batch, rows).input_ids_RL.numel()
    return cells


def run_variant(model: Any, batch: Any, *, micro: int, pack: bool, repeats: int) -> dict[str, Any]:
    from posttrain.config.loading import build_config
    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer

    cfg = build_config(
        None,
        [
            f"rl.group_size={batch.group_size}",
            f"rl.batch_per_replica={len(batch.completion_ids)}",
            f"rl.micro_batch_per_replica={micro}",
            "rl.optimizer.lr=1e-6",
            "model.share_prompt_prefix=false",
            f"model.sequence_packing={str(pack).lower()}",
            f"rollout.max_tokens={max(len(c) for c in batch.completion_ids)}",
        ],
    )
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=0)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    trainer.train_on(batch, step=1)  # warm-up
    times = []
    for step in range(repeats):
        sync()
        start = time.perf_counter()
        trainer.train_on(batch, step=2 + step)
        sync()
        times.append(time.perf_counter() - start)
    return {
        "micro_batch": micro,
        "packed": pack,
        "computed_cells": computed_cells(trainer, batch),
        "passes": [
            learns
            for mini in trainer._mini_batches(len(batch.completion_ids))
            for _, learns in trainer._passes(batch, mini)
        ],
        "median_s": statistics.median(times),
        "times_s": times,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-completion", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tied-groups", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = make_model("135m", device.type)
    batch = make_batch(a.prompts, a.samples, a.max_completion, a.tied_groups)
    real = sum(len(pr) + len(c) for pr, c in zip(batch.prompt_ids, batch.completion_ids))
    rows = len(batch.completion_ids)
    print(f"{rows} sequences, {real} real tokens, completions {sorted(len(c) for c in batch.completion_ids)}")
    print("| micro-batch | layout | computed cells | padding | passes (with autograd?) | train_on median |")
    print("| --- | --- | --- | --- | --- | --- |")
    results = []
    for micro in (rows, max(1, rows // 4)):
        for pack in (False, True):
            r = run_variant(model, batch, micro=micro, pack=pack, repeats=a.repeats)
            r["padding_frac"] = 1 - real / r["computed_cells"]
            results.append(r)
            layout = "packed" if pack else "padded"
            print(
                f"| {micro} | {layout} | {r['computed_cells']} | {r['padding_frac']:.0%} | "
                f"{''.join('L' if learns else 'f' for learns in r['passes'])} | {r['median_s']:.2f} s |",
                flush=True,
            )
    if a.out:
        meta = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "sequences": rows,
            "tied_groups": a.tied_groups,
            "real_tokens": real,
            "completion_lengths": [len(c) for c in batch.completion_ids],
        }
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "variants": results}, f, indent=1)


if __name__ == "__main__":
    main()
