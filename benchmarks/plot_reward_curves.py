"""Reward curves of several runs on one plot (raw per step, and a 10-step running mean).

python benchmarks/plot_reward_curves.py OUT.png LABEL=metrics.jsonl [LABEL=metrics.jsonl ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def running_mean(values: list[float], window: int = 10) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def main(argv: list[str]) -> None:
    out, runs = Path(argv[0]), [a.split("=", 1) for a in argv[1:]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, path in runs:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        steps = [r["step"] for r in rows]
        reward = [r["train/reward_mean"] for r in rows]
        (line,) = ax.plot(steps, running_mean(reward), label=f"{label} (10-step mean)")
        ax.plot(steps, reward, color=line.get_color(), alpha=0.25, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("train/reward_mean")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
