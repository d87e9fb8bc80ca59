"""Countdown tasks: reach a target from given numbers, each used exactly once (OPD's demo task).

Two ways to use it:

* as a prompt factory: ``rl.data.factory=posttrain.data.countdown:countdown_rows`` (with
  ``rl.data.prompt_column=messages``, ``rl.data.response_column=reference``, ``rl.reward=countdown``);
* as a JSONL file in the spec's row format, written by
  ``python -m posttrain.data.countdown OUT.jsonl [--rows N] [--seed S]``::

      {"messages": [{"role": "user", "content": "Using the numbers [3, 5, 2], ..."}],
       "reference": {"nums": [3, 5, 2], "target": 13}}

Every target is reachable: it is built by combining the numbers with ``+ - *`` (left to right),
and the generator keeps only positive targets.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

PROMPT = (
    "Using the numbers {nums}, create an equation that equals {target}. Use each number exactly once, "
    "with + - * / and parentheses. Show the equation in <answer></answer> tags, e.g. <answer>(1 + 2) * 3</answer>."
)


def make_task(rng: random.Random, *, count: int = 3, low: int = 1, high: int = 20) -> tuple[list[int], int]:
    """Numbers and a reachable positive target."""
    while True:
        nums = [rng.randint(low, high) for _ in range(count)]
        order = rng.sample(nums, len(nums))
        value = order[0]
        for n in order[1:]:
            op = rng.choice("+-*")
            value = value + n if op == "+" else value - n if op == "-" else value * n
        if value > 0:
            return nums, value


def countdown_rows(seed: int = 0, rows: int = 2000) -> list[dict[str, Any]]:
    """``rows`` Countdown tasks in the spec's row format (``messages`` + ``reference``)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        nums, target = make_task(rng)
        content = PROMPT.format(nums=nums, target=target)
        out.append({"messages": [{"role": "user", "content": content}], "reference": {"nums": nums, "target": target}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.data.countdown", description="Write Countdown tasks.")
    parser.add_argument("out", help="output JSONL file")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = Path(args.out)
    path.write_text("".join(json.dumps(row) + "\n" for row in countdown_rows(args.seed, args.rows)))
    print(f"wrote {args.rows} Countdown tasks to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
