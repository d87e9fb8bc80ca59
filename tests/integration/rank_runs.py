"""One launcher for the tests that run a posttrain entry point on two gloo ranks under torchrun, in a
subprocess of its own (the real multi-rank path on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

E2E_DIR = Path(__file__).parent.parent / "fixtures" / "e2e"


def run_two_ranks(
    module: str, args: list[str], *, timeout_s: float, extra_path: str = ""
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node 2 -m MODULE ARGS``, bounded by
    ``timeout_s``, with the e2e fixtures (and ``extra_path``) importable, one OpenMP thread a rank (two
    ranks share this machine's cores) and no inherited ``WORLD_SIZE``."""
    path = (str(E2E_DIR), extra_path, os.environ.get("PYTHONPATH", ""))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [*launch, "-m", module, *args], capture_output=True, text=True, timeout=timeout_s, env=env, check=False
    )
