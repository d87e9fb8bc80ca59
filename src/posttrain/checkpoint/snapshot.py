"""A save's snapshot: the model, optimizer and scheduler state a checkpoint writes, captured before
``CheckpointWriter.save`` returns.

For a synchronous save the snapshot may reference the live tensors (nothing changes them before the
write ends). A background save of the ``consolidated`` format copies them to CPU memory here; one of
the ``dcp`` format keeps references, and ``torch.distributed.checkpoint.async_save`` stages (copies)
them before it returns (``posttrain.checkpoint.writer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from posttrain.checkpoint.layout import Format, quiet_dcp
from posttrain.distributed.world import is_rank_zero

if TYPE_CHECKING:
    from torch import nn


def dedupe_tied(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors safetensors can store (tied weights once, no shared storage) and the alias map
    ``{alias: stored name}``. The first name of a tied group is kept, as ``save_pretrained`` keeps
    ``model.embed_tokens.weight`` and drops ``lm_head.weight``."""
    seen: dict[tuple[Any, ...], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        t = tensor.detach()
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t
    storages: dict[tuple[Any, int], int] = {}
    for t in tensors.values():
        skey = (t.device, t.untyped_storage().data_ptr())
        storages[skey] = storages.get(skey, 0) + 1
    for name, t in tensors.items():
        # partial views of one buffer, or non-contiguous tensors: safetensors needs them split
        if storages[(t.device, t.untyped_storage().data_ptr())] > 1 or not t.is_contiguous():
            tensors[name] = t.contiguous().clone()
    return tensors, aliases


def to_cpu(obj: Any, *, copy: bool, live: set[int] | None = None) -> Any:
    """``obj`` with every tensor moved to the CPU (cloned when ``copy``, so later updates cannot leak
    in). With ``live`` (storage addresses of the training state), ``copy`` clones only the CPU tensors
    that share one of those storages: the others are private already (a gather's fresh result)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if live is not None and copy:
            copy = t.device.type == "cpu" and t.untyped_storage().data_ptr() in live
        return t.to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {k: to_cpu(v, copy=copy, live=live) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v, copy=copy, live=live) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v, copy=copy, live=live) for v in obj)
    return obj


def _live_storages(model: nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """Storage addresses of this rank's weights, buffers and optimizer state (local shards)."""
    from torch.distributed.tensor import DTensor

    tensors = [*model.state_dict().values()]
    for per_param in optimizer.state.values():
        tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if isinstance(t, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in local}


@dataclass
class Snapshot:
    """What a save writes, captured before ``save`` returns."""

    step: int
    fmt: Format
    model: dict[str, Any]
    aliases: dict[str, str]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    meta: dict[str, Any]


def model_meta(model: nn.Module) -> dict[str, Any]:
    """The manifest's model fields: class name and the one floating dtype of the weights (else None)."""
    dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
    return {"model_class": type(model).__name__, "model_dtype": sorted(dtypes)[0] if len(dtypes) == 1 else None}


def take_snapshot(
    step: int, fmt: Format, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *, copy: bool
) -> Snapshot:
    """The state ``fmt`` writes; ``copy`` (a background consolidated save) clones it to CPU memory.
    A collective for a sharded policy (every rank calls it)."""
    from posttrain.distributed.fsdp import is_sharded

    model_sd: dict[str, Any]
    optim_sd: dict[str, Any]
    aliases: dict[str, str] = {}
    live: set[int] | None = None
    meta = model_meta(model)
    if fmt == "dcp":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        with quiet_dcp():
            model_sd = dict(get_model_state_dict(model))
            optim_sd = dict(get_optimizer_state_dict(model, optimizer))
    # A sharded policy (several ranks) has no whole tensor on any rank: gather them to rank 0 first.
    elif is_sharded(model):
        model_sd, aliases, optim_sd = gather_to_rank0(model, optimizer)
        meta["optimizer_layout"] = "fqn"
        # what the gather made is fresh: a background save need not copy it again (a second full
        # copy on rank 0's host), only what still shares the live state (a CPU run's buffers)
        live = _live_storages(model, optimizer) if copy else None
    else:
        model_sd, aliases = dedupe_tied(model.state_dict())
        optim_sd = optimizer.state_dict()
    return Snapshot(
        step=step,
        fmt=fmt,
        model=to_cpu(model_sd, copy=copy, live=live) if fmt == "consolidated" else model_sd,
        aliases=aliases,
        optimizer=to_cpu(optim_sd, copy=copy, live=live) if fmt == "consolidated" else optim_sd,
        scheduler=to_cpu(scheduler.state_dict(), copy=True) if scheduler is not None else None,
        meta=meta,
    )


def gather_to_rank0(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, Any]]:
    """A sharded model's full weights (deduplicated) and full optimizer state, keyed by parameter
    name, on rank 0; empty on the other ranks. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from posttrain.distributed.fsdp import full_state_dict

    weights = full_state_dict(model, to_cpu=True, rank0_only=True)
    with quiet_dcp():
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optim_sd = dict(get_optimizer_state_dict(model, optimizer, options=options))
    if not is_rank_zero():
        return {}, {}, {}
    model_sd, aliases = dedupe_tied(weights)
    return model_sd, aliases, optim_sd
