"""Fixtures shared by the integration test files: the Ray tests' one reference run.

``test_ray_backend.py`` (colocated, broadcast weight sync), ``test_nixl_ray.py`` (NIXL weight sync)
and ``test_data_pool_ray.py`` (the data pool) each compare runs against the same disaggregated
object-store run; it starts once per pytest process instead of once per file (a Ray driver run is
30-60 s on 2 cores).
"""

from __future__ import annotations

from collections.abc import Callable

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
