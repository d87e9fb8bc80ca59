"""A tiny GRPO run with two weighted rewards and ``job.log_completions_every``: completions.jsonl
holds every promised field for the right steps, and the new metrics match values recomputed by hand
from those lines."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from posttrain.config.loading import build_config
from posttrain.loop.grpo import train

RunOverrides = Callable[..., list[str]]

WEIGHTS = (2.0, 0.5)
FIELDS = {
    "step",
    "cell",
    "uid",
    "prompt",
    "completion",
    "completion_tokens",
    "rewards",
    "reward",
    "advantage",
    "finish_reason",
}


def _length(text: str) -> float:  # e2e_rewards:length_reward, written out again
    return min(1.0, len(text) / 200.0)


def _even(text: str) -> float:  # e2e_rewards:even_length
    return 1.0 if len(text) % 2 == 0 else 0.0


def _group_advantages(rewards: list[float]) -> list[float]:
    """GRPO's advantage of one group: (r - mean) / (sample std + 1e-6), 0 for a tied group."""
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mean) / (std + 1e-6) for r in rewards]


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three steps of conftest's tiny run, scored by two weighted e2e rewards, samples logged every 2nd step."""
    overrides = [
        f"model.name_or_path={tiny_model_dir}",
        f"job.output_root={tmp_path_factory.mktemp('completions')}",
        "job.name=completions",
        "rl.reward=[e2e_rewards:length_reward,e2e_rewards:even_length]",
        f"rl.reward_weights=[{WEIGHTS[0]},{WEIGHTS[1]}]",
        "job.log_completions_every=2",
        "rl.max_steps=3",
        "rl.batch_per_replica=8",
        "rl.group_size=4",
        "rollout.max_tokens=12",
        "rl.optimizer.lr=1e-3",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(Path(__file__).parents[1] / "fixtures" / "e2e"))
        return train(build_config(None, overrides))


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]


def _metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_completions_jsonl_holds_every_sample_of_the_due_steps(run_dir: Path) -> None:
    lines = _lines(run_dir)
    assert [line["step"] for line in lines] == [2] * 8  # every 2nd of 3 steps; 8 samples each
    for line in lines:
        assert set(line) == FIELDS
        assert line["cell"] == 0
        assert isinstance(line["prompt"], (str, list)) and isinstance(line["completion"], str)
        assert line["finish_reason"] in {"stop", "length"}
        assert line["rewards"] == {
            "e2e_rewards_length_reward": _length(line["completion"]),
            "e2e_rewards_even_length": _even(line["completion"]),
        }
        expected = WEIGHTS[0] * _length(line["completion"]) + WEIGHTS[1] * _even(line["completion"])
        assert line["reward"] == pytest.approx(expected, rel=1e-6)
    assert len({line["uid"] for line in lines}) == 8
    for g in range(2):  # groups of four, in order
        group = lines[4 * g : 4 * g + 4]
        assert [line["uid"].rsplit("#", 1)[1] for line in group] == ["0", "1", "2", "3"]
        want = _group_advantages([line["reward"] for line in group])
        assert [line["advantage"] for line in group] == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_new_metrics_match_the_logged_samples(run_dir: Path) -> None:
    lines, metrics = _lines(run_dir), _metrics(run_dir)
    m = metrics[2]
    n = len(lines)
    weighted = [line["reward"] for line in lines]
    assert m["train/reward_mean"] == pytest.approx(sum(weighted) / n, rel=1e-6)
    assert m["train/reward_min"] == pytest.approx(min(weighted), rel=1e-6)
    assert m["train/reward_max"] == pytest.approx(max(weighted), rel=1e-6)
    for key in ("e2e_rewards_length_reward", "e2e_rewards_even_length"):
        assert m[f"train/reward/{key}_mean"] == pytest.approx(sum(li["rewards"][key] for li in lines) / n, rel=1e-6)
    # the weighted mean is the weighted combination of the parts' means
    parts = WEIGHTS[0] * m["train/reward/e2e_rewards_length_reward_mean"]
    parts += WEIGHTS[1] * m["train/reward/e2e_rewards_even_length_mean"]
    assert m["train/reward_mean"] == pytest.approx(parts, rel=1e-6)
    tokens = [line["completion_tokens"] for line in lines]
    assert m["rollout/completion_length_mean"] == pytest.approx(sum(tokens) / n)
    assert (m["rollout/completion_length_min"], m["rollout/completion_length_max"]) == (min(tokens), max(tokens))
    assert m["train/valid_sequence_count"] == n  # no masking: every sample is in the loss
    assert m["train/valid_token_count"] == sum(tokens)
    adv = [line["advantage"] for line in lines]
    mean = sum(a * t for a, t in zip(adv, tokens)) / sum(tokens)
    std = math.sqrt(sum((a - mean) ** 2 * t for a, t in zip(adv, tokens)) / sum(tokens))
    assert m["rollout/advantage_mean"] == pytest.approx(mean, abs=1e-6)
    assert m["rollout/advantage_std"] == pytest.approx(std, rel=1e-5)
    seen = [a for a, t in zip(adv, tokens) if t > 0]
    assert m["rollout/advantage_min"] == pytest.approx(min(seen), rel=1e-5)
    assert m["rollout/advantage_max"] == pytest.approx(max(seen), rel=1e-5)
    skips = [metrics[s]["optim/zero_grad_skips_total"] for s in (1, 2, 3)]
    for step, before, after in zip((1, 2, 3), [0.0, *skips], skips):
        # one optimizer step per batch: 1 when applied, 0 when skipped on a zero gradient
        assert metrics[step]["optim/update_outcome"] == 1.0 - (after - before)
