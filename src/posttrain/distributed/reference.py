"""The frozen KL reference under FSDP2: sharded over the policy's mesh, never a full copy per rank.

The reference (``policy.trainer.build_reference``) is built from the whole model, like the policy,
and then sharded over the policy's own mesh, one FSDP2 unit per decoder layer as the policy is, so
each rank keeps ``1 / dp_shard`` of it. It needs no gradients and no optimizer: only forwards run
through it, under ``no_grad``, and ``DataParallel.reshard`` frees what a pass left gathered.

Where its layout differs from the policy's (``shard_policy``), it is because nothing ever runs a
backward through it. The policy shares one unit between the input embedding and the LM head; a
grouped unit finishes its forward only when every module of the group has run since the last
backward, so after the chunked head's calls of a no-grad pass it stays "in forward", and
``reshard()`` leaves it gathered. The reference therefore shards the LM head as a unit of its own
(kept gathered across the pass's chunks, freed by the explicit reshard after it) and the embedding
as another (freed right after its lookup). A tied head gets its own copy of the shared matrix first:
the two are never updated, so untying changes no logit, and each copy is sharded.

Its shards are stored in the run's compute dtype (``models/precision.py``): a bf16 reference of fp32
master weights is what the policy's ``MixedPrecisionPolicy`` all-gathers and computes with anyway
(an elementwise cast commutes with sharding), so the two compute alike while the reference holds
half the bytes. In one process the reference is returned as built (fp32, read as bf16 copies per
forward when mixed, as the policy is).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from posttrain.distributed.fsdp import DataParallel, SingleProcess, decoder_layers
from posttrain.errors import PosttrainError
from posttrain.models.structure import split_body_and_head

__all__ = ["shard_reference", "shard_reference_for_world"]


def _untie_head(model: nn.Module, head: nn.Module, embedding: nn.Module) -> None:
    """Give a head tied to the input embedding its own (equal) weight, so each can be its own unit."""
    weight = getattr(head, "weight", None)
    tied = weight is getattr(embedding, "weight", None)
    if not tied or not isinstance(weight, torch.Tensor):
        return
    head.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "tie_word_embeddings"):
        config.tie_word_embeddings = False  # nothing may re-tie them (transformers' tie_weights)


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Store ``model``'s floating-point parameters in ``dtype``, in place (tied ones stay tied).

    Parameters only: buffers keep their dtype, as under the policy's ``MixedPrecisionPolicy``
    (a rotary ``inv_freq`` cast to bf16 would move every position's angle)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def shard_reference(reference: nn.Module, mesh: DeviceMesh) -> None:
    """Apply FSDP2 to the frozen ``reference`` in place over ``mesh``: one unit per decoder layer and
    one for the input embedding (each resharded after its forward), one for the LM head (gathered
    until the pass's explicit ``reshard``), and the decoder body as the root (its final norm)."""
    layers = decoder_layers(reference)
    body, head = split_body_and_head(reference)
    get_embedding = getattr(reference, "get_input_embeddings", None)
    embedding = get_embedding() if callable(get_embedding) else None
    if not isinstance(embedding, nn.Module):
        raise PosttrainError(
            f"{type(reference).__name__} has no get_input_embeddings(); posttrain shards *ForCausalLM models"
        )
    _untie_head(reference, head, embedding)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(embedding, mesh=mesh, reshard_after_forward=True)
    fully_shard(head, mesh=mesh, reshard_after_forward=False)  # called once per logprob chunk
    owner = getattr(reference, "model", None)
    visual = getattr(owner, "visual", None)
    if isinstance(visual, nn.Module) and isinstance(owner, nn.Module):
        # A vision-language reference (Qwen3-VL): its multimodal body runs first (policy/images.py),
        # so it is the root, and the vision tower is a unit of its own (as for the policy, fsdp.py).
        fully_shard(visual, mesh=mesh, reshard_after_forward=True)
        body = owner
    fully_shard(body, mesh=mesh, reshard_after_forward=False)
    reference.requires_grad_(False)  # fully_shard re-wraps the parameters: keep them frozen
    plain = [name for name, p in reference.named_parameters() if not isinstance(p, DTensor)]
    if plain:  # such a parameter would be a whole copy on every rank
        raise PosttrainError(f"FSDP2 left reference parameters unsharded (outside the body and LM head): {plain[:4]}")


def shard_reference_for_world(
    reference: nn.Module | None,
    dp: DataParallel | SingleProcess,
    *,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module | None:
    """Shard ``reference`` in place over the mesh of the policy's ``dp`` (``shard_for_world``'s
    result) when the policy is sharded, storing it in ``compute_dtype`` (None: as built); returned
    as it is for ``SingleProcess`` or when the run has no reference (None)."""
    if reference is None or not isinstance(dp, DataParallel):
        return reference
    if compute_dtype is not None:
        _cast_parameters(reference, compute_dtype)
    shard_reference(reference, dp.mesh)
    return reference
