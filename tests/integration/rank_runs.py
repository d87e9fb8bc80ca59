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
    ranks share this machine's cores) and no inherited ``WORLD_SIZE``. Past the timeout torchrun and both
    ranks are stopped and ``subprocess.TimeoutExpired`` fails the test: a rank hung in a collective does not
    go on taking a core from the tests after it."""
    path = (str(E2E_DIR), extra_path, os.environ.get("PYTHONPATH", ""))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command = [*launch, "-m", module, *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own, so killing torchrun alone would orphan them;
        # SIGTERM makes it stop its ranks (SIGTERM, then SIGKILL after its grace period) before it exits.
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()  # not communicate(): a rank torchrun left behind would hold the pipes open
            proc.wait()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)
