"""Joining and leaving the policy ranks' process group (torchrun's, or one that Ray's actors form).

Every policy rank runs the same loop on its own data cell.

Under ``torchrun --nproc-per-node N`` (``grid.backend=local``, ``grid.shapes.policy=[1,N]``) each
process is one policy rank and one data cell. The loop is the single-process loop with four
differences, all decided in this package (``world``, ``cells``, ``fsdp``):

* the process group is joined from torchrun's environment before anything else
  (``join_policy_world``; gloo on CPU, NCCL on CUDA, ``grid.collective_timeout_s`` on every collective);
* every rank draws the SAME prompts (one data source per rank, same seed, so the cursors never
  differ) and samples and scores only its cell's whole groups;
* the rollout engine of each rank holds its own unsharded copy of the policy, refreshed from the
  FSDP2 shards after every optimizer step (``full_state_dict``, a collective);
* only rank 0 writes the run directory, the console and the metrics; the metrics of a step are
  merged across ranks first (``merge_rank_metrics``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from typing import Any

from posttrain.config.schema import RunConfig

# A collective that has not finished after this long raises instead of hanging the run (a crashed
# or desynchronised peer). Generous: the first all-gather of a large model includes its warm-up.
DEFAULT_TIMEOUT_S = 600.0


def init_process_group(
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> None:
    """Join the default process group: NCCL on CUDA, gloo on the CPU, with a timeout on every collective.

    Without ``init_method`` / ``rank`` / ``world_size`` it reads torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). On CUDA each process uses the GPU ``LOCAL_RANK``
    of those it sees (``cuda:0`` when it sees one: ``pin_torchrun_gpu`` and Ray's actors do that).
    A second call is a no-op.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank is not None and world_size is not None:
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(backend, **kwargs)


def env_world_size(environ: Mapping[str, str] | None = None) -> int:
    """``WORLD_SIZE`` as torchrun (or a Ray policy actor) set it (in ``environ``, by default this
    process's environment); 1 when unset."""
    return int((os.environ if environ is None else environ).get("WORLD_SIZE", "1") or 1)


def pin_torchrun_gpu(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Under torchrun, let each rank see only its own GPU (``LOCAL_RANK``-th of the visible ones), as
    ``cuda:0``; returns what ``CUDA_VISIBLE_DEVICES`` became, or None when nothing changed.

    Why: vLLM's in-process engine always builds on ``cuda:0`` of its process (and makes that the
    current device), so with every GPU visible each rank's colocated engine would land on GPU 0 and
    move the rank's current device there. Must run before CUDA starts in this process (the
    entrypoint calls it before the loop is imported). Outside torchrun (no ``TORCHELASTIC_RUN_ID``),
    in one process, when the rank already sees a single device, or when ``CUDA_VISIBLE_DEVICES`` is
    set but empty (no GPUs: every rank runs on the CPU), nothing changes."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env or env_world_size(env) <= 1:
        return None
    local = int(env.get("LOCAL_RANK", "0") or 0)
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(visible) == 1 or ("CUDA_VISIBLE_DEVICES" in env and not visible):
        return None  # one device per rank already, or GPUs hidden on purpose (set but empty)
    if not visible:
        choice = str(local)
    elif local < len(visible):
        choice = visible[local].strip()
    else:
        return None  # fewer visible devices than local ranks: leave torch's own error to speak
    env["CUDA_VISIBLE_DEVICES"] = choice
    return choice


def join_policy_world(cfg: RunConfig) -> int:
    """Join the process group when launched with ``WORLD_SIZE > 1``; returns the world size.

    A no-op in a single process (no group is created, so every single-process code path is the
    one it always was).
    """
    world = env_world_size()
    if world > 1:
        from posttrain.distributed.world import RankFilter

        init_process_group(timeout_s=cfg.grid.collective_timeout_s)
        import logging

        for handler in logging.getLogger().handlers:
            handler.addFilter(RankFilter())
    return world


def leave_policy_world(*, finished: bool = False) -> None:
    """Leave the process group (end of a multi-rank run); nothing to do in one process.

    After a run that ``finished`` every rank first meets the others: a rank that tore its group down
    while a peer was still in the last collective would abort that peer (gloo ends it with
    "terminate called without an active exception"). After a failure there is no meeting: the
    failed peer would never arrive."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def exit_rank_process(status: int) -> int:
    """End a rank of a multi-rank launch with ``status`` right away, once its output is flushed;
    in a single process, return ``status`` for the caller to exit with.

    Why not a normal interpreter exit: torch's gloo worker threads may still be releasing the last
    finished collective (and the tensors it held) while Python finalizes, because FSDP2's DTensors
    keep the process group alive past ``destroy_process_group``. A thread that needs the GIL
    during finalization is ended by Python, and the C++ runtime aborts the whole process
    ("terminate called without an active exception", status -6) after a run that succeeded. The
    run has closed its engines, sinks and checkpoints by now, so there is nothing left to finalize."""
    try:
        if env_world_size() <= 1:
            return status
    except ValueError:  # a WORLD_SIZE that is not a number: preflight has said so; no ranks to end
        return status
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def rank_tag(environ: Mapping[str, str] | None = None) -> str:
    """`` (rank r/w)`` in a process of a multi-rank launch (torchrun's environment), else empty: an
    error line printed by every rank says which one it came from. Reads only the environment (no
    process group may exist yet when the error comes)."""
    env = os.environ if environ is None else environ
    world = env.get("WORLD_SIZE", "1")
    return f" (rank {env.get('RANK', '?')}/{world})" if world not in ("", "1") else ""
