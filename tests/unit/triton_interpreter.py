"""Running a module's Triton kernels in Triton's interpreter, for the CPU tests of the kernel modules
(``test_logprob_kernels.py``, ``test_block_kernels.py``): the interpreter must be on before Triton is
first imported, so each check script runs as a process of its own with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_interpreted(script_name: str) -> str:
    """Run ``script_name`` (beside this file) in the interpreter; its stdout, after asserting it exited 0.
    Skips where Triton is not installed (``scripts/test.sh`` installs vLLM's CPU build, which brings it)."""
    pytest.importorskip("triton", reason="Triton comes with vLLM's CPU build, which scripts/test.sh installs")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(__file__).with_name(script_name)
    proc = subprocess.run(
        [sys.executable, str(script)], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout
