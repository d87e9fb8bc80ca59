"""Two-rank gloo runs for the unit tests: a free local port, and a script run as ranks 0 and 1 in
processes of their own (torchrun's environment variables, one thread each), each rank's output
checked. One definition, so the tests that shard across two CPU processes launch them alike."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_on_two_ranks(script: Path, *args: str, timeout_s: float) -> list[str]:
    """Run ``script`` with ``args`` as ranks 0 and 1 of a gloo world; assert each exits 0 having printed
    ``OK``, and return their outputs. A rank still running after ``timeout_s`` is killed and the test fails
    with ``subprocess.TimeoutExpired``."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env["OMP_NUM_THREADS"] = "1"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [proc.communicate(timeout=timeout_s)[0] for proc in procs]
    finally:  # a rank past its timeout (a hung collective) is not left running after the test
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0 and "OK" in out, out
    return outputs
