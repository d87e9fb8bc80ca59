"""Learning-rate schedules (``rl.optimizer.lr_schedule``): hand-computed values at given optimizer
steps, the default kept bit-identical to the historical warm-up-then-constant factor, resume through
the scheduler's state, and the trainer counting ``rl.max_steps x n_mini`` optimizer steps."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from posttrain.config.loading import build_config
from posttrain.config.optimizer import OptimizerConfig
from posttrain.errors import ConfigError
from posttrain.policy.optim import build_scheduler

LR = 0.5


def lrs_used(cfg: OptimizerConfig, total: int, steps: int) -> list[float]:
    """The learning rate each of ``steps`` real AdamW steps ran at (read before the step)."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg, total_steps=total)
    used = []
    for _ in range(steps):
        used.append(optimizer.param_groups[0]["lr"])
        weight.grad = torch.ones(3)
        optimizer.step()
        scheduler.step()
    return used


def test_linear_decay_after_warmup_matches_hand_computed_values() -> None:
    cfg = OptimizerConfig(lr=LR, warmup_steps=2, lr_schedule="linear", min_lr_ratio=0.1)
    # steps 1-2 warm up (1/2, 1); steps 2..6 fall linearly from 1 to 0.1 (0.225 per step); step 7 stays
    expected = [0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]
    assert lrs_used(cfg, total=6, steps=7) == pytest.approx([LR * f for f in expected], abs=1e-12)


def test_cosine_decay_without_warmup_matches_hand_computed_values() -> None:
    cfg = OptimizerConfig(lr=LR, lr_schedule="cosine", min_lr_ratio=0.0)
    # peak at step 1, then 0.5 * (1 + cos(pi * (k - 1) / 4)) for k = 2..5
    c = math.cos(math.pi / 4)
    expected = [1.0, 0.5 * (1 + c), 0.5, 0.5 * (1 - c), 0.0]
    assert lrs_used(cfg, total=5, steps=5) == pytest.approx([LR * f for f in expected], abs=1e-12)


def test_cosine_floor_and_warmup() -> None:
    cfg = OptimizerConfig(lr=1.0, warmup_steps=4, lr_schedule="cosine", min_lr_ratio=0.2)
    used = lrs_used(cfg, total=8, steps=9)
    assert used[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert used[5] == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 2 / 4)))  # step 6: halfway
    assert used[7:] == pytest.approx([0.2, 0.2])


def _historical_factor(warmup_steps: int) -> Callable[[int], float]:
    """The warm-up-then-constant factor as it was before schedules existed."""
    return lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


@pytest.mark.parametrize("warmup", [0, 1, 3, 7])
def test_default_schedule_is_bitwise_the_historical_one(warmup: int) -> None:
    cfg = OptimizerConfig(lr=2e-5, warmup_steps=warmup)
    assert cfg.lr_schedule == "constant"
    reference = _historical_factor(warmup)
    assert lrs_used(cfg, total=3, steps=12) == [2e-5 * reference(s) for s in range(12)]  # exact equality


def test_resume_continues_the_curve_from_the_scheduler_state() -> None:
    cfg = OptimizerConfig(lr=1.0, warmup_steps=1, lr_schedule="linear")
    whole = lrs_used(cfg, total=6, steps=6)
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([weight], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg, total_steps=6)
    for _ in range(3):
        weight.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    saved_opt, saved_sched = optimizer.state_dict(), scheduler.state_dict()
    weight2 = torch.nn.Parameter(torch.ones(2))
    optimizer2 = torch.optim.AdamW([weight2], lr=cfg.lr)
    scheduler2 = build_scheduler(optimizer2, cfg, total_steps=6)
    optimizer2.load_state_dict(saved_opt)
    scheduler2.load_state_dict(saved_sched)
    rest = []
    for _ in range(3):
        rest.append(optimizer2.param_groups[0]["lr"])
        weight2.grad = torch.ones(2)
        optimizer2.step()
        scheduler2.step()
    assert rest == whole[3:]


def test_schedule_knobs_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"rl\.optimizer\.lr_schedule='step'"):
        build_config(None, ["rl.optimizer.lr_schedule=step"])
    with pytest.raises(ConfigError, match=r"rl\.optimizer\.min_lr_ratio=1\.5: Input should be less than or equal"):
        build_config(None, ["rl.optimizer.min_lr_ratio=1.5"])


def test_trainer_decays_over_max_steps_times_n_mini(
    tiny_model_dir: str, tmp_path: Path, run_overrides: Callable[..., list[str]]
) -> None:
    """Two collected batches of two mini-batches: four optimizer steps; linear decay to 0 reaches 0 at
    the fourth. ``optim/lr`` is the rate after the batch's last step (the next step's)."""
    from posttrain.loop.grpo import train

    overrides = run_overrides(
        tiny_model_dir,
        tmp_path,
        "sched",
        "rl.max_steps=2",
        "rl.mini_batch_per_replica=4",
        "rl.optimizer.lr_schedule=linear",
        "rl.optimizer.min_lr_ratio=0.0",
    )
    run_dir = train(build_config(None, overrides))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["optim/step"] for r in records] == [2.0, 4.0]  # no zero-gradient skip in this run
    # after 2 steps: step 3 of 4 runs at 1 - (3 - 1) / (4 - 1) = 1/3 of lr; after 4: the floor, 0
    assert records[0]["optim/lr"] == pytest.approx(1e-3 / 3)
    assert records[1]["optim/lr"] == 0.0
