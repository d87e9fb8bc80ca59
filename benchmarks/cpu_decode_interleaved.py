"""The CPU default job's loop steps in two settings in turn, in one process: the rollout and train phases timed
apart, the pairs' order alternating (A B, B A, ...), so the machine's drift falls on both alike.

    python benchmarks/cpu_decode_interleaved.py --layouts row_major,onednn_packed --pairs 6 [overrides...]
    python benchmarks/cpu_decode_interleaved.py --vary update --pairs 9 [overrides...]

Why: whole jobs on these shared 2-core machines drift by 15-20 % from one run to the next, more than a layout
changes; interleaved in one process the two arms see the same machine.

``--vary layout`` (the default): the transformers engine decodes in the two weight layouts given
(``rollout.cpu_weight_layout``'s resolved values, ``models/cpu_decode_layout.py``); each step's batch is the loop's
own (other draws per layout, so the train phase differs by its tied groups, not by the layout).
``--vary update``: ``model.cpu_packed_update`` off, then on (the update's linear forwards over oneDNN-packed
weights, which reuse the decode's packed copies of the same weights); the decode as configured. Every step still
runs the loop's rollout, but trains on one fixed batch, the first step's with ``--learning-groups`` groups given
random advantages (the default job's steps train 0-4 learning groups, which would swamp the difference).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from typing import Any

import torch
from step_overheads import build  # this folder, which Python puts first on the path for a script in it


def learning_batch(batch: Any, groups: int) -> Any:
    """``batch`` with its first ``groups`` groups' advantages drawn at random (normalised per group), the rest 0."""
    numbers = torch.Generator().manual_seed(0)
    size = batch.group_size
    advantages = torch.zeros(len(batch.completion_ids))
    for group in range(groups):
        drawn = torch.randn(size, generator=numbers)
        advantages[group * size : (group + 1) * size] = (drawn - drawn.mean()) / drawn.std()
    return dataclasses.replace(batch, advantages_B=advantages)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vary", choices=("layout", "update"), default="layout", help="what the two arms differ in")
    parser.add_argument("--layouts", default="row_major,onednn_packed", help="--vary layout: two resolved layouts")
    parser.add_argument("--learning-groups", type=int, default=2, help="--vary update: groups that learn")
    parser.add_argument("--pairs", type=int, default=6, help="timed pairs, after one untimed pair")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (key=value)")
    args = parser.parse_args()
    arms = args.layouts.split(",") if args.vary == "layout" else ["update_plain", "update_packed"]
    first, second = arms
    os.environ.setdefault("POSTTRAIN_OUTPUT_ROOT", tempfile.mkdtemp(prefix="cpu_decode_interleaved_"))

    from posttrain.loop.grpo import grpo_batch
    from posttrain.loop.run import publish_weights
    from posttrain.metrics.timers import StepTimer

    cfg, run = build(argparse.Namespace(device="cpu", engine="hf", compile=False, overrides=args.overrides))
    engine, trainer, timer = run.roles.engine, run.trainer, StepTimer()
    print(engine.weight_layout_note, "|", trainer.packed_update_note)
    times: dict[str, dict[str, list[float]]] = {arm: {"rollout": [], "train": []} for arm in arms}
    fixed = None
    step = 0
    for pair in range(args.pairs + 1):
        for arm in (first, second) if pair % 2 == 0 else (second, first):
            if args.vary == "layout":
                engine.decode_layout = arm
            else:
                trainer.packed_update = arm == "update_packed"
            step += 1
            start = time.perf_counter()
            batch, _ = grpo_batch(cfg, run, timer)
            rollout_s = time.perf_counter() - start
            if args.vary == "update":
                fixed = fixed or learning_batch(batch, args.learning_groups)
                batch = fixed
            start = time.perf_counter()
            trainer.train_on(batch, step)
            train_s = time.perf_counter() - start
            publish_weights(run, trainer.optimizer_step)
            tokens = sum(map(len, batch.completion_ids))
            print(f"pair {pair} {arm:14s} rollout {rollout_s:.2f} s  train {train_s:.2f} s  tokens {tokens}")
            if pair:  # the first pair warms both arms up
                times[arm]["rollout"].append(rollout_s)
                times[arm]["train"].append(train_s)
    for arm, phases in times.items():
        medians = "  ".join(f"{phase} median {statistics.median(v):.2f} s" for phase, v in phases.items())
        print(f"{arm:14s} {medians}")
    phase = "rollout" if args.vary == "layout" else "train"
    faster = sum(a < b for a, b in zip(times[second][phase], times[first][phase]))
    print(f"{second} {phase} faster than {first} in {faster} of {args.pairs} pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
