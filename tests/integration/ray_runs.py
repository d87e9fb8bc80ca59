"""Helpers for the Ray-backend tests: one GRPO driver in a subprocess of its own (it starts and
stops its own local Ray cluster) and the metrics frames of a finished run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from rank_runs import E2E_DIR

RUN_TIMEOUT_S = 240


def run_driver(
    args: list[str],
    env_extra: dict[str, str] | None = None,
    timeout_s: float = RUN_TIMEOUT_S,
    module: str = "posttrain.entrypoints.grpo",
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE -- ARGS`` (the GRPO entry point unless told) with the e2e fixtures
    importable, one OpenMP thread, Ray's auth off and no inherited WORLD_SIZE."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(E2E_DIR), os.environ.get("PYTHONPATH", "")) if p),
        "OMP_NUM_THREADS": "1",
        "RAY_AUTH_MODE": "disabled",
        **(env_extra or {}),
    }
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", module, "--", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )


def run_frames(root: Path, job: str, group: str = "grpo") -> list[dict[str, float]]:
    """The metrics.jsonl frames of the one run of ``job`` (of ``job.group`` ``group``) under output root ``root``."""
    (run_dir,) = (root / "posttrain" / group / job).iterdir()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# The shared reference run of the Ray tests (``conftest.ray_reference``): 2 policy ranks, 3 steps,
# score centering on (so the sampler's top-k head travels with each completion, and the data pool
# carries it too); these overrides and ``REFERENCE_PLACEMENT`` make it a disaggregated run with the
# weights through the object store. Runs that must train exactly like it add their own placement
# and transport to ``REFERENCE`` instead.
REFERENCE = [
    "grid.backend=ray",
    "grid.shapes.policy=[1,2]",
    "grid.collective_timeout_s=60",
    "rl.score_centering.enabled=true",
    "rl.score_centering.top_k=4",
    "rollout.max_tokens=8",
    "rl.max_steps=3",
]
DISAGGREGATED_PLACEMENT = "grid.gpu_placement=disaggregated"
REFERENCE_PLACEMENT = [DISAGGREGATED_PLACEMENT, "rl.weight_sync_transport=object_store"]


class RayRun(NamedTuple):
    """A finished driver run: its metrics frames and its stderr."""

    frames: list[dict[str, float]]
    stderr: str
