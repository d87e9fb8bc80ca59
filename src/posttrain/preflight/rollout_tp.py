"""Preflight rules of tensor-parallel rollout (``rollout.tensor_parallel_size > 1``): what such a
replica needs, refused by name before any model loads. Reads the config only.

A TP replica is ``ROLLOUT_RANKS = rollout.tensor_parallel_size`` lane actors forming one vLLM
engine (``launch/rollout_lanes.py``), so it needs ``grid.backend=ray`` (checked in
``preflight/grid.py``), the vLLM engine, a disaggregated placement (colocated TP, the policy ranks
doubling as the engine's ranks, is not built), a transport that reaches every lane, and a node
that holds whole TP groups.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.config.schema import RunConfig
from posttrain.preflight.findings import Findings


def check_rollout_tp(cfg: RunConfig, out: Findings) -> None:
    """The mismatch rules of a tensor-parallel rollout replica under ``grid.backend=ray``."""
    grid, ro = cfg.grid, cfg.rollout
    tp = ro.tensor_parallel_size
    if tp == 1 or grid.backend != "ray":
        return
    what = f"rollout.tensor_parallel_size={tp}"
    if ro.backend != "vllm":
        out.errors.append(
            f"{what} with rollout.backend={ro.backend}: the transformers engine has no tensor parallelism; use "
            f"rollout.backend=vllm (one vLLM engine over the replica's {tp} ranks) or rollout.tensor_parallel_size=1 "
            "with more ROLLOUT_REPLICAS"
        )
    if grid.gpu_placement == "colocated":
        out.errors.append(
            f"{what} with grid.gpu_placement=colocated: colocated rollout replicas wider than one device are not "
            "implemented yet (every policy rank holds one whole engine); use grid.gpu_placement=disaggregated "
            f"(the replica's {tp} ranks on devices of their own) with rl.weight_sync_transport=object_store or nccl"
        )
    elif cfg.rl.weight_sync_transport == "nixl":
        out.errors.append(
            f"rl.weight_sync_transport=nixl cannot reach all {tp} lanes of a tensor-parallel rollout replica (its "
            "writes land in one registered buffer of one process); use object_store or nccl, which send the full "
            "weights to every lane"
        )
    if grid.gpus_per_node is not None and grid.gpus_per_node % tp:
        out.errors.append(
            f"{what} does not divide grid.gpus_per_node={grid.gpus_per_node}: a replica's ranks are one TP group "
            "packed on one node, so nodes must hold whole groups; choose a tensor-parallel size that divides the "
            "GPUs per node"
        )
    head_problem = _head_split_problem(cfg.model.name_or_path, tp)
    if head_problem is not None:
        out.errors.append(f"{what}: {head_problem}")
    if cfg.model.lora.rank > 0:
        out.errors.append(
            f"{what} with model.lora.rank={cfg.model.lora.rank}: adapter sync into a tensor-parallel replica is not "
            "implemented yet; use rollout.tensor_parallel_size=1"
        )


def _head_split_problem(name_or_path: str, tp: int) -> str | None:
    """Why vLLM cannot split a local model directory's attention heads over ``tp`` ranks, or None.

    vLLM needs ``num_attention_heads`` divisible by TP, and key/value heads divisible by TP (or, when
    fewer, dividing TP: each is then replicated). Only a local directory's ``config.json`` is read
    here; for an embedded or hub model vLLM's own error at engine start names the split."""
    config_file = Path(name_or_path).expanduser() / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None  # not a readable local directory: the path checks report what is wrong
    if not isinstance(config, dict):
        return None
    config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if not isinstance(heads, int) or heads <= 0:
        return None
    kv = kv_heads if isinstance(kv_heads, int) and kv_heads > 0 else heads
    if heads % tp == 0 and (kv % tp == 0 if kv >= tp else tp % kv == 0):
        return None
    return (
        f"{config_file} has {heads} attention heads and {kv} key/value heads, which vLLM cannot split over {tp} "
        "tensor-parallel ranks (attention heads must divide by the TP size, key/value heads divide by it or "
        "divide it); choose a rollout.tensor_parallel_size that fits them"
    )
