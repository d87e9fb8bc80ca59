"""Tensor-parallel rollout replicas (``rollout.tensor_parallel_size > 1``) without Ray or a model load:
the preflight's mismatch rules (each refused by name), the capacity arithmetic (replicas x TP
GPUs, its own pool when disaggregated) and the lanes' completion digest."""

from __future__ import annotations

import pytest

from posttrain.config.loading import build_config
from posttrain.config.schema import GRPOConfig
from posttrain.distributed.placement import cluster_shortfall, role_plan
from posttrain.preflight.grpo import grpo_preflight
from posttrain.rollout.base import Completion, RolloutBatch
from posttrain.rollout.lanes_proxy import batch_digest, lane_name

TP2 = [
    "grid.backend=ray",
    "grid.gpu_placement=disaggregated",
    "rollout.backend=vllm",
    "rollout.tensor_parallel_size=2",
    "grid.shapes.rollout=[1,2]",
    "rl.weight_sync_transport=object_store",
]


def _cfg(tiny_model_dir: str, *overrides: str) -> GRPOConfig:
    return build_config(None, [f"model.name_or_path={tiny_model_dir}", *overrides])


def _errors(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> list[str]:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return grpo_preflight(_cfg(tiny_model_dir, *overrides)).errors


def test_a_disaggregated_tp2_vllm_replica_passes(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm", reason="the preflight checks that vLLM is importable")
    pytest.importorskip("ray")
    assert _errors(tiny_model_dir, monkeypatch, *TP2) == []
    assert _errors(tiny_model_dir, monkeypatch, *TP2, "rl.weight_sync_transport=nccl") == []
    # TP 4 over 4 heads and 2 key/value heads: each key/value head replicated on 2 ranks
    tp4 = ["rollout.tensor_parallel_size=4", "grid.shapes.rollout=[1,4]"]
    assert _errors(tiny_model_dir, monkeypatch, *TP2, *tp4) == []
    # two replicas of TP 2 for two policy ranks on one node of 6 GPUs: 2 + 2 x 2
    six = ["grid.shapes.policy=[1,2]", "grid.shapes.rollout=[2,2]", "grid.num_nodes=1", "grid.gpus_per_node=6"]
    assert _errors(tiny_model_dir, monkeypatch, *TP2, *six) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.backend=hf"],
            "rollout.tensor_parallel_size=2 with rollout.backend=hf: the transformers engine has no tensor "
            "parallelism; use rollout.backend=vllm",
        ),
        (
            ["grid.gpu_placement=colocated", "rl.weight_sync_transport=inprocess"],
            "rollout.tensor_parallel_size=2 with grid.gpu_placement=colocated: colocated rollout replicas wider "
            "than one device are not implemented yet",
        ),
        (["rl.weight_sync_transport=nixl"], "rl.weight_sync_transport=nixl cannot reach all 2 lanes"),
        (
            ["grid.num_nodes=2", "grid.gpus_per_node=3"],
            "rollout.tensor_parallel_size=2 does not divide grid.gpus_per_node=3",
        ),
        (["model.lora.rank=4"], "adapter sync into a tensor-parallel replica is not implemented yet"),
        (  # the tiny model: 4 attention heads, 2 key/value heads
            ["rollout.tensor_parallel_size=3", "grid.shapes.rollout=[1,3]"],
            "has 4 attention heads and 2 key/value heads, which vLLM cannot split over 3 tensor-parallel ranks",
        ),
        (["grid.backend=local"], "rollout.tensor_parallel_size=2 needs grid.backend=ray"),
        (["grid.shapes.rollout=[1,1]"], "ROLLOUT_RANKS=1 must equal rollout.tensor_parallel_size=2"),
        (
            ["grid.num_nodes=1", "grid.gpus_per_node=2"],
            "the allocation has 2 GPUs (grid.num_nodes=1 x grid.gpus_per_node=2) but grid.shapes policy=[1, 1] "
            "rollout=[1, 2] need 3 (disaggregated, two pools: POLICY_RANKS=1 + ROLLOUT_REPLICAS x ROLLOUT_RANKS="
            "1 x 2)",
        ),
        (  # docs/distributed.md's TP placement on a node of 4
            ["grid.shapes.policy=[1,2]", "grid.shapes.rollout=[2,2]", "grid.num_nodes=1", "grid.gpus_per_node=4"],
            "need 6 (disaggregated, two pools: POLICY_RANKS=2 + ROLLOUT_REPLICAS x ROLLOUT_RANKS=2 x 2)",
        ),
    ],
)
def test_mismatches_are_refused_by_name(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch, overrides: list[str], message: str
) -> None:
    errors = _errors(tiny_model_dir, monkeypatch, *TP2, *overrides)
    assert any(message in e for e in errors), errors


def test_capacity_counts_replicas_times_tp(tiny_model_dir: str) -> None:
    shapes = ["grid.shapes.policy=[1,2]", "grid.shapes.rollout=[2,4]", "rollout.tensor_parallel_size=4"]
    plan = role_plan(_cfg(tiny_model_dir, *TP2, *shapes))
    assert (plan.policy_ranks, plan.rollout_gpus, plan.total) == (2, 8, 10)
    assert plan.arithmetic() == "disaggregated, two pools: POLICY_RANKS=2 + ROLLOUT_REPLICAS x ROLLOUT_RANKS=2 x 4"
    short = cluster_shortfall(plan, {"GPU": 8.0, "CPU": 64.0})
    assert short is not None and "has 8 GPU(s) but the roles need 10" in short
    assert cluster_shortfall(plan, {"GPU": 10.0, "CPU": 64.0}) is None
    # on a CPU-only cluster every lane is an actor of one CPU: 2 + 8
    assert cluster_shortfall(plan, {"CPU": 9.0}) is not None and cluster_shortfall(plan, {"CPU": 10.0}) is None
    # single-device replicas keep the arithmetic (and its wording) of before
    tp1 = role_plan(_cfg(tiny_model_dir, "grid.backend=ray", "grid.gpu_placement=disaggregated"))
    assert tp1.arithmetic() == "disaggregated, two pools: POLICY_RANKS=1 + ROLLOUT_REPLICAS x ROLLOUT_RANKS=1"


def _batch(token_ids: list[int], logprobs: list[float], version: int = 1) -> RolloutBatch:
    return RolloutBatch([[1, 2]], [Completion(0, token_ids, logprobs, "length")], version)


def test_the_lanes_digest_tells_equal_completions_from_different_ones() -> None:
    base = batch_digest(_batch([5, 6], [-0.5, -1.25]))
    assert batch_digest(_batch([5, 6], [-0.5, -1.25])) == base
    assert batch_digest(_batch([5, 7], [-0.5, -1.25])) != base  # another token
    assert batch_digest(_batch([5, 6], [-0.5, -1.2500000000000002])) != base  # one ulp of a logprob
    assert batch_digest(_batch([5, 6], [-0.5, -1.25], version=2)) != base  # another weight version
    assert lane_name(1, 0) == "rollout-1-0"
