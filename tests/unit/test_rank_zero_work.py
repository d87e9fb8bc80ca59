"""``distributed/rank_zero.py``: rank 0's long work (an upload drained at the end of a run, a download
before a resume) while the other ranks wait, on two real gloo processes whose collectives time out
after 1 s. Waiting inside a collective, as uploads did before, times out; ``on_rank_zero`` does not,
hands every rank rank 0's result, and reports rank 0's failure on the other ranks by name."""

from __future__ import annotations

import time
from typing import Any

import torch.multiprocessing as mp
from gloo_ranks import free_port

TIMEOUT_S = 1.0
WORK_S = 2.0  # longer than the process group's timeout


def _slow(value: str) -> str:
    time.sleep(WORK_S)
    return value


def _fails() -> None:
    raise OSError("the archive is unreachable")


def _rank(rank: int, port: int, queue: Any) -> None:
    from posttrain.distributed.process_group import init_process_group
    from posttrain.distributed.rank_zero import on_rank_zero
    from posttrain.distributed.world import broadcast_object

    init_process_group(
        timeout_s=TIMEOUT_S, backend="gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    out: dict[str, Any] = {}
    start = time.monotonic()
    out["result"] = on_rank_zero(lambda: _slow("from rank 0"), what="the test's slow work")
    out["waited_s"] = time.monotonic() - start
    try:
        on_rank_zero(_fails, what="the test's download")
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    # the old way, last (a timed-out group is not used again): rank 0 works, then a broadcast
    try:
        if rank == 0:
            _slow("late")
        broadcast_object("late" if rank == 0 else None)
        out["plain"] = "ok"
    except Exception as exc:
        out["plain"] = type(exc).__name__
    queue.put((rank, out))


def test_the_other_ranks_wait_for_rank_zero_past_the_collective_timeout() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, queue)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    zero, one = results[0], results[1]
    assert zero["result"] == one["result"] == "from rank 0"
    assert one["waited_s"] >= WORK_S > TIMEOUT_S  # rank 1 waited out rank 0's work, past the timeout
    assert zero["error"] == "OSError: the archive is unreachable"  # rank 0 re-raises its own error
    assert one["error"] == "TrainingError: rank 0 failed the test's download: OSError: the archive is unreachable"
    assert one["plain"] != "ok"  # waiting inside a collective instead: rank 1 timed out
