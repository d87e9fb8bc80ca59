"""GPU-only checks (``pytest -m gpu`` on the device machine; deselected everywhere else)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.config.loading import build_config
from posttrain.loop.grpo import train

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")


def test_default_dtype_is_bf16_on_cuda_and_a_run_trains(tiny_model_dir: str, tmp_path: Path) -> None:
    e2e = str(Path(__file__).resolve().parents[1] / "fixtures" / "e2e")
    import sys

    sys.path.insert(0, e2e)
    cfg = build_config(
        None,
        [
            f"model.name_or_path={tiny_model_dir}",
            f"job.output_root={tmp_path}",
            "rl.reward=e2e_rewards:length_reward",
            "rl.max_steps=3",
            "rl.batch_per_replica=16",
            "rl.group_size=4",
            "rl.optimizer.lr=1e-3",
        ],
    )
    run_dir = train(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0 for r in records)
    assert torch.cuda.max_memory_allocated() > 0
