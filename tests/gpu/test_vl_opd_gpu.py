"""Multimodal on-policy distillation on a CUDA GPU with the student sampling through vLLM (0.24 on the
device): a tiny Qwen3-VL teacher trained for a few steps on the shape-count answers and its student
(the teacher cut to one text layer), both with a 64-wide vision tower (vLLM's attention kernels
refuse heads under 32 wide), ``rl.teacher.input_mode=shared_vocab_multimodal``, direct top-k
distillation; the transformers teacher renders its own image prefix from the same bytes.

Checked: every step scored every sequence and trained, the divergence falls, and the sampler's
logprobs stay in step with the trainer's after each weight sync. Step time and tokens/s go to
``$POSTTRAIN_GPU_TEST_REPORT`` when set (benchmarks/gpu_tests.md). Run in a pytest process of its own.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
import torch

from posttrain.entrypoints.opd import main as opd_main

pytestmark = pytest.mark.gpu
MEAN_GAP_TOL = 0.1


def test_multimodal_direct_opd_with_a_vllm_student(tmp_path: Path, smollm2_tokenizer_dir: str) -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    pytest.importorskip("vllm", reason="vLLM is not installed (see docs/vllm.md)")
    from posttrain.models.tiny import make_tiny_vl_model
    from posttrain.models.vl_opd_demo import train_on_counts, truncate_text_layers

    teacher = make_tiny_vl_model(
        str(tmp_path / "teacher"), smollm2_tokenizer_dir, num_layers=4, vision_depth=1, vision_hidden_size=64
    )
    train_on_counts(teacher, 40, lr=1e-2).save_pretrained(teacher)
    truncate_text_layers(teacher, str(tmp_path / "student"), 1)
    steps = int(os.environ.get("POSTTRAIN_VL_GPU_STEPS", "8"))
    overrides = [
        f"model.name_or_path={tmp_path / 'student'}",
        f"rl.teacher.name_or_path={tmp_path / 'teacher'}",
        "rl.teacher.input_mode=shared_vocab_multimodal",
        f"job.output_root={tmp_path / 'runs'}",
        "job.name=vl_opd_vllm",
        "rollout.backend=vllm",
        "rollout.gpu_memory_utilization=0.2",
        "rollout.max_model_len=1024",
        "rl.data.factory=posttrain.data.visual:shape_count_rows",
        "rl.reward=arithmetic",
        "rl.batch_per_replica=64",
        "rl.group_size=8",
        "rollout.max_tokens=8",
        "rl.optimizer.lr=3e-3",
        f"rl.max_steps={steps}",
    ]
    assert opd_main(["--", *overrides]) == 0
    run_dir = sorted((tmp_path / "runs" / "posttrain" / "opd" / "vl_opd_vllm").iterdir())[-1]
    frames = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [f["step"] for f in frames] == list(range(1, steps + 1))
    assert all(f["train/opd_teacher_scored_sequences"] == 64 for f in frames)
    divergence = [f["train/opd_divergence"] for f in frames]
    assert divergence[-1] < divergence[0], divergence
    gaps = [f["train/logprob_gap_mean"] for f in frames[1:] if "train/logprob_gap_mean" in f]
    assert not gaps or max(gaps) < MEAN_GAP_TOL, gaps
    report = {
        "steps": steps,
        "median_step_s": statistics.median(f["timer/e2e_step_s"] for f in frames[1:]),
        "median_rollout_tokens_per_s": statistics.median(f["rollout/tokens_per_s"] for f in frames[1:]),
        "images_per_step": 64 // 8,
        "divergence": divergence,
        "logprob_gap_mean": gaps,
        "frames": frames,
    }
    if os.environ.get("POSTTRAIN_GPU_TEST_REPORT"):
        Path(os.environ["POSTTRAIN_GPU_TEST_REPORT"]).write_text(json.dumps(report, indent=1))
    print({k: v for k, v in report.items() if k != "frames"})
