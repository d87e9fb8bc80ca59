"""Fixtures shared by the integration test files: the Ray tests' one reference run, and the cleanup
of the shared-memory segments a TP-2 vLLM CPU engine leaves behind.

``test_ray_backend.py`` (colocated, broadcast weight sync), ``test_nixl_ray.py`` (NIXL weight sync)
and ``test_data_pool_ray.py`` (the data pool) each compare runs against the same disaggregated
object-store run; it starts once per pytest process instead of once per file (a Ray driver run is
30-60 s on 2 cores).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ray_runs import REFERENCE, REFERENCE_PLACEMENT, RayRun, run_driver, run_frames


@pytest.fixture(scope="session")
def ray_reference(
    tiny_model_dir: str, subprocess_run_overrides: Callable[..., list[str]], tmp_path_factory: pytest.TempPathFactory
) -> RayRun:
    """GRPO under Ray, disaggregated: 2 policy-rank actors and 1 transformers replica, weights
    through the object store, score centering on, 3 steps (``ray_runs.REFERENCE``)."""
    pytest.importorskip("ray")
    root = tmp_path_factory.mktemp("ray_reference")
    res = run_driver(subprocess_run_overrides(tiny_model_dir, root, "reference", *REFERENCE, *REFERENCE_PLACEMENT))
    assert res.returncode == 0, res.stderr[-3000:]
    frames = run_frames(root, "reference")
    assert [f["step"] for f in frames] == [1, 2, 3]
    assert all(f["train/grad_norm"] > 0 and f["optim/step"] == f["step"] for f in frames)
    return RayRun(frames, res.stderr)


# vLLM's CPU build names a TP group's shared-memory segments after the engine's init method, which is
# ``env://`` for every external_launcher engine, and leaves them behind (a killed engine, a finished
# one): the next TP-2 CPU engine on this host would fail with errno 17 (EEXIST). GPUs (NCCL) are not
# affected. Used by tests/integration/test_rollout_tp_vllm.py and test_teacher_pool_vllm.py.
STALE_SHM = [Path(f"/dev/shm/-tp:0-[0-1]-cpushm_{rank}") for rank in (0, 1)]


@pytest.fixture
def no_stale_shm() -> Iterator[None]:
    for path in STALE_SHM:
        path.unlink(missing_ok=True)
    yield
    for path in STALE_SHM:
        path.unlink(missing_ok=True)
