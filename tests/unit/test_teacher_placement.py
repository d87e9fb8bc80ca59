"""The teacher role's placement arithmetic, its refusals, the Ray-cluster capacity check, and the pool's
pure bookkeeping (shards, digests, the leader/lane check), all without Ray or a model load.

The capacity rule (spec opd.md): colocated OPD needs ``K + T`` GPUs (K the student's shared pool, T
the teacher's own pool), disaggregated OPD ``policy + rollout + teacher``; under the local backend
the teacher lives in each policy rank and takes no GPU of its own.
"""

from __future__ import annotations

import re

import pytest

from posttrain.config.loading import build_config
from posttrain.config.opd import OPDConfig
from posttrain.distributed.hub import gather_to_zero, scatter_from_zero
from posttrain.distributed.placement import RolePlan, cluster_line, cluster_shortfall, role_plan
from posttrain.preflight.grpo import grpo_preflight
from posttrain.preflight.opd import opd_preflight
from posttrain.teacher.base import ScoreRequest, SequenceScores, TeacherError
from posttrain.teacher.pool import LaneReply, check_lanes, request_digest, result_digest
from posttrain.teacher.remote import shard_bounds

RAY = ["grid.backend=ray"]
EIGHT_RANKS = ["grid.shapes.policy=[1,8]", "rl.batch_per_replica=32", "rl.group_size=4"]


def _opd(tiny_model_dir: str, *overrides: str) -> OPDConfig:
    base = [f"model.name_or_path={tiny_model_dir}", f"rl.teacher.name_or_path={tiny_model_dir}"]
    cfg: OPDConfig = build_config(None, [*base, *overrides], OPDConfig)
    return cfg


def _errors(cfg: OPDConfig, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return opd_preflight(cfg).errors


def test_role_plans_count_the_teacher_pool_only_under_ray(tiny_model_dir: str) -> None:
    # the spec's example: K=8 and T=1 need 9 GPUs, not one 8-GPU node
    plan = role_plan(_opd(tiny_model_dir, *RAY, *EIGHT_RANKS))
    assert (plan.student_gpus, plan.teacher_gpus, plan.total) == (8, 1, 9)
    assert "K + T" in plan.arithmetic() and "= 8 plus the teacher's own pool T" in plan.arithmetic()
    # under the local backend the teacher is in-process: no pool of its own
    assert role_plan(_opd(tiny_model_dir, *EIGHT_RANKS)).total == 8
    # disaggregated: policy 2 + rollout 1 + teacher 2 replicas x 2 ranks = 7
    shapes = ["grid.gpu_placement=disaggregated", "grid.shapes.policy=[1,2]", "grid.shapes.rollout=[1,1]"]
    teacher = ["rl.teacher.backend=vllm", "rl.teacher.tensor_parallel_size=2", "rl.teacher.replicas=2"]
    plan = role_plan(_opd(tiny_model_dir, *RAY, *shapes, *teacher))
    assert (plan.policy_ranks, plan.rollout_gpus, plan.teacher_gpus, plan.total) == (2, 1, 4, 7)
    assert plan.arithmetic() == (
        "disaggregated OPD, three pools: POLICY_RANKS=2 + ROLLOUT_REPLICAS x ROLLOUT_RANKS=1 + "
        "rl.teacher.replicas x rl.teacher.tensor_parallel_size=2 x 2"
    )
    # GRPO has no teacher: the arithmetic of before
    grpo = role_plan(build_config(None, [*RAY, "grid.shapes.policy=[1,2]", "grid.shapes.rollout=[2,1]"]))
    assert (grpo.total, grpo.arithmetic()) == (
        2,
        "colocated, one shared pool: max(POLICY_RANKS=2, ROLLOUT_REPLICAS x ROLLOUT_RANKS=2)",
    )


def test_the_preflight_refuses_an_allocation_without_room_for_the_teacher(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    one_node = ["grid.num_nodes=1", "grid.gpus_per_node=8"]
    errors = _errors(_opd(tiny_model_dir, *RAY, *EIGHT_RANKS, *one_node), monkeypatch)
    (capacity,) = [e for e in errors if e.startswith("the allocation has")]
    assert capacity.startswith(
        "the allocation has 8 GPUs (grid.num_nodes=1 x grid.gpus_per_node=8) but grid.shapes policy=[1, 8] "
        "rollout=[1, 1] and the teacher pool need 9 (colocated OPD, K + T:"
    )
    three_nodes = ["grid.num_nodes=3", "grid.gpus_per_node=3"]
    assert not [e for e in _errors(_opd(tiny_model_dir, *RAY, *EIGHT_RANKS, *three_nodes), monkeypatch) if "GPUs" in e]
    # the same config under the local backend: the teacher is in each rank, 8 GPUs are enough
    assert not [e for e in _errors(_opd(tiny_model_dir, *EIGHT_RANKS, *one_node), monkeypatch) if "allocation" in e]
    # GRPO's message is unchanged
    grpo = grpo_preflight(build_config(None, ["grid.shapes.policy=[1,2]", "grid.num_nodes=1", "grid.gpus_per_node=1"]))
    assert any("need 2 (colocated, one shared pool: max(POLICY_RANKS=2," in e for e in grpo.errors)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["rl.teacher.tensor_parallel_size=2"], "rl.teacher.tensor_parallel_size=2 needs grid.backend=ray"),
        (["rl.teacher.replicas=2"], "rl.teacher.replicas=2 needs grid.backend=ray"),
        (
            [*RAY, "rl.teacher.tensor_parallel_size=2"],
            "rl.teacher.tensor_parallel_size=2 with rl.teacher.backend=hf: the transformers teacher has no tensor",
        ),
    ],
)
def test_teacher_shapes_the_backends_cannot_run_are_refused(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch, overrides: list[str], needle: str
) -> None:
    errors = _errors(_opd(tiny_model_dir, *overrides), monkeypatch)
    assert any(needle in e for e in errors), errors


def test_a_ray_teacher_pool_of_vllm_ranks_passes_the_shape_rules(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _opd(
        tiny_model_dir, *RAY, "rl.teacher.backend=vllm", "rl.teacher.tensor_parallel_size=2", "rl.teacher.replicas=2"
    )
    assert not [e for e in _errors(cfg, monkeypatch) if "rl.teacher.replicas" in e or "tensor_parallel" in e]


def test_a_started_cluster_is_checked_and_a_joined_one_is_not() -> None:
    plan = RolePlan(
        "colocated", policy_ranks=2, rollout_replicas=1, rollout_ranks=1, teacher_replicas=1, teacher_ranks=1
    )
    assert plan.total == 3
    short = cluster_shortfall(plan, {"GPU": 2.0, "CPU": 16.0})
    assert short is not None and short.startswith("the Ray cluster this run started has 2 GPU(s) but the roles need 3")
    assert cluster_shortfall(plan, {"GPU": 3.0, "CPU": 3.0}) is None
    cpu_short = cluster_shortfall(plan, {"CPU": 2.0})
    assert cpu_short is not None and "no GPU and 2 CPU(s)" in cpu_short
    assert cluster_shortfall(plan, {"CPU": 4.0}) is None
    joined = cluster_line(plan, None, "head:6379")
    assert joined.startswith("joined the Ray cluster at head:6379: its capacity is not checked")
    assert "a shortfall seen now would prove nothing" in joined
    started = cluster_line(plan, {"GPU": 4.0, "CPU": 32.0}, None)
    assert started.startswith("started a local Ray cluster (32 CPU(s), 4 GPU(s)): capacity checked, the roles need 3")


def test_shards_cover_the_batch_in_order() -> None:
    assert shard_bounds(8, 2) == [(0, 4), (4, 8)]
    assert shard_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert shard_bounds(1, 2) == [(0, 1), (1, 1)]


def test_the_hub_is_trivial_in_one_process() -> None:
    assert gather_to_zero(["a"]) == [["a"]]
    assert scatter_from_zero([[1, 2]]) == [1, 2]


def _scores() -> list[SequenceScores]:
    return [SequenceScores([-0.5, -1.25], [[3, 4], [5, 6]], [[-0.1, -2.0], [-0.2, -3.0]]), SequenceScores([-2.0])]


def test_digests_see_every_id_position_and_bit() -> None:
    reqs = [ScoreRequest([1, 2, 3], 1), ScoreRequest([4, 5], 1)]
    assert request_digest(reqs, 4) == request_digest(list(reqs), 4)
    assert request_digest(reqs, 4) != request_digest(reqs, 3)
    assert request_digest(reqs, 4) != request_digest([ScoreRequest([1, 2, 3], 2), reqs[1]], 4)
    assert request_digest(reqs, 4) != request_digest(reqs[::-1], 4)
    other = _scores()
    other[0].logprobs[1] = -1.2500000000000002  # one bit
    assert result_digest(_scores()) == result_digest(_scores()) != result_digest(other)


def _reply(lane: int, digest: str, scores: list[SequenceScores], *, publish: bool) -> LaneReply:
    return LaneReply(0, lane, digest, result_digest(scores), len(scores), 3, scores if publish else None)


def test_only_the_leader_publishes_and_every_lane_must_agree() -> None:
    digest, scores = "d" * 64, _scores()
    leader, lane = _reply(0, digest, scores, publish=True), _reply(1, digest, scores, publish=False)
    assert check_lanes(0, digest, 2, [leader, lane]) is scores
    other = _scores()
    other[1].logprobs[0] = -2.5
    cases = [
        ([_reply(0, digest, scores, publish=False), lane], "its leader (lane 0) published no scores"),
        ([leader, _reply(1, "e" * 64, scores, publish=False)], "lane 1: scored requests with digest eeeeeeeeeeee"),
        ([leader, _reply(1, digest, scores, publish=True)], "lane 1: only the leader publishes scores"),
        ([leader, _reply(1, digest, other, publish=False)], "lane 1: its result (2 sequences"),
    ]
    for replies, needle in cases:
        with pytest.raises(TeacherError, match=re.escape(needle)):
            check_lanes(0, digest, 2, replies)
    with pytest.raises(TeacherError, match="published 2 scores for 3 requests"):
        check_lanes(0, digest, 3, [leader, lane])


def test_a_teacher_lane_has_no_weight_edge() -> None:
    from posttrain.rollout.replica import Replica
    from posttrain.teacher.pool import TeacherLane

    assert hasattr(Replica, "load_weights")  # what a rollout replica has and a teacher lane must not
    assert not [m for m in dir(TeacherLane) if "weight" in m or m.startswith("receive")]
