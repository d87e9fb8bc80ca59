"""The OPD teacher pool under ``grid.backend=ray`` on CUDA GPUs (issue 21's GPU acceptance).

* One GPU: colocated OPD needs ``K + T = 1 + 1`` GPUs (the teacher owns its device), so the run is
  refused by the started-cluster capacity check before any model loads; with two or more GPUs the
  same command trains 2 steps with the teacher on a GPU of its own.
* Three or more GPUs: a vLLM teacher of tensor-parallel width 2 (two lanes forming one engine with
  ``distributed_executor_backend=external_launcher``) beside a 1-GPU policy; 2 steps.

Run on the device machine in a pytest process of its own: ``pytest -m gpu tests/gpu/test_teacher_pool_gpu.py``
(vLLM and Ray installed). The student and the teacher are the embedded SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("POSTTRAIN_GPU_TEST_MODEL", "embedded:smollm2-135m-instruct")


def _opd(tmp_path: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("ray")
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    args = [
        f"model.name_or_path={MODEL}",
        f"rl.teacher.name_or_path={MODEL}",
        f"job.output_root={tmp_path}",
        f"job.name={name}",
        "rl.max_steps=2",
        "rl.save_every=0",
        "grid.backend=ray",
        "grid.collective_timeout_s=300",
        *extra,
    ]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "posttrain.entrypoints.opd", "--", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=False,
    )


def _steps(tmp_path: Path, name: str) -> list[int]:
    (run_dir,) = (tmp_path / "posttrain" / "opd" / name).iterdir()
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_teacher_takes_a_gpu_of_its_own(tmp_path: Path) -> None:
    res = _opd(tmp_path, "k_plus_t")
    if torch.cuda.device_count() == 1:
        assert res.returncode == 1, res.stderr[-4000:]
        assert "the Ray cluster this run started has 1 GPU(s) but the roles need 2 (colocated OPD, K + T" in res.stderr
        assert "run directory" not in res.stderr + res.stdout  # refused before anything loaded
        return
    assert res.returncode == 0, res.stderr[-4000:]
    assert _steps(tmp_path, "k_plus_t") == [1, 2]


def test_a_vllm_teacher_of_two_ranks(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 3:
        pytest.skip("a 1-GPU policy and a TP-2 teacher need 3 GPUs")
    pytest.importorskip("vllm")
    teacher = ["rl.teacher.backend=vllm", "rl.teacher.tensor_parallel_size=2", "rl.teacher.gpu_memory_utilization=0.5"]
    res = _opd(tmp_path, "tp2", *teacher)
    assert res.returncode == 0, res.stderr[-4000:]
    assert _steps(tmp_path, "tp2") == [1, 2]
