"""Topology checks of the preflight: role shapes, backend combinations, data parallelism, the
allocation (declared, or torchrun's ``WORLD_SIZE``) and what is not built yet. They read the config
and the environment only; no cluster, no torch."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from posttrain.config.schema import RunConfig
from posttrain.distributed.placement import role_plan
from posttrain.preflight.findings import Findings
from posttrain.preflight.rollout_tp import check_rollout_tp


def _check_shapes(cfg: RunConfig, out: Findings) -> bool:
    """``[REPLICAS, RANKS]`` per role, POLICY_REPLICAS 1, ROLLOUT_RANKS the rollout's TP width.
    False when a shape is malformed (the checks after it read the shapes)."""
    grid, ro = cfg.grid, cfg.rollout
    for role in ("policy", "rollout"):
        shape = getattr(grid.shapes, role)
        if len(shape) != 2 or any(n < 1 for n in shape):
            out.errors.append(f"grid.shapes.{role}={shape} must be [REPLICAS, RANKS]: two integers, both >= 1")
            return False
    policy_replicas, policy_ranks = grid.shapes.policy
    if policy_replicas != 1:
        out.errors.append(
            f"grid.shapes.policy={grid.shapes.policy}: POLICY_REPLICAS must be 1. The policy has no replica axis: "
            "data parallelism is grid.dp_replicate x grid.dp_shard inside POLICY_RANKS. For "
            f"{policy_replicas * policy_ranks} data-parallel policy ranks write "
            f"grid.shapes.policy=[1,{policy_replicas * policy_ranks}] (add grid.dp_replicate={policy_replicas} for "
            "replicated shard groups, HSDP, instead of one FSDP group)"
        )
    if grid.shapes.rollout[1] != ro.tensor_parallel_size:
        out.errors.append(
            f"grid.shapes.rollout={grid.shapes.rollout}: ROLLOUT_RANKS={grid.shapes.rollout[1]} must equal "
            f"rollout.tensor_parallel_size={ro.tensor_parallel_size} (each rollout replica is one engine of that "
            "tensor-parallel width; a mismatch would deadlock the engine's start)"
        )
    return True


def _check_backend(cfg: RunConfig, out: Findings) -> None:
    """``local`` is one torchrun world on one node with TP 1."""
    grid = cfg.grid
    if grid.backend != "local":
        return
    if cfg.rollout.tensor_parallel_size > 1:
        out.errors.append(
            f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} needs grid.backend=ray "
            "(grid.backend=local is one torchrun world with TP 1)"
        )
    if grid.gpu_placement == "disaggregated":
        out.errors.append("grid.gpu_placement=disaggregated needs grid.backend=ray")
    if cfg.rl.data_pool.data_plane == "ray_nixl_pool":
        out.errors.append(
            "rl.data_pool.data_plane=ray_nixl_pool needs grid.backend=ray (the pool lives in Ray's object store); "
            "under grid.backend=local use rl.data_pool.data_plane=inline"
        )
    if grid.num_nodes is not None and grid.num_nodes > 1:
        out.errors.append(f"grid.num_nodes={grid.num_nodes}: several nodes need grid.backend=ray")


def _check_data_parallel(cfg: RunConfig, out: Findings) -> None:
    """``dp_replicate x dp_shard == POLICY_RANKS``, and every optimizer step splits into equal data cells."""
    grid, rl = cfg.grid, cfg.rl
    ranks = grid.policy_ranks
    shard = grid.dp_shard if grid.dp_shard is not None else ranks // grid.dp_replicate
    if ranks % grid.dp_replicate or grid.dp_replicate * shard != ranks:
        split = f"grid.dp_replicate={grid.dp_replicate}"
        split += f" x grid.dp_shard={grid.dp_shard} must equal" if grid.dp_shard is not None else " must divide"
        out.errors.append(
            f"{split} POLICY_RANKS={ranks} (grid.shapes.policy={grid.shapes.policy}): data parallelism is "
            "dp_replicate x dp_shard inside the policy ranks"
        )
    if ranks > 1 and rl.mini_batch % (rl.group_size * ranks):
        out.errors.append(
            f"the mini-batch of {rl.mini_batch} trajectories (rl.mini_batch_per_replica, else rl.batch_per_replica) "
            f"must be a multiple of rl.group_size x POLICY_RANKS = {rl.group_size * ranks}: each optimizer step is "
            f"split into {ranks} equal data cells of whole groups, one per policy rank (uneven cells would give the "
            "ranks different numbers of collectives)"
        )


def _allocation(cfg: RunConfig, env: Mapping[str, str], out: Findings) -> tuple[int, str] | None:
    """GPUs available and where that number comes from; None when nothing was declared."""
    grid = cfg.grid
    if (grid.num_nodes is None) != (grid.gpus_per_node is None):
        out.errors.append(
            f"grid.num_nodes={grid.num_nodes} and grid.gpus_per_node={grid.gpus_per_node}: declare both or neither"
        )
        return None
    if grid.num_nodes is not None and grid.gpus_per_node is not None:
        return (
            grid.num_nodes * grid.gpus_per_node,
            f"grid.num_nodes={grid.num_nodes} x grid.gpus_per_node={grid.gpus_per_node}",
        )
    world = env.get("WORLD_SIZE")
    if grid.backend != "local" or world is None:
        return None
    if not world.isdigit() or int(world) < 1:
        out.errors.append(f"WORLD_SIZE={world!r} (set by torchrun) is not a positive integer")
        return None
    if int(world) != grid.policy_ranks:
        out.errors.append(
            f"torchrun started WORLD_SIZE={world} processes but grid.shapes.policy={grid.shapes.policy} has "
            f"POLICY_RANKS={grid.policy_ranks}: under grid.backend=local every process is one policy rank; "
            f"launch with --nproc_per_node={grid.policy_ranks} or set grid.shapes.policy=[1,{world}]"
        )
    return int(world), f"torchrun WORLD_SIZE={world}, one GPU per process"


def _check_allocation(cfg: RunConfig, env: Mapping[str, str], out: Findings) -> None:
    """An allocation too small for the shapes is refused before anything starts."""
    found = _allocation(cfg, env, out)
    if found is None:
        return
    have, source = found
    grid = cfg.grid
    plan = role_plan(cfg)  # the teacher's own pool too (OPD under Ray): distributed/placement.py
    if have < plan.total:
        teacher = " and the teacher pool" if plan.teacher_gpus else ""
        out.errors.append(
            f"the allocation has {have} GPUs ({source}) but grid.shapes policy={grid.shapes.policy} "
            f"rollout={grid.shapes.rollout}{teacher} need {plan.total} ({plan.arithmetic()}); shrink the shapes "
            "or allocate more"
        )


def _check_not_built(cfg: RunConfig, out: Findings) -> None:
    """What this version cannot run yet, named precisely."""
    grid = cfg.grid
    replicas, ranks = grid.shapes.rollout[0], grid.policy_ranks
    if ranks > 1 and cfg.rl.max_off_policy_steps > 0:
        out.errors.append(
            f"rl.max_off_policy_steps={cfg.rl.max_off_policy_steps} with POLICY_RANKS={ranks}: the background "
            "rollout would run collectives (metrics, dynamic sampling) beside the training step's; use "
            "rl.max_off_policy_steps=0 with several policy ranks (not implemented yet)"
        )
    if grid.backend == "ray":
        if importlib.util.find_spec("ray") is None:
            out.errors.append("grid.backend=ray but Ray is not installed: pip install 'posttrain[ray]'")
        check_rollout_tp(cfg, out)  # vLLM, disaggregated, a transport to every lane (preflight/rollout_tp.py)
        if grid.gpu_placement == "disaggregated":
            if replicas > ranks:
                out.errors.append(
                    f"grid.shapes.rollout={grid.shapes.rollout}: {replicas} rollout replicas for {ranks} policy ranks; "
                    "each policy rank samples on one replica, so ROLLOUT_REPLICAS must be <= POLICY_RANKS"
                )
            if cfg.rl.max_off_policy_steps > 0:
                out.errors.append(
                    f"rl.max_off_policy_steps={cfg.rl.max_off_policy_steps} with grid.gpu_placement=disaggregated: "
                    "sampling on a rollout replica while the policy trains is not implemented yet; use "
                    "rl.max_off_policy_steps=0 (or a colocated vLLM engine)"
                )
            return
    if replicas > 1 and replicas != ranks:
        out.errors.append(
            f"grid.shapes.rollout={grid.shapes.rollout}: with grid.gpu_placement=colocated every policy rank holds one "
            f"colocated rollout engine, so ROLLOUT_REPLICAS is POLICY_RANKS={ranks}; write "
            f"grid.shapes.rollout=[{ranks},1] (or [1,1]); other counts of rollout replicas need "
            "grid.backend=ray with grid.gpu_placement=disaggregated"
        )


def check_grid(cfg: RunConfig, out: Findings, env: Mapping[str, str] | None = None) -> None:
    """Topology: shapes, backend combinations, data parallelism, the allocation (declared, or
    torchrun's ``WORLD_SIZE``), and what is not built yet. Needs no cluster."""
    if not _check_shapes(cfg, out):
        return
    _check_backend(cfg, out)
    _check_data_parallel(cfg, out)
    _check_allocation(cfg, os.environ if env is None else env, out)
    _check_not_built(cfg, out)
