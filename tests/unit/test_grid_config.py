"""Topology checks of the preflight: shapes, backends, data parallelism, the allocation.

They need no cluster and no torch: each rule is checked in process through ``preflight`` and the
command line ``--validate-manifest`` is run for a few of them (all problems at once, torch never
imported, torchrun's ``WORLD_SIZE`` read from the environment).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from posttrain.config.loading import build_config
from posttrain.preflight.grpo import grpo_preflight as preflight

LOCAL_ENGINES = "with grid.gpu_placement=colocated every policy rank holds one colocated rollout engine"
PYTHON_IMPORTTIME = [sys.executable, "-X", "importtime", "-m"]
ONE_NODE_OF_3 = ["grid.num_nodes=1", "grid.gpus_per_node=3"]


def _errors(overrides: list[str], monkeypatch: pytest.MonkeyPatch, world_size: str | None = None) -> list[str]:
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    return preflight(build_config(None, overrides)).errors


@pytest.mark.parametrize(
    ("overrides", "world_size", "needle"),
    [
        (["grid.shapes.policy=[2,1]"], None, "POLICY_REPLICAS must be 1"),
        (["grid.shapes.policy=[2,1]"], None, "data parallelism is grid.dp_replicate x grid.dp_shard"),
        (["grid.shapes.policy=[2,2]"], None, "write grid.shapes.policy=[1,4]"),
        (["grid.shapes.rollout=[1,2]"], None, "ROLLOUT_RANKS=2 must equal rollout.tensor_parallel_size=1"),
        (["grid.shapes.policy=[1,2,3]"], None, "must be [REPLICAS, RANKS]: two integers, both >= 1"),
        (["grid.shapes.rollout=[0,1]"], None, "grid.shapes.rollout=[0, 1] must be [REPLICAS, RANKS]"),
        (["grid.shapes.policy=[]"], None, "grid.shapes.policy=[] must be [REPLICAS, RANKS]"),
        (
            ["rollout.tensor_parallel_size=2", "grid.shapes.rollout=[1,2]"],
            None,
            "rollout.tensor_parallel_size=2 needs grid.backend=ray",
        ),
        (["grid.gpu_placement=disaggregated"], None, "disaggregated needs grid.backend=ray"),
        (["grid.num_nodes=2", "grid.gpus_per_node=8"], None, "grid.num_nodes=2: several nodes need grid.backend=ray"),
        (["grid.shapes.policy=[1,4]", "grid.dp_replicate=3"], None, "grid.dp_replicate=3 must divide POLICY_RANKS=4"),
        (
            ["grid.shapes.policy=[1,4]", "grid.dp_replicate=2", "grid.dp_shard=4"],
            None,
            "grid.dp_replicate=2 x grid.dp_shard=4 must equal POLICY_RANKS=4",
        ),
        (["grid.dp_shard=2"], None, "grid.dp_replicate=1 x grid.dp_shard=2 must equal POLICY_RANKS=1"),
        (
            ["grid.shapes.policy=[1,2]", "rl.group_size=8", "rl.batch_per_replica=8"],
            None,
            "must be a multiple of rl.group_size x POLICY_RANKS = 16",
        ),
        (
            ["grid.shapes.policy=[1,2]", "rl.mini_batch_per_replica=8"],
            None,
            "the mini-batch of 8 trajectories",
        ),
        (["grid.num_nodes=1"], None, "declare both or neither"),
        (
            ["grid.shapes.policy=[1,2]", "grid.num_nodes=1", "grid.gpus_per_node=1"],
            None,
            "the allocation has 1 GPUs (grid.num_nodes=1 x grid.gpus_per_node=1) but grid.shapes policy=[1, 2]",
        ),
        (
            ["grid.backend=ray", "grid.shapes.policy=[1,2]", "grid.shapes.rollout=[4,1]", *ONE_NODE_OF_3],
            None,
            "need 4 (colocated, one shared pool: max(POLICY_RANKS=2, ROLLOUT_REPLICAS x ROLLOUT_RANKS=4))",
        ),
        (
            [
                "grid.backend=ray",
                "grid.gpu_placement=disaggregated",
                "grid.shapes.policy=[1,2]",
                "grid.shapes.rollout=[2,1]",
                *ONE_NODE_OF_3,
            ],
            None,
            "need 4 (disaggregated, two pools: POLICY_RANKS=2 + ROLLOUT_REPLICAS x ROLLOUT_RANKS=2)",
        ),
        ([], "2", "torchrun started WORLD_SIZE=2 processes but grid.shapes.policy=[1, 1] has POLICY_RANKS=1"),
        (
            ["grid.shapes.policy=[1,2]", "grid.shapes.rollout=[3,1]"],
            "2",
            "the allocation has 2 GPUs (torchrun WORLD_SIZE=2, one GPU per process)",
        ),
        ([], "two", "WORLD_SIZE='two' (set by torchrun) is not a positive integer"),
        (
            ["grid.backend=ray", "rollout.tensor_parallel_size=2", "grid.shapes.rollout=[1,2]"],
            None,
            "rollout replicas wider than one device are not implemented yet",
        ),
        (
            ["grid.backend=ray", "grid.gpu_placement=disaggregated", "grid.shapes.rollout=[2,1]"],
            None,
            "ROLLOUT_REPLICAS must be <= POLICY_RANKS",
        ),
        (["grid.backend=ray", "grid.gpu_placement=disaggregated"], None, "use object_store"),
        (["rl.weight_sync_transport=object_store"], None, "colocated engines receive the weights in their own process"),
        (["grid.shapes.policy=[1,2]", "rl.max_off_policy_steps=1"], None, "use rl.max_off_policy_steps=0 with several"),
        (
            [
                "grid.backend=ray",
                "grid.gpu_placement=disaggregated",
                "rl.weight_sync_transport=object_store",
                "rollout.backend=vllm",
                "rl.use_rollout_logprobs_for_loss=true",
                "rl.max_off_policy_steps=1",
            ],
            None,
            "rl.max_off_policy_steps=1 with grid.gpu_placement=disaggregated",
        ),
        (["grid.shapes.rollout=[2,1]"], None, LOCAL_ENGINES),
        (["grid.shapes.policy=[1,4]", "rl.batch_per_replica=64", "grid.shapes.rollout=[2,1]"], None, LOCAL_ENGINES),
    ],
)
def test_topology_problems_are_named(
    monkeypatch: pytest.MonkeyPatch, overrides: list[str], world_size: str | None, needle: str
) -> None:
    errors = _errors(overrides, monkeypatch, world_size)
    assert any(needle in e for e in errors), errors


@pytest.mark.parametrize(
    "overrides",
    [
        ["grid.shapes.policy=[1,4]", "grid.dp_replicate=2", "rl.batch_per_replica=64"],
        ["grid.shapes.policy=[1,4]", "grid.dp_replicate=2", "grid.dp_shard=2", "rl.batch_per_replica=64"],
        ["grid.shapes.policy=[1,2]", "grid.num_nodes=1", "grid.gpus_per_node=2"],
        ["grid.shapes.policy=[1,2]", "rl.mini_batch_per_replica=16"],
        ["grid.shapes.policy=[1,2]", "grid.shapes.rollout=[2,1]", "rl.min_informative_groups_frac=0.5"],
        ["grid.backend=ray", "grid.shapes.policy=[1,2]"],
        [
            "grid.backend=ray",
            "grid.shapes.policy=[1,2]",
            "grid.gpu_placement=disaggregated",
            "rl.weight_sync_transport=object_store",
        ],
        ["grid.backend=ray", "grid.gpu_placement=disaggregated", "rl.weight_sync_transport=nccl"],
        pytest.param(
            [
                "grid.backend=ray",
                "grid.shapes.policy=[1,2]",
                "grid.gpu_placement=disaggregated",
                "rl.weight_sync_transport=object_store",
                "rollout.backend=vllm",
            ],
            marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
        ),
    ],
)
def test_valid_multi_rank_layouts_are_accepted(monkeypatch: pytest.MonkeyPatch, overrides: list[str]) -> None:
    assert _errors(overrides, monkeypatch) == []


def test_torchrun_world_is_the_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _errors([], monkeypatch, world_size="1") == []
    assert _errors(["grid.shapes.policy=[1,2]"], monkeypatch, world_size="2") == []
    # the Ray backend takes no torchrun world: WORLD_SIZE is not its allocation
    assert not any("WORLD_SIZE" in e for e in _errors(["grid.backend=ray"], monkeypatch, world_size="7"))


def test_nixl_needs_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a))
    overrides = ["grid.backend=ray", "grid.gpu_placement=disaggregated", "rl.weight_sync_transport=nixl"]
    errors = _errors(overrides, monkeypatch)
    assert any("the nixl library is not installed (import nixl fails)" in e for e in errors), errors


def _validate(*overrides: str, world_size: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    if world_size is not None:
        env["WORLD_SIZE"] = world_size
    return subprocess.run(
        [
            *PYTHON_IMPORTTIME,
            "posttrain.entrypoints.grpo",
            "--config",
            "default",
            "--validate-manifest",
            "--",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_validate_manifest_reports_every_topology_problem_without_torch() -> None:
    res = _validate(
        "grid.shapes.policy=[2,1]",
        "grid.shapes.rollout=[1,2]",
        "grid.gpu_placement=disaggregated",
        "grid.num_nodes=1",
    )
    assert res.returncode == 1
    for needle in (
        "POLICY_REPLICAS must be 1",
        "ROLLOUT_RANKS=2",
        "disaggregated needs grid.backend=ray",
        "declare both",
    ):
        assert needle in res.stderr, res.stderr
    assert "| torch" not in res.stderr


def test_validate_manifest_checks_the_torchrun_world() -> None:
    res = _validate("grid.shapes.policy=[1,2]", "grid.shapes.rollout=[3,1]", world_size="2")
    assert res.returncode == 1
    assert "the allocation has 2 GPUs" in res.stderr and "need 3" in res.stderr, res.stderr
    ok = _validate(world_size="1")
    assert ok.returncode == 0 and "manifest OK" in ok.stdout, ok.stderr


def test_validate_manifest_checks_the_ray_layout_without_ray() -> None:
    res = _validate(
        "grid.backend=ray",
        "grid.gpu_placement=disaggregated",
        "grid.shapes.policy=[1,2]",
        "grid.shapes.rollout=[3,1]",
        "rl.weight_sync_transport=inprocess",
    )
    assert res.returncode == 1
    for needle in ("ROLLOUT_REPLICAS must be <= POLICY_RANKS", "rl.weight_sync_transport=inprocess"):
        assert needle in res.stderr, res.stderr
    assert "| ray" not in res.stderr and "| torch" not in res.stderr  # nothing heavy imported
    ok = _validate("grid.backend=ray", "grid.shapes.policy=[1,2]")
    assert ok.returncode == 0 and "manifest OK" in ok.stdout, ok.stderr
