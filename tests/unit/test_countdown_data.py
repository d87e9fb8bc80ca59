"""The Countdown generator: reachable targets, the spec's row format, and the countdown reward on it."""

from __future__ import annotations

import json
import random
from pathlib import Path

from posttrain.config.schema import DataConfig
from posttrain.data.build import build_data_source
from posttrain.data.countdown import countdown_rows, main, make_task
from posttrain.rewards.base import RewardInput
from posttrain.rewards.registry import get_reward


def test_targets_are_positive_and_use_the_numbers() -> None:
    rng = random.Random(1)
    for _ in range(200):
        nums, target = make_task(rng)
        assert len(nums) == 3 and target > 0


def test_jsonl_rows_feed_the_countdown_reward(tmp_path: Path) -> None:
    path = tmp_path / "cd.jsonl"
    assert main([str(path), "--rows", "5", "--seed", "3"]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == countdown_rows(seed=3, rows=5)
    cfg = DataConfig(path=str(path), prompt_column="messages", response_column="reference", shuffle=False)
    source = build_data_source(cfg, 0)
    sample = source.next_batch(1)[0]
    truth = rows[0]["reference"]
    assert sample.prompt == rows[0]["messages"] and sample.ground_truth == truth
    reward = get_reward("countdown")
    a, b, c = truth["nums"]
    # brute force one correct equation over the generator's left-to-right + - * construction
    import itertools

    for (x, y, z), (p, q) in itertools.product(itertools.permutations([a, b, c]), itertools.product("+-*", repeat=2)):
        equation = f"({x} {p} {y}) {q} {z}"
        if eval(equation) == truth["target"]:  # digits and operators the test built itself
            break
    good = RewardInput(prompt=sample.prompt, completion=f"<answer>{equation}</answer>", ground_truth=truth)
    bad = RewardInput(prompt=sample.prompt, completion="<answer>1 + 1</answer>", ground_truth=truth)
    assert reward(good) == 1.0 and reward(bad) == 0.0
