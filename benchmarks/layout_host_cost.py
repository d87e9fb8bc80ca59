"""The host time of laying out one micro-batch, as shipped against the per-row layout of before.

    python benchmarks/layout_host_cost.py [--rows 64] [--prompt-len 44] [--completion-len 256] [--out r.json]

Times, on the host, what the update does before each micro-batch's forward: ``build_policy_batch``
(padded and packed) and the sampler's logprobs padded to the completion width
(``train_batch.sampler_logprobs_rows``), each as shipped and inside ``update_precision.py``'s
``layouts_built_per_row`` (the per-row loops before the twenty-sixth session), on W's micro-batch
(64 rows of 44 + 200-256 tokens by default), with ``--device cpu`` as the target: the tensors stay
on the host, so the figure is the host work alone. On a GPU this time adds to the update wherever the
host, not the GPU, sets the pace (a slow host at W, any host on small steps). Median of ``--repeats``
after three warm-ups, one thread.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def median_ms(fn: Any, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=44)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    from update_precision import layouts_built_per_row  # this directory's

    from posttrain.policy import trainer
    from posttrain.policy.train_batch import TrainBatch

    rng = random.Random(0)
    groups = [[rng.randrange(5, 40000) for _ in range(args.prompt_len)] for _ in range(max(1, args.rows // 8))]
    prompts = [groups[i // 8 % len(groups)] for i in range(args.rows)]
    low = max(1, args.completion_len * 25 // 32)  # sampled lengths vary: 200-256 at 256
    completions = [[rng.randrange(5, 40000) for _ in range(rng.randint(low, args.completion_len))] for _ in prompts]
    batch = TrainBatch(
        prompt_ids=prompts,
        completion_ids=completions,
        advantages_B=torch.zeros(len(prompts)),
        in_loss_B=torch.ones(len(prompts), dtype=torch.bool),
        sampler_logprobs=[[-1.5] * len(c) for c in completions],
        group_size=8,
    )
    rows, width, cpu = list(range(len(prompts))), args.completion_len, torch.device("cpu")
    capacity = args.prompt_len + args.completion_len
    parts = {
        "build_policy_batch, padded": lambda: trainer.build_policy_batch(prompts, completions, pad_id=0, device=cpu),
        "build_policy_batch, packed": lambda: trainer.build_policy_batch(
            prompts, completions, pad_id=0, device=cpu, pack_capacity=capacity
        ),
        "sampler logprobs rows": lambda: trainer.sampler_logprobs_rows(batch, rows, width, cpu),
    }
    result: dict[str, Any] = {"args": vars(args), "torch": torch.__version__, "ms": {}}
    head = f"one micro-batch ({args.rows} rows, {args.prompt_len} + up to {width} tokens)"
    print(f"| {head} | shipped | per row (before) |")
    print("| --- | --- | --- |")
    for name, fn in parts.items():
        shipped = median_ms(fn, args.repeats)
        with layouts_built_per_row():
            before = median_ms(fn, args.repeats)
        result["ms"][name] = {"shipped": shipped, "per_row": before}
        print(f"| {name} | {shipped:.2f} ms | {before:.2f} ms |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
