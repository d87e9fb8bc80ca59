"""A policy rank's proxy to the teacher pool (``teacher/pool.py``; OPD under ``grid.backend=ray``).

``TeacherProxy`` is the ``Teacher`` protocol over Ray calls, with one difference: its ``score`` is
a collective of the policy ranks. Per attempt, rank 0 gathers every rank's requests
(``distributed/hub.py``), splits the step's whole batch into contiguous shards over the live
replicas, sends each shard to every lane of its replica, checks each replica's replies
(``check_lanes``: the same request digest on every lane, the leader's scores, the other lanes'
equal status) and answers each rank with its own scores, or every rank with the same error. So an
attempt succeeds or fails for all ranks at once (all-or-nothing over the whole batch), and the
bounded retries of ``teacher/scoring.py`` stay in step on every rank.

A replica whose lane dies (``RayActorError``) or does not answer within ``grid.collective_timeout_s``
fails that attempt and is left out of the next ones (its actors are killed at once: the other ranks
of its engine would wait in a collective for the dead one), so a retry runs on the survivors; so is
a tensor-parallel replica one of whose lanes raised or disagreed (its ranks are out of step), while
a lone lane that raised stays in. With no replica left an attempt fails at once, and after
``rl.teacher.max_score_attempts`` the run stops with the named error. Nothing of a failed attempt
reaches the trainer.
"""

from __future__ import annotations

import time
from typing import Any

from posttrain.config.opd import OPDConfig
from posttrain.distributed.hub import gather_to_zero, scatter_from_zero
from posttrain.metrics.sinks import MetricsLogger
from posttrain.rollout.state import RESUME_HINT
from posttrain.teacher.base import ScoreRequest, SequenceScores, TeacherError
from posttrain.teacher.pool import check_lanes, lane_name, request_digest


def shard_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, stop)`` ranges covering ``count`` items, the first
    ``count mod parts`` one longer (every replica gets work while there is any)."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for p in range(parts):
        stop = start + base + (1 if p < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class TeacherProxy:
    """The teacher pool as a ``Teacher``; ``score`` is a collective of every policy rank."""

    collective = True
    """``teacher/scoring.py`` asks every rank to agree on each attempt's outcome."""

    def __init__(
        self,
        lanes: list[list[Any]],
        tokenizer: Any,
        *,
        vocab_size: int,
        max_model_len: int | None,
        timeout_s: float,
        log: MetricsLogger | None = None,
    ) -> None:
        self.lanes = lanes
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.timeout_s = timeout_s
        self.log = log
        self.dead: set[int] = set()
        self.batches = 0

    def score(self, requests: list[ScoreRequest] | None, top_k: int) -> list[SequenceScores]:
        """This rank's scores of one whole-batch attempt. ``None``: this rank could not build its
        requests (the attempt then fails everywhere, without calling the pool)."""
        parts = gather_to_zero(requests)
        answers = self._answers(parts, top_k) if parts is not None else None
        mine = scatter_from_zero(answers)
        if isinstance(mine, str):
            raise TeacherError(mine)
        scores: list[SequenceScores] = mine
        return scores

    def _answers(self, parts: list[list[ScoreRequest] | None], top_k: int) -> list[Any]:
        """Rank 0: per rank its scores, or the same error message for every rank."""
        failed = [r for r, p in enumerate(parts) if p is None]
        if failed:
            return [f"policy rank(s) {failed} could not build their teacher requests"] * len(parts)
        flat = [req for p in parts for req in (p or [])]
        try:
            scores = self._score_all(flat, top_k, ranks=len(parts))
        except TeacherError as err:
            return [str(err)] * len(parts)
        answers, start = [], 0
        for p in parts:
            answers.append(scores[start : start + len(p or [])])
            start += len(p or [])
        return answers

    def _score_all(self, flat: list[ScoreRequest], top_k: int, *, ranks: int) -> list[SequenceScores]:
        """The whole batch over the live replicas, every shard in flight at once."""
        live = [r for r in range(len(self.lanes)) if r not in self.dead]
        if not live:
            raise TeacherError(f"every teacher replica ({len(self.lanes)}) died; the run stops. {RESUME_HINT}")
        if not flat:
            return []
        sent = []
        for replica, (start, stop) in zip(live, shard_bounds(len(flat), len(live)), strict=True):
            if start == stop:
                continue  # fewer requests than replicas: this one has nothing to score
            shard = flat[start:stop]
            digest = request_digest(shard, top_k)
            sent.append(
                (replica, digest, len(shard), [lane.score.remote(digest, shard, top_k) for lane in self.lanes[replica]])
            )
        self._note_batch(len(flat), ranks, len(live))
        replies, errors = self._collect(sent)
        out: list[SequenceScores] = []
        for replica, digest, expected, refs in sent:
            if replica in errors:
                continue
            try:
                out.extend(check_lanes(replica, digest, expected, [replies[ref] for ref in refs]))
            except TeacherError as err:
                errors[replica] = str(err)
                if len(refs) > 1:  # the ranks of one engine disagree: out of step for good
                    errors[replica] += "; " + self._drop(replica, "is out of step")
        if errors:
            raise TeacherError("; ".join(errors[r] for r in sorted(errors)))
        return out

    def _collect(self, sent: list[tuple[int, str, int, list[Any]]]) -> tuple[dict[Any, Any], dict[int, str]]:
        """Every lane's reply, as they come, within ``timeout_s``: ``(reply per ref, error per replica)``.

        A lane that died or stays silent takes its replica out (``_drop``: its other lanes may be
        waiting in the engine's collectives for it, so they are killed too, at once rather than at the
        timeout). A lane that raised fails the attempt; in a TP group (several lanes) it also drops
        the replica, whose other ranks are now out of step; a lone lane stays usable."""
        import ray

        owner = {ref: (replica, len(refs)) for replica, _, _, refs in sent for ref in refs}
        replies: dict[Any, Any] = {}
        errors: dict[int, str] = {}
        pending = list(owner)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:  # the deadline passed: every replica still owing a reply is out
                for replica in sorted({owner[ref][0] for ref in pending} - set(errors)):
                    errors[replica] = self._drop(replica, f"did not answer within {self.timeout_s:.0f}s")
                break
            ref = ready[0]
            replica, lanes = owner[ref]
            if replica in errors:
                continue  # already failed (its killed lanes answer with errors)
            try:
                replies[ref] = ray.get(ref)
            except ray.exceptions.RayActorError:
                errors[replica] = self._drop(replica, "died during scoring")
            except ray.exceptions.RayTaskError as err:
                cause = getattr(err, "cause", None) or err
                what = f"failed: {type(cause).__name__}: {cause}"
                errors[replica] = self._drop(replica, what) if lanes > 1 else f"teacher replica {replica} {what}"
        return replies, errors

    def _drop(self, replica: int, what: str) -> str:
        """Leave ``replica`` out of later attempts (its lanes killed: nothing of it stays in flight)."""
        import ray

        self.dead.add(replica)
        for lane in self.lanes[replica]:
            ray.kill(lane)
        left = len(self.lanes) - len(self.dead)
        message = f"teacher replica {replica} {what}; {left} of {len(self.lanes)} replica(s) left"
        if self.log is not None:
            self.log.info(f"warning: {message}")
        return message

    def _note_batch(self, requests: int, ranks: int, replicas: int) -> None:
        """Say once how a step's batch is formed (the first batch, and after a replica was lost)."""
        self.batches += 1
        if self.log is not None and (self.batches == 1 or self.dead):
            self.log.info(
                f"teacher batch {self.batches}: {requests} requests from {ranks} policy rank(s) in one batch, "
                f"split over {replicas} replica(s) of {len(self.lanes[0])} rank(s)"
            )

    def close(self) -> None:
        """Nothing here: the driver owns the pool's lifetime (``launch/ray_backend.py``)."""


def teacher_proxy(cfg: OPDConfig, log: MetricsLogger) -> TeacherProxy:
    """This policy rank's proxy to the teacher pool the driver started (its lanes found by name)."""
    import ray

    from posttrain.models.loading import load_tokenizer, resolve_model_path
    from posttrain.rollout.remote import NAMESPACE
    from posttrain.teacher.factory import TEACHER_KEY

    t = cfg.rl.teacher
    if t.name_or_path is None:  # refused by the preflight; narrows the type
        raise TeacherError("rl.teacher.name_or_path is required")
    lanes = [
        [ray.get_actor(lane_name(r, ln), namespace=NAMESPACE) for ln in range(t.tensor_parallel_size)]
        for r in range(t.replicas)
    ]
    tokenizer = load_tokenizer(resolve_model_path(t.name_or_path, t.revision, key=TEACHER_KEY))
    vocab_size: Any = ray.get(lanes[0][0].vocab_size.remote(), timeout=cfg.grid.collective_timeout_s)
    log.info(
        f"teacher {t.name_or_path} ({t.backend}, {t.input_mode}/{t.signal_mode}): a pool of {t.replicas} "
        f"replica(s) x {t.tensor_parallel_size} rank(s) of its own"
    )
    return TeacherProxy(
        lanes,
        tokenizer,
        vocab_size=int(vocab_size),
        max_model_len=t.max_model_len,
        timeout_s=cfg.grid.collective_timeout_s,
        log=log,
    )
