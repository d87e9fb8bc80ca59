"""The FSDP update where one rank's micro-batch is wholly tied and the other's is half tied.

Two gloo FSDP2 ranks (CPU) train one mini-batch of two groups each. Rank 0's groups both have
all-zero advantages; rank 1's first group does and its second learns. Arm ``whole``: the ranks run
the micro-batch whole with autograd (the eighteenth session's rule: only a split that every rank
makes by kind was agreed). Arm ``split``: rank 1 splits by kind and rank 0 runs one tied group
without autograd and the other with it (``distributed/passes.py``), so each rank's backward covers
one group instead of two. The arms alternate, ``--reps`` times each, after one warm-up of each.

    python benchmarks/fsdp_tied_passes.py MODEL_DIR [--completion-len 64] [--reps 4] [--out JSON]

MODEL_DIR: a Hugging Face causal LM (``benchmarks/make_random_model.py ... --shape 135m``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

G = 8  # the default recipe's group size: two groups per rank, one micro-batch of 16 rows


def _batch(completion_len: int, rank: int) -> Any:
    """This rank's cell: two groups of G rows, prompts of 40 tokens, random completions."""
    from posttrain.policy.train_batch import TrainBatch

    gen = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(30, 900, (40,), generator=gen).tolist() for _ in range(2)]
    comps = [torch.randint(30, 900, (completion_len,), generator=gen).tolist() for _ in range(2 * G)]
    advantages_B = torch.linspace(-1.0, 1.0, 2 * G)
    advantages_B[:G] = 0.0  # the first group ties on both ranks
    if rank == 0:
        advantages_B[G:] = 0.0  # and rank 0's second too
    return TrainBatch(
        prompt_ids=[p for p in prompts for _ in range(G)],
        completion_ids=comps,
        advantages_B=advantages_B,
        in_loss_B=torch.ones(2 * G, dtype=torch.bool),
        sampler_logprobs=[[-1.0] * len(c) for c in comps],
        group_size=G,
    )


def _worker(rank: int, model_dir: str, completion_len: int, reps: int, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from posttrain.config.loading import build_config
    from posttrain.distributed.fsdp import DataParallel, build_dp_mesh, shard_policy
    from posttrain.distributed.process_group import init_process_group
    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer

    torch.set_num_threads(1)  # one core per rank, as torchrun's default OMP_NUM_THREADS=1
    init_process_group(init_method=f"file://{out}/store", rank=rank, world_size=2, timeout_s=120)
    cfg = build_config(
        None,
        [
            f"rl.batch_per_replica={4 * G}",  # both ranks' rows
            f"rl.group_size={G}",
            f"rollout.max_tokens={completion_len}",
            "model.share_prompt_prefix=true",
            "rl.optimizer.lr=1e-6",
        ],
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shard_policy(model, build_dp_mesh(2))  # the trainer finds the sharded model's ranks
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=2)
    batch = _batch(completion_len, rank)
    agreed = DataParallel.passes
    # unit beyond any micro-batch: a wholly tied one never splits, which is the earlier rule
    whole = mock.patch.object(DataParallel, "passes", lambda dp, micro, free, unit=1: agreed(dp, micro, free, 10**9))
    times: dict[str, list[float]] = {"whole": [], "split": []}
    plans: dict[str, Any] = {}
    for rep in range(reps + 1):
        for arm in ("whole", "split"):
            with whole if arm == "whole" else mock.patch.object(DataParallel, "passes", agreed):
                plans[arm] = trainer._passes(batch, list(range(2 * G)))
                dist.barrier()
                start = time.perf_counter()
                trainer.train_on(batch, step=rep + 1)
                dist.barrier()
                if rep:  # the first of each arm warms up
                    times[arm].append(time.perf_counter() - start)
    if rank == 0:
        result = {
            "completion_len": completion_len,
            "rows_per_rank": 2 * G,
            "passes_rank0": {arm: [[len(rows), learns] for rows, learns in p] for arm, p in plans.items()},
            "train_on_s": times,
            "median_s": {arm: statistics.median(t) for arm, t in times.items()},
        }
        Path(out, "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--completion-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(a.model_dir, a.completion_len, a.reps, tmp), nprocs=2)
        result = json.loads(Path(tmp, "result.json").read_text())
    for arm in ("whole", "split"):
        runs = ", ".join(f"{t:.2f}" for t in result["train_on_s"][arm])
        passes = result["passes_rank0"][arm]
        print(f"{arm:>5}: median {result['median_s'][arm]:.2f} s ({runs}); rank 0's passes (rows, learns) {passes}")
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
