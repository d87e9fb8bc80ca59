"""Objective options end to end on a tiny model: KL to a reference, truncation masking, Muon, seeds."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config.loading import build_config
from posttrain.errors import PosttrainError
from posttrain.loop.grpo import train
from posttrain.policy.objective import grpo_objective
from posttrain.policy.trainer import build_reference


@pytest.fixture
def run(run_overrides: Callable[..., list[str]], tiny_model_dir: str, tmp_path: Path) -> Callable[..., list[dict]]:
    """Two steps on the tiny model with ``extra`` overrides; returns the metrics records."""

    def _run(*extra: str) -> list[dict[str, float]]:
        run_dir = train(build_config(None, run_overrides(tiny_model_dir, tmp_path, "opt", "rl.max_steps=2", *extra)))
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    return _run


def test_kl_to_a_reference_from_another_checkpoint(run: Callable[..., list[dict]], tiny_model_dir: str) -> None:
    records = run(
        "rl.kl_beta=0.1",
        "rl.ref.build_ref=true",
        f"rl.ref.model_dir={tiny_model_dir}",
        "rl.kl_coeff_clamp=5.0",
    )
    assert records[0]["train/kl_mean"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before step 1
    assert records[1]["train/kl_mean"] > 0.0  # the policy moved away from its frozen anchor
    assert records[1]["train/kl_max"] >= records[1]["train/kl_mean"]


def test_reference_refuses_live_dropout(tiny_model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.attention_dropout = 0.1
    cfg = build_config(None, ["rl.kl_beta=0.1", "rl.ref.build_ref=true"])
    with pytest.raises(PosttrainError, match="live dropout"):
        build_reference(model, cfg, grpo_objective(cfg))


def test_truncated_completions_leave_the_loss(run: Callable[..., list[dict]], tmp_path: Path) -> None:
    # the tiny model never emits EOS within 12 tokens: every completion is cut, so nothing is left
    records = run("rl.mask_truncated_completions=true")
    assert all(r["train/rollout_truncated_frac"] == 1.0 for r in records)
    assert all(r["train/grad_norm"] == 0.0 for r in records)
    assert records[-1]["optim/zero_grad_skips_total"] == 2.0
    # counted, and said: a run that trains nothing must not look like one that learns nothing
    assert [r["train/masked_truncated_count"] for r in records] == [8.0, 8.0]  # rl.batch_per_replica=8
    log = next(tmp_path.rglob("train.log")).read_text()
    assert log.count("no completion of this batch is in the loss") == 2


def test_unmasked_runs_report_no_masked_count(run: Callable[..., list[dict]]) -> None:
    assert all("train/masked_truncated_count" not in r for r in run())


@pytest.mark.parametrize("optimizer", ["muon", "fusedadam"])
def test_other_optimizers_train(optimizer: str, run: Callable[..., list[dict]]) -> None:
    records = run(f"rl.optimizer.name={optimizer}")
    assert all(r["train/grad_norm"] > 0 for r in records)
    assert records[-1]["optim/step"] == 2.0


def test_data_seed_follows_rollout_seed_when_asked() -> None:
    assert build_config(None, ["rl.seed=3", "rollout.seed=9"]).data_seed == 3
    assert build_config(None, ["rl.seed=3", "rollout.seed=9", "rl.data_seed_follows_rollout_seed=true"]).data_seed == 9


@pytest.mark.parametrize(
    ("lr", "said"),
    [
        # finite weights whose norm overflows: the check names where the largest entries are, not "?"
        ("1e30", r"weights so large that their norm overflows \(largest in model\.\w+"),
        # a step size that overflows fp32 in the update: named, not torch's RuntimeError or a NaN run
        # (the fused CPU kernel writes inf weights, which the finite-weights check names)
        (
            "1e38",
            r"(the adamw step failed at|non-finite weights in parameter \S+ \(optimizer adamw,)"
            r" rl\.optimizer\.lr=1e\+38",
        ),
    ],
)
def test_an_absurd_learning_rate_is_a_named_error(run: Callable[..., list[dict]], lr: str, said: str) -> None:
    with pytest.raises(PosttrainError, match=said):
        run(f"rl.optimizer.lr={lr}")


def test_a_hung_reward_stops_the_run_with_a_named_timeout(run: Callable[..., list[dict]]) -> None:
    # the run's reward is resolved with rl.reward_timeout_s: a scorer that hangs becomes a named error
    with pytest.raises(PosttrainError, match=r"rl\.reward_timeout_s"):
        run("rl.reward=e2e_rewards:slow_reward", "rl.reward_timeout_s=0.2")
