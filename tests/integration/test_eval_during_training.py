"""rl.eval on a tiny random model: when the evaluation runs, what it logs, and that it leaves training alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.config.loading import build_config
from posttrain.loop.grpo import train
from posttrain.rewards.base import RewardInput

RunOverrides = Callable[..., list[str]]
HERE = Path(__file__).parent
TRUTH_REWARD = "test_eval_during_training:truth_reward"
TRUTH_KEY = "test_eval_during_training_truth_reward"  # rewards/combined.py metric_key of TRUTH_REWARD

# Not the time of anything, and not the sampler's speed: what must match between two runs.
TIMING_KEYS = ("timer/", "eval/", "memory/", "rollout/gen_s", "rollout/tokens_per_s")


def truth_reward(sample: RewardInput) -> float:
    """The row's reference answer as the score, whatever the completion: eval values are then known
    in advance however the random model answers."""
    return float(sample.ground_truth)


truth_reward.requires = frozenset({"prompt", "ground_truth"})  # type: ignore[attr-defined]


def _records(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_eval_metrics_at_step_0_every_n_and_the_end(
    tiny_model_dir: str, tmp_path: Path, run_overrides: RunOverrides, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    answers = [1.0, 0.0, 0.5, 1.0]
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": a}) + "\n" for i, a in enumerate(answers)))
    overrides = run_overrides(
        tiny_model_dir,
        tmp_path,
        "eval_cadence",
        f"rl.reward={TRUTH_REWARD}",
        "rl.max_steps=3",
        "rl.eval.enabled=true",
        "rl.eval.every_steps=2",
        f"rl.eval.data.path={held_out}",
        "rl.eval.data.shuffle=false",
        f"rl.eval.num_prompts={len(answers)}",
        "rl.eval.samples_per_prompt=2",
        "rl.eval.temperature=1.0",
        "rl.eval.max_tokens=6",
    )
    records = _records(train(build_config(None, overrides)))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    evaluated = [r for r in records if "eval/reward_mean" in r]
    assert [r["step"] for r in evaluated] == [0, 2, 3]  # step 0, every 2nd, the last
    # step 0 is a frame of its own, before any update: evaluation keys only
    assert all(k == "step" or k.startswith("eval/") or k == "timer/eval_s" for k in records[0])
    for r in evaluated:
        # the reward is the answer column: 2 samples of each of [1, 0, 0.5, 1]
        assert r["eval/reward_mean"] == pytest.approx(2.5 / 4)
        assert r["eval/mean@k"] == pytest.approx(2.5 / 4)
        assert r["eval/pass@1"] == pytest.approx(2 / 4)  # threshold 1.0: the two 1.0 rows pass
        assert r["eval/pass@k"] == pytest.approx(2 / 4)
        assert r[f"eval/reward/{TRUTH_KEY}_mean"] == pytest.approx(2.5 / 4)
        assert 1 <= r["eval/response_len_mean"] <= 6  # sampled by the run's engine, at rl.eval.max_tokens
        assert r["timer/eval_s"] > 0
    assert not any(k.startswith("eval/") for k in records[1])


def _comparable(records: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in records if r["step"] > 0]


def test_eval_leaves_the_training_run_unchanged(
    tiny_model_dir: str, tmp_path: Path, run_overrides: RunOverrides
) -> None:
    # Sampled evaluation (temperature 1, 2 samples) every step: it calls the engine that trains'
    # sampling is seeded through, and draws from an arithmetic source of its own.
    common = ["rl.max_steps=2", "rl.save_every=2", "rollout.temperature=1.0"]
    plain = train(build_config(None, run_overrides(tiny_model_dir, tmp_path, "plain", *common)))
    with_eval = [
        "rl.eval.enabled=true",
        "rl.eval.every_steps=1",
        "rl.eval.num_prompts=3",
        "rl.eval.samples_per_prompt=2",
        "rl.eval.temperature=1.0",
    ]
    evaluated = train(build_config(None, run_overrides(tiny_model_dir, tmp_path, "evaluated", *common, *with_eval)))
    plain_records, eval_records = _records(plain), _records(evaluated)
    assert [r["step"] for r in eval_records if "eval/pass@1" in r] == [0, 1, 2]
    assert len(plain_records) == 2 and "train/reward_mean" in plain_records[0]
    assert _comparable(eval_records) == _comparable(plain_records)
    final = "checkpoints/iter_000000002/model.safetensors"
    a, b = load_file(str(plain / final)), load_file(str(evaluated / final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
