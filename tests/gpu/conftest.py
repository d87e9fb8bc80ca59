"""Fixtures shared by the GPU tests (``pytest -m gpu`` on the device machine)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from posttrain.config.loading import build_config

E2E_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "e2e"
GrpoRun = Callable[..., tuple[Any, Path, list[dict[str, Any]]]]


@pytest.fixture
def grpo_run(tmp_path: Path) -> GrpoRun:
    """``grpo_run(model_dir, *overrides)``: three GRPO steps of 16 samples (groups of 4, lr 1e-3) on the
    e2e length reward, into ``tmp_path``; returns the config, the run directory and its metrics records."""

    def run(model_dir: str, *overrides: str) -> tuple[Any, Path, list[dict[str, Any]]]:
        from posttrain.loop.grpo import train

        sys.path.insert(0, str(E2E_DIR))
        cfg = build_config(
            None,
            [
                f"model.name_or_path={model_dir}",
                f"job.output_root={tmp_path}",
                "rl.reward=e2e_rewards:length_reward",
                "rl.max_steps=3",
                "rl.batch_per_replica=16",
                "rl.group_size=4",
                "rl.optimizer.lr=1e-3",
                *overrides,
            ],
        )
        run_dir = Path(train(cfg))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return cfg, run_dir, records

    return run
