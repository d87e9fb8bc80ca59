"""Tensor-parallel rollout under ``grid.backend=ray`` on CUDA GPUs (issue 21 item 2's GPU check).

* One or two GPUs: a 1-GPU policy and a TP-2 replica need 3, so the started-cluster capacity check
  refuses the run before any model loads (the message carries the replicas x TP arithmetic).
* Three or more GPUs: the policy on one GPU, one vLLM replica of TP 2 (two lanes forming one engine
  with ``distributed_executor_backend=external_launcher``, NCCL between them) on two others; 3 steps
  with each weight transport that reaches every lane (``object_store``; ``nccl``: a pair group per
  lane); after the first sync the sampler's logprobs track the trainer's.

Run on the device machine in a pytest process of its own: ``pytest -m gpu tests/gpu/test_rollout_tp_gpu.py``
(vLLM and Ray installed). The policy is a tiny random model with two attention heads built by the
test (TP 2 must divide the head counts; SmolLM2-135M's 9 heads do not split over 2 ranks).
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

TOKENIZER = Path(__file__).parent.parent / "fixtures" / "smollm2_tokenizer"


def _grpo(tmp_path: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("ray")
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    from posttrain.models.tiny import make_tiny_model

    model = make_tiny_model(str(tmp_path / "m"), str(TOKENIZER), num_heads=2, num_kv_heads=1)
    args = [
        f"model.name_or_path={model}",
        f"job.output_root={tmp_path}",
        f"job.name={name}",
        "rl.max_steps=3",
        "rl.save_every=0",
        "grid.backend=ray",
        "grid.gpu_placement=disaggregated",
        "grid.collective_timeout_s=300",
        "rollout.backend=vllm",
        "rollout.tensor_parallel_size=2",
        "grid.shapes.rollout=[1,2]",
        *extra,
    ]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "posttrain.entrypoints.grpo", "--", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=False,
    )


def _frames(tmp_path: Path, name: str) -> list[dict[str, float]]:
    (run_dir,) = (tmp_path / "posttrain" / "grpo" / name).iterdir()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_too_few_gpus_are_refused_before_anything_loads(tmp_path: Path) -> None:
    if torch.cuda.device_count() >= 3:
        pytest.skip("3+ GPUs hold a 1-GPU policy and a TP-2 replica: see the next test")
    res = _grpo(tmp_path, "short", "rl.weight_sync_transport=object_store")
    assert res.returncode == 1, res.stderr[-4000:]
    assert (
        "but the roles need 3 (disaggregated, two pools: POLICY_RANKS=1 + ROLLOUT_REPLICAS x ROLLOUT_RANKS=1 x 2)"
        in (res.stderr)
    ), res.stderr[-4000:]


@pytest.mark.parametrize("transport", ["object_store", "nccl"])
def test_a_tp2_vllm_replica_trains(tmp_path: Path, transport: str) -> None:
    if torch.cuda.device_count() < 3:
        pytest.skip("a 1-GPU policy and a TP-2 replica need 3 GPUs")
    pytest.importorskip("vllm")
    res = _grpo(tmp_path, transport, f"rl.weight_sync_transport={transport}", "rollout.gpu_memory_utilization=0.5")
    assert res.returncode == 0, res.stderr[-4000:]
    frames = _frames(tmp_path, transport)
    assert [f["step"] for f in frames] == [1, 2, 3]
    # step 2 sampled after the first sync on both ranks (fp32; GPU kernels differ from the trainer's)
    assert frames[1]["train/logprob_gap_max"] < 1e-2, frames[1]
