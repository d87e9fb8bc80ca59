"""The OPD teacher as a Ray actor group on a local Ray cluster (CPU): the pool itself, and a real OPD
run whose teacher replicas die one after the other.

What runs here, exactly: transformers teachers (``rl.teacher.backend=hf``) on CPU. The TP group of
``test_a_replica_of_two_lanes...`` is two whole TP-1 transformers scorers standing in for the two
ranks (built through ``TeacherPool.start`` directly: the preflight refuses an ``hf`` teacher wider
than 1), which starts in seconds. What is tested is the orchestration around a TP group: both lanes
receive the same ordered requests and check their digest, both score, only the leader returns
tensors, the other lane status, and a lane that dies mid-batch fails the batch. The real TP-2 vLLM
engine over two lanes (vLLM's CPU build, ``external_launcher``) is ``test_teacher_pool_vllm.py``
(``-m vllm``: its engines take a minute to start).

The first test starts Ray in this process (``-m ray`` tests run in a pytest process of their own);
the second runs the real entry point in a driver subprocess that starts and stops its own cluster.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ray_runs import run_driver, run_frames

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

OPD_CLASS = "posttrain.config.opd:OPDConfig"


@pytest.fixture
def local_ray() -> Iterator[None]:
    from posttrain.rollout.remote import NAMESPACE
    from posttrain.teacher.pool import EXIT_ENV

    # lane 1 of replica 0 exits on its 4th score call (the test's 4th batch)
    env = {"OMP_NUM_THREADS": "1", EXIT_ENV: "0:1:4"}
    ray.init(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        yield
    finally:
        ray.shutdown()


def _requests(tokenizer: object) -> list:
    from posttrain.teacher.base import ScoreRequest

    texts = ["What is 2 + 3? It is 5.", "Count: one two three four", "The sky is blue because"]
    out = []
    for n, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        out.append(ScoreRequest(list(ids), 2 + n))
    return out


def test_a_replica_of_two_lanes_scores_once_publishes_from_its_leader_and_fails_whole(
    local_ray: None, tiny_model_dir: str
) -> None:
    from posttrain.config.loading import build_config
    from posttrain.config.opd import OPDConfig
    from posttrain.models.loading import load_tokenizer
    from posttrain.teacher.base import TeacherError
    from posttrain.teacher.factory import build_scorer
    from posttrain.teacher.pool import TeacherPool, check_lanes, request_digest
    from posttrain.teacher.remote import TeacherProxy

    cfg = build_config(
        None, [f"model.name_or_path={tiny_model_dir}", f"rl.teacher.name_or_path={tiny_model_dir}"], OPDConfig
    )
    pool = TeacherPool()
    try:
        pool.start(cfg.model_dump(mode="json"), OPD_CLASS, 1, 2, gpus=False, timeout_s=120)
        tokenizer = load_tokenizer(tiny_model_dir)
        proxy = TeacherProxy(pool.lanes, tokenizer, vocab_size=49152, max_model_len=None, timeout_s=120)
        reqs = _requests(tokenizer)
        # 1st call: the pool's scores are the in-process teacher's
        got = proxy.score(reqs, 4)
        want = build_scorer(cfg).score(reqs, 4)
        assert [len(s.logprobs) for s in got] == [len(r.token_ids) - r.score_from for r in reqs]
        for g, w in zip(got, want, strict=True):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
            assert g.topk_ids == w.topk_ids
            assert g.topk_logprobs is not None and w.topk_logprobs is not None
            assert [v for row in g.topk_logprobs for v in row] == pytest.approx(
                [v for row in w.topk_logprobs for v in row], abs=1e-5
            )
        # 2nd call, lane by lane: the leader returns the scores, lane 1 its status only, both agree
        digest = request_digest(reqs, 4)
        replies = ray.get([lane.score.remote(digest, reqs, 4) for lane in pool.lanes[0]], timeout=120)
        assert replies[0].scores is not None and replies[1].scores is None
        assert replies[1].request_digest == digest and replies[1].result_digest == replies[0].result_digest
        assert replies[1].tokens == sum(len(s.logprobs) for s in got)
        assert [s.logprobs for s in check_lanes(0, digest, 3, replies)] == [s.logprobs for s in replies[0].scores]
        # 3rd call: a batch that is not the one digested is refused by the lane itself
        with pytest.raises(ray.exceptions.RayTaskError, match="received requests with digest"):
            ray.get(pool.lanes[0][1].score.remote(digest, reqs[:2], 4), timeout=120)
        # 4th call: lane 1 dies mid-batch; the whole batch fails and the replica is out
        with pytest.raises(TeacherError, match=r"teacher replica 0 died during scoring; 0 of 1 replica\(s\) left"):
            proxy.score(reqs, 4)
        with pytest.raises(TeacherError, match=r"every teacher replica \(1\) died; the run stops"):
            proxy.score(reqs, 4)
    finally:
        pool.kill()


@pytest.mark.slow
def test_an_opd_run_retries_on_a_surviving_replica_then_stops_with_none_left(
    tiny_model_dir: str, smollm2_tokenizer_dir: str, run_overrides: Callable[..., list[str]], tmp_path: Path
) -> None:
    """2 policy ranks (colocated engines), a teacher pool of 2 replicas x 1 rank, 3 steps.
    Replica 1 dies on its 2nd batch (step 2: the retry runs on replica 0 alone), replica 0 on its 4th
    (step 3's first attempt; the second finds no replica): the run stops at step 3 with the named
    error and trains nothing of it. The call counts only work out if each attempt is one batch of
    both ranks' requests (a call per rank would kill replica 1 in step 1)."""
    from posttrain.models.tiny import make_tiny_model

    teacher = make_tiny_model(str(tmp_path / "teacher"), smollm2_tokenizer_dir, seed=1)
    overrides = run_overrides(
        tiny_model_dir,
        tmp_path,
        "pool",
        f"rl.teacher.name_or_path={teacher}",
        "rl.max_steps=3",
        "rollout.max_tokens=8",
        "grid.backend=ray",
        "grid.shapes.policy=[1,2]",
        "grid.collective_timeout_s=60",
        "rl.teacher.replicas=2",
        "rl.teacher.max_score_attempts=2",
    )
    env = {"POSTTRAIN_TEST_TEACHER_EXIT": "1:0:2,0:0:4"}
    res = run_driver(overrides, env, module="posttrain.entrypoints.opd")
    assert res.returncode == 1, res.stderr[-4000:]
    assert "started a local Ray cluster" in res.stderr and "K + T" in res.stderr
    assert "teacher scoring failed 2 time(s) in a row (rl.teacher.max_score_attempts=2)" in res.stderr
    assert "nothing of this batch was trained on" in res.stderr
    assert "every teacher replica (2) died" in res.stderr
    frames = run_frames(tmp_path, "pool", group="opd")
    assert [f["step"] for f in frames] == [1, 2]  # step 3 trained nothing
    first, second = frames
    # counts are summed over the 2 ranks: one attempt each at step 1, two (one failed) at step 2
    assert (first["train/opd_teacher_score_request_count"], first["train/opd_teacher_score_failure_count"]) == (2, 0)
    assert second["train/opd_teacher_score_request_count"] == 4
    assert (second["train/opd_teacher_score_success_count"], second["train/opd_teacher_score_failure_count"]) == (2, 2)
    for frame in frames:
        assert frame["train/opd_teacher_scored_sequences"] == 8  # the whole batch, both ranks' cells
        assert frame["optim/step"] == frame["step"] and frame["train/opd_divergence"] > 0
    (run_dir,) = (tmp_path / "posttrain" / "opd" / "pool").iterdir()
    log = (run_dir / "train.log").read_text()
    assert "teacher batch 1: 8 requests from 2 policy rank(s) in one batch, split over 2 replica(s) of 1 rank(s)" in log
    assert "teacher replica 1 died during scoring; 1 of 2 replica(s) left" in log
    assert "teacher batch 3: 8 requests from 2 policy rank(s) in one batch, split over 1 replica(s)" in log
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2
