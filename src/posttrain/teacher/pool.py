"""The OPD teacher as a role of its own under ``grid.backend=ray``: ``rl.teacher.replicas`` replicas,
each an actor group of ``rl.teacher.tensor_parallel_size`` lanes (one GPU each, in a placement
group of its own packed on one node).

A replica scores one shard of a step's requests. Every lane of it receives the same ordered
requests with their digest, checks that digest itself, enters the same scoring call and digests its
result; only the leader (lane 0) sends the scores back, the other lanes send status only (their
digests and counts), so the caller can prove that every lane scored the same batch and got the
same answer before a single score is used (``check_lanes``). The teacher is frozen: no lane ever
receives weights.

Engines: with ``rl.teacher.backend=vllm`` and TP > 1 the lanes form one vLLM engine
(``distributed_executor_backend="external_launcher"``: each lane is one rank of the engine's
torch.distributed group, rendezvous at lane 0). With TP 1 a lane is a whole engine of either
backend. A transformers lane has no tensor parallelism: the preflight refuses an ``hf`` teacher
wider than 1, and only tests build such a replica, where each lane is a whole TP-1 scorer standing
in for a rank (what the orchestration around a TP group does is the same).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.distributed.lane_groups import LaneGroups
from posttrain.teacher.base import ScoreRequest, SequenceScores, TeacherError

# Fault injection for tests: "replica:lane:call[,...]": that lane's process exits (as if killed) on
# its call-th score call, while the rest of the step's batch is in flight.
EXIT_ENV = "POSTTRAIN_TEST_TEACHER_EXIT"


def lane_name(replica: int, lane: int) -> str:
    """The Ray actor name of one lane (found by name from the policy ranks)."""
    return f"teacher-{replica}-{lane}"


def request_digest(requests: Sequence[ScoreRequest], top_k: int) -> str:
    """sha256 of the ordered requests and the top-k asked for: what every lane must agree on."""
    h = hashlib.sha256(f"top_k={top_k};n={len(requests)}".encode())
    for r in requests:
        h.update(struct.pack(f"<qq{len(r.token_ids)}q", r.score_from, len(r.token_ids), *r.token_ids))
    return h.hexdigest()


def result_digest(scores: Sequence[SequenceScores]) -> str:
    """sha256 of the scores, logprobs by their float64 bits: the lanes of one engine compute the same
    gathered logits, so they agree bit for bit or something desynchronised them."""
    h = hashlib.sha256(f"n={len(scores)}".encode())
    for s in scores:
        h.update(struct.pack(f"<q{len(s.logprobs)}d", len(s.logprobs), *s.logprobs))
        for ids, lps in zip(s.topk_ids or [], s.topk_logprobs or [], strict=True):
            h.update(struct.pack(f"<{len(ids)}q{len(lps)}d", *ids, *lps))
    return h.hexdigest()


@dataclass(frozen=True)
class LaneReply:
    """One lane's answer to one scoring call: status for every lane, the scores from the leader only."""

    replica: int
    lane: int
    request_digest: str
    result_digest: str
    sequences: int
    tokens: int
    scores: list[SequenceScores] | None = None


def check_lanes(replica: int, digest: str, expected: int, replies: Sequence[LaneReply]) -> list[SequenceScores]:
    """The leader's scores once every lane of ``replica`` proved it scored the ``digest`` batch of
    ``expected`` requests and got the leader's result; a ``TeacherError`` naming the lane otherwise."""
    where = f"teacher replica {replica}"
    if not replies or replies[0].lane != 0 or replies[0].scores is None:
        raise TeacherError(f"{where}: its leader (lane 0) published no scores")
    leader = replies[0]
    scores: list[SequenceScores] = replies[0].scores
    if len(scores) != expected or result_digest(scores) != leader.result_digest:
        raise TeacherError(
            f"{where}: the leader published {len(scores)} scores for {expected} requests, or scores other than "
            "the ones it digested"
        )
    for reply in replies:
        if reply.request_digest != digest:
            raise TeacherError(
                f"{where}, lane {reply.lane}: scored requests with digest {reply.request_digest[:12]}, not the "
                f"batch sent ({digest[:12]}); the lanes did not enter the same call"
            )
        if reply.lane and reply.scores is not None:
            raise TeacherError(f"{where}, lane {reply.lane}: only the leader publishes scores; lanes send status")
        if reply.result_digest != leader.result_digest or reply.sequences != leader.sequences:
            raise TeacherError(
                f"{where}, lane {reply.lane}: its result ({reply.sequences} sequences, digest "
                f"{reply.result_digest[:12]}) differs from the leader's ({leader.sequences}, "
                f"{leader.result_digest[:12]}); the batch fails"
            )
    return scores


def _exit_call(replica: int, lane: int) -> int | None:
    """The score call on which this lane exits (``EXIT_ENV``), if any."""
    for item in filter(None, os.environ.get(EXIT_ENV, "").split(",")):
        r, ln, call = (int(x) for x in item.split(":"))
        if (r, ln) == (replica, lane):
            return call
    return None


class TeacherLane:
    """One rank of one teacher replica (a Ray actor): its scorer, its digests, its status."""

    def __init__(self, tree: dict[str, Any], config_class: str, replica: int, lane: int, lanes: int) -> None:
        from posttrain.importing import import_object

        cls = import_object(config_class, what="the Ray job's config class", must_be_callable=True)
        self.cfg = cls.model_validate(tree)
        self.replica, self.lane, self.lanes = replica, lane, lanes
        self.scorer: Any = None
        self.calls = 0
        self.exit_on = _exit_call(replica, lane)

    def address(self) -> tuple[str, int]:
        """This node's address and a free port: lane 0's are the replica's engine rendezvous."""
        import ray

        from posttrain.rollout.remote import free_port

        return ray.util.get_node_ip_address(), free_port()

    def start(self, master: tuple[str, int]) -> int:
        """Build the scorer (a vLLM TP group meets at ``master``); returns its vocabulary size."""
        from posttrain.teacher.factory import build_scorer

        engine_args: dict[str, Any] = {}
        if self.lanes > 1 and self.cfg.rl.teacher.backend == "vllm":
            # one rank of an SPMD vLLM engine: the lanes are its torch.distributed world
            os.environ.update(
                MASTER_ADDR=master[0],
                MASTER_PORT=str(master[1]),
                RANK=str(self.lane),
                WORLD_SIZE=str(self.lanes),
                LOCAL_RANK="0",  # Ray gives each lane its own GPU
            )
            # every rank must run the same schedule: the same seed (for the one discarded token) on all
            engine_args = {
                "distributed_executor_backend": "external_launcher",
                "disable_custom_all_reduce": True,
                "seed": 0,
            }
        self.scorer = build_scorer(self.cfg, **engine_args)
        return self.vocab_size()

    def vocab_size(self) -> int:
        """The scorer's vocabulary (the proxies' ``Teacher.vocab_size``)."""
        return int(self.scorer.vocab_size)

    def score(self, digest: str, requests: list[ScoreRequest], top_k: int) -> LaneReply:
        """Score the batch the caller digested; the leader returns the scores, the others status."""
        self.calls += 1
        if self.exit_on == self.calls:
            os._exit(1)  # the test's stand-in for a killed teacher process, mid-batch
        mine = request_digest(requests, top_k)
        if mine != digest:
            raise TeacherError(
                f"teacher replica {self.replica}, lane {self.lane}: received requests with digest {mine[:12]}, "
                f"the caller sent {digest[:12]}"
            )
        scores = self.scorer.score(requests, top_k)
        return LaneReply(
            replica=self.replica,
            lane=self.lane,
            request_digest=mine,
            result_digest=result_digest(scores),
            sequences=len(scores),
            tokens=sum(len(s.logprobs) for s in scores),
            scores=scores if self.lane == 0 else None,
        )

    def close(self) -> bool:
        """Release the engine (vLLM's engine core) before the driver kills the actor."""
        close = getattr(self.scorer, "close", None)
        if close is not None:
            close()
        return True


class TeacherPool(LaneGroups):
    """The driver's handles on the pool: ``lanes[replica][lane]`` and one placement group per replica
    (``distributed/lane_groups.py``)."""

    def start(
        self, tree: dict[str, Any], config_class: str, replicas: int, ranks: int, *, gpus: bool, timeout_s: float
    ) -> None:
        """Place and start ``replicas`` teacher replicas of ``ranks`` lanes, named ``teacher-R-L`` in the
        run's namespace; returns once every scorer is built (within ``timeout_s`` per stage). What was
        placed before a failure is in ``self`` for ``kill``."""
        from posttrain.rollout.remote import NAMESPACE

        self.place(
            TeacherLane,
            lane_name,
            NAMESPACE,
            tree=tree,
            config_class=config_class,
            replicas=replicas,
            ranks=ranks,
            gpus=gpus,
            timeout_s=timeout_s,
        )
