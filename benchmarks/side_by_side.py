"""Ours and TRL's step on the same workload, as one markdown table (from the two runs' JSON files).

    python benchmarks/side_by_side.py OURS.json TRL.json [OURS2.json ...]

OURS: written by ``benchmarks/grpo_step.py --out``; TRL: written by
``../shared/peers/trl_grpo_gpu_step.py`` (``$OUT/trl_<mode>.json``). Medians of steps 2 on for
ours, TRL's own median of its steps 2-4. Several of ours (other settings) may follow.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def ours_row(path: Path) -> str:
    d = json.loads(path.read_text())
    m = d["median_steps_2_on"]
    a = d["args"]
    label = f"posttrain {Path(path).stem}" + (" (unseeded)" if a.get("unseeded") else "")
    label += " (per-call seeds)" if a.get("call_seeds") else ""
    return (
        f"| {label} | {m['step_s']:.2f} s | {m['generation_s']:.2f} s | {m['update_s'] + m['logprob_pass_s']:.2f} s "
        f"({100 * m['mfu_update']:.1f} % MFU) | {m['weight_sync_s']:.3f} s | {m['peak_alloc_gib']:.1f} GiB |"
    )


def trl_row(path: Path) -> str:
    d = json.loads(path.read_text())
    later = d["steps"][1:] or d["steps"]
    gen = statistics.median(s.get("vLLM.generate", s.get("transformers.generate", 0.0)) for s in later)
    sync = statistics.median(s.get("sync_weights", 0.0) for s in later)
    return (
        f"| TRL ({d['mode']}) | {d['median_step_s_2to4']:.2f} s | {gen:.2f} s | | {sync:.3f} s | {d['peak_GiB']} GiB |"
    )


def main(argv: list[str]) -> None:
    ours, trl, more = Path(argv[0]), Path(argv[1]), [Path(p) for p in argv[2:]]
    print("| run | step | generation | update + logprob passes | weight sync | peak alloc |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in [ours, *more]:
        print(ours_row(path))
    print(trl_row(trl))
    ratio = (
        json.loads(trl.read_text())["median_step_s_2to4"] / json.loads(ours.read_text())["median_steps_2_on"]["step_s"]
    )
    print(f"\nTRL / posttrain ({ours.stem}): {ratio:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
