"""The CPU default job's loop steps with the transformers engine decoding in two weight layouts in turn, in
one process: the rollout and train phases timed apart, the pairs' order alternating (A B, B A, ...), so the
machine's drift falls on both alike.

    python benchmarks/cpu_decode_interleaved.py --layouts row_major,onednn_packed --pairs 6 [overrides...]

Why: whole jobs on these shared 2-core machines drift by 15-20 % from one run to the next, more than a layout
changes; interleaved in one process the two arms see the same machine. The layouts are
``rollout.cpu_weight_layout``'s resolved values (``models/cpu_decode_layout.py``); each step's batch is the
loop's own (other draws per layout, so the train phase differs by its tied groups, not by the layout).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from step_overheads import build  # this folder, which Python puts first on the path for a script in it


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="row_major,onednn_packed", help="two resolved layouts, A,B")
    parser.add_argument("--pairs", type=int, default=6, help="timed pairs, after one untimed pair")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (key=value)")
    args = parser.parse_args()
    first, second = args.layouts.split(",")
    os.environ.setdefault("POSTTRAIN_OUTPUT_ROOT", tempfile.mkdtemp(prefix="cpu_decode_interleaved_"))

    from posttrain.loop.grpo import grpo_batch
    from posttrain.loop.run import publish_weights
    from posttrain.metrics.timers import StepTimer

    cfg, run = build(argparse.Namespace(device="cpu", engine="hf", compile=False, overrides=args.overrides))
    engine, trainer, timer = run.roles.engine, run.trainer, StepTimer()
    times: dict[str, dict[str, list[float]]] = {arm: {"rollout": [], "train": []} for arm in (first, second)}
    step = 0
    for pair in range(args.pairs + 1):
        for arm in (first, second) if pair % 2 == 0 else (second, first):
            engine.decode_layout = arm
            step += 1
            start = time.perf_counter()
            batch, _ = grpo_batch(cfg, run, timer)
            rollout_s = time.perf_counter() - start
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
    faster = sum(a < b for a, b in zip(times[second]["rollout"], times[first]["rollout"]))
    print(f"{second} rollout faster than {first} in {faster} of {args.pairs} pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
