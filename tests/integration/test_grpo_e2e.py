"""End-to-end GRPO runs on a tiny random model: the loop, checkpoints, exact resume, signals."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.config.loading import build_config
from posttrain.loop.grpo import train

RunOverrides = Callable[..., list[str]]
GrpoCli = Callable[..., subprocess.CompletedProcess[str]]

REQUIRED_METRICS = [
    "train/reward_mean",
    "train/reward_std",
    "train/grpo_informative_group_count",
    "train/clip_frac",
    "train/grad_norm",
    "train/loss_avg",
    "train/rollout_truncated_frac",
    "train/response_len_mean",
    "train/response_len_max",
    "optim/zero_grad_skips_total",
    "timer/e2e_step_s",
]


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_steps_change_parameters_and_log_every_metric(
    tiny_model_dir: str, tmp_path: Path, run_overrides: RunOverrides
) -> None:
    cfg = build_config(None, run_overrides(tiny_model_dir, tmp_path, "two", "rl.max_steps=2", "rl.save_every=2"))
    run_dir = train(cfg)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for key in REQUIRED_METRICS:
        assert all(key in r for r in records), key
    assert records[0]["train/clip_frac"] == 0.0  # one mini-batch: the ratio is exactly one
    before = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    after = load_file(str(run_dir / "checkpoints" / "iter_000000002" / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k].to(before[k].dtype))]
    assert len(changed) > len(before) // 2, "the update moved too few tensors"
    assert (run_dir / "config_resolved.yaml").is_file()
    assert list(run_dir.glob("provenance.*.json"))
    assert (run_dir / "report.png").stat().st_size > 10_000


def _comparable(records: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not k.startswith(("timer/", "rollout/"))} for r in records]


def _latest_run(root: Path, name: str) -> Path:
    return sorted((root / "posttrain" / "grpo" / name).iterdir())[-1]


@pytest.mark.slow
def test_sigkill_then_resume_reproduces_the_uninterrupted_run(
    tiny_model_dir: str, tmp_path: Path, run_overrides: RunOverrides, grpo_cli: GrpoCli
) -> None:
    steps = ["rl.max_steps=4", "rl.save_every=2"]
    whole = grpo_cli(run_overrides(tiny_model_dir, tmp_path, "whole", *steps))
    assert whole.returncode == 0, whole.stderr
    # 8 reward calls per step: the 20th call is inside step 3, after the step-2 checkpoint
    killed = grpo_cli(run_overrides(tiny_model_dir, tmp_path, "cut", *steps), {"PT_TEST_SIGNAL_AT": "20:KILL"})
    assert killed.returncode == -9
    resumed = grpo_cli(run_overrides(tiny_model_dir, tmp_path, "cut", *steps, "rl.resume=auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert "optimizer step 2" in resumed.stdout
    whole_dir, resumed_dir = _latest_run(tmp_path, "whole"), _latest_run(tmp_path, "cut")
    assert _comparable(read_metrics(resumed_dir)) == _comparable(read_metrics(whole_dir))
    a = load_file(str(whole_dir / "checkpoints" / "iter_000000004" / "model.safetensors"))
    b = load_file(str(resumed_dir / "checkpoints" / "iter_000000004" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigterm_saves_a_resumable_checkpoint(
    tiny_model_dir: str, tmp_path: Path, run_overrides: RunOverrides, grpo_cli: GrpoCli
) -> None:
    args = run_overrides(tiny_model_dir, tmp_path, "term", "rl.max_steps=6", "rl.save_every=100")
    stopped = grpo_cli(args, {"PT_TEST_SIGNAL_AT": "12:TERM"})  # inside step 2
    assert stopped.returncode == 0, stopped.stderr
    assert "SIGTERM" in stopped.stdout
    run_dir = _latest_run(tmp_path, "term")
    assert (run_dir / "checkpoints" / "latest_checkpoint.txt").read_text().strip().endswith("iter_000000002")
    resumed = grpo_cli([*args, "rl.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in read_metrics(_latest_run(tmp_path, "term"))] == [1, 2, 3, 4, 5, 6]


def test_dynamic_sampling_fills_every_group_with_informative_ones(
    tiny_model_dir: str, tmp_path: Path, run_overrides: RunOverrides
) -> None:
    cfg = build_config(
        None,
        run_overrides(
            tiny_model_dir,
            tmp_path,
            "dapo",
            "rl.max_steps=3",
            "rl.reward=e2e_rewards:even_length",
            "rl.min_informative_groups_frac=1.0",
            "rl.dynamic_sampling_max_extra_rollouts=30",
        ),
    )
    records = read_metrics(train(cfg))
    for r in records:
        assert r["train/grpo_informative_group_count"] == cfg.rl.groups_per_step
        assert "train/grpo_dynamic_sampling_extra_rollouts" in r
        assert "train/grpo_dynamic_sampling_dropped_trajectories" in r


@pytest.mark.parametrize("recipe", ["dr_grpo", "gspo"])
def test_variant_recipes_run(recipe: str, tiny_model_dir: str, tmp_path: Path, run_overrides: RunOverrides) -> None:
    cfg = build_config(recipe, run_overrides(tiny_model_dir, tmp_path, recipe, "rl.max_steps=2"))
    records = read_metrics(train(cfg))
    assert len(records) == 2
    assert all(r["train/grad_norm"] > 0 for r in records)
