"""The two-rank torchrun launcher the integration tests share (``rank_runs.run_two_ranks``): a run past its
timeout fails at the timeout and leaves no rank running."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from rank_runs import run_two_ranks

HUNG_RANK = """
import os
import time
from pathlib import Path

Path(os.environ["PIDS_DIR"], os.environ["RANK"]).write_text(str(os.getpid()))
time.sleep(300)  # a rank stuck in a collective, as far as the launcher can tell
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")  # a zombie (exited, not yet reaped) counts as stopped
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_a_run_past_its_timeout_stops_torchrun_and_both_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hung_rank.py").write_text(HUNG_RANK)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    monkeypatch.setenv("PIDS_DIR", str(pids_dir))
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_two_ranks("hung_rank", [], timeout_s=25, extra_path=str(tmp_path))
    assert time.monotonic() - started < 85  # at the timeout, plus torchrun stopping its ranks
    pids = [int(p.read_text()) for p in sorted(pids_dir.iterdir())]
    assert len(pids) == 2, "both ranks started within the timeout"
    # torchrun runs each rank in a session of its own: killing torchrun alone (subprocess.run's timeout)
    # left both sleeping
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)
