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


def test_default_precision_on_cuda_is_mixed_and_a_run_trains(tiny_model_dir: str, tmp_path: Path) -> None:
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
    # fp32 master weights by default on CUDA (the compute runs on bf16 copies of them)
    from posttrain.models.precision import resolve_precision

    assert "on cuda:0 in torch.float32" in (run_dir / "train.log").read_text()
    precision = resolve_precision(cfg.model.dtype, cfg.model.compute_dtype, torch.device("cuda"))
    assert (precision.param_dtype, precision.compute_dtype) == (torch.float32, torch.bfloat16)
