"""Multimodal GRPO with ``rollout.backend=vllm`` on a CUDA GPU (vLLM 0.24 on the device): a tiny random
Qwen3-VL policy on the built-in shape-count task, colocated vLLM engine sent the decoded images
(``rollout/vllm_images.py``), its expansion of the image placeholders checked against the
processor's at every call, weights (vision tower included) synced after each step.

Checked: the run ends, every step trained, and the sampler's logprobs agree with the trainer's
after weight syncs (``train/logprob_gap_mean`` on steps 2+, bf16 on both sides, the bound of
tests/gpu/test_vllm_gpu.py), which only holds if the engine samples the image prompts the trainer
scores with the weights it trains. Step time and tokens/s go to ``$POSTTRAIN_GPU_TEST_REPORT`` when
set (benchmarks/gpu_tests.md records them). Run in a pytest process of its own on the device machine.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch

from posttrain.entrypoints.grpo import main

pytestmark = pytest.mark.gpu
E2E_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "e2e"
MEAN_GAP_TOL = 0.1


def test_multimodal_grpo_with_vllm_trains_and_keeps_the_engine_in_step(
    tmp_path: Path, smollm2_tokenizer_dir: str
) -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    pytest.importorskip("vllm", reason="vLLM is not installed (see docs/vllm.md)")
    from posttrain.models.tiny import make_tiny_vl_model

    # vision heads of 32 or more (vLLM's attention kernels refuse smaller ones)
    model = make_tiny_vl_model(str(tmp_path / "tiny_vl"), smollm2_tokenizer_dir, vision_hidden_size=64)
    sys.path.insert(0, str(E2E_DIR))
    steps = int(os.environ.get("POSTTRAIN_VL_GPU_STEPS", "6"))
    overrides = [
        f"model.name_or_path={model}",
        f"job.output_root={tmp_path / 'runs'}",
        "job.name=vl_vllm",
        "rollout.backend=vllm",
        "rollout.gpu_memory_utilization=0.2",
        "rollout.max_model_len=1024",
        "rl.data.factory=posttrain.data.visual:shape_count_rows",
        "rl.reward=e2e_rewards:length_reward",
        "rl.batch_per_replica=64",
        "rl.group_size=8",
        "rollout.max_tokens=32",
        "rl.optimizer.lr=1e-4",
        f"rl.max_steps={steps}",
    ]
    assert main(["--", *overrides]) == 0
    run_dir = sorted((tmp_path / "runs" / "posttrain" / "grpo" / "vl_vllm").iterdir())[-1]
    frames = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(frames) == steps
    gaps = [f["train/logprob_gap_mean"] for f in frames[1:] if "train/logprob_gap_mean" in f]
    assert gaps and max(gaps) < MEAN_GAP_TOL, gaps
    report = {
        "steps": steps,
        "median_step_s": statistics.median(f["timer/e2e_step_s"] for f in frames[1:]),
        "median_rollout_tokens_per_s": statistics.median(f["rollout/tokens_per_s"] for f in frames[1:]),
        "images_per_step": 64 // 8,
        "logprob_gap_mean": gaps,
        "frames": frames,
    }
    if os.environ.get("POSTTRAIN_GPU_TEST_REPORT"):
        Path(os.environ["POSTTRAIN_GPU_TEST_REPORT"]).write_text(json.dumps(report, indent=1))
    print({k: v for k, v in report.items() if k != "frames"})
