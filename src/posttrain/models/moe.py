"""Sparse mixture-of-experts policies: where their routers are, and their expert weights in the
layout a checkpoint (and so vLLM's loader) names them.

transformers 5 holds a Qwen3-MoE layer's experts as two stacked parameters,
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first, then up rows) and
``mlp.experts.down_proj`` ``[E, H, I]``, but ``save_pretrained`` writes them per expert
(``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj``, ``down_proj`` ``[H, I]``), which is the
layout vLLM's Qwen3-MoE loader maps onto its fused ``w13`` / ``w2`` stacks. A weight sync therefore
sends each stacked parameter as its per-expert slices (views, nothing copied) whenever the model
directory's checkpoint names them that way; a checkpoint that holds the stacks itself gets them as
they are.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from posttrain.models.structure import split_body_and_head

_STACKED = re.compile(r"^(?P<owner>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router of every sparse-MoE decoder layer, in layer order (empty for a dense model).

    A router is the ``mlp.gate`` of a layer whose ``mlp`` also holds ``experts`` and whose gate has a
    ``top_k``: transformers' Qwen3-MoE and Qwen3-VL-MoE text routers, which return
    ``(router_logits, top-k weights, top-k indices)``."""
    body, _ = split_body_and_head(model)
    layers = getattr(body, "layers", None)
    if layers is None:  # a vision-language wrapper keeps its text decoder one level down
        layers = getattr(getattr(body, "language_model", None), "layers", None)
    routers = []
    for layer in layers or []:
        mlp = getattr(layer, "mlp", None)
        gate = getattr(mlp, "gate", None)
        if gate is not None and hasattr(mlp, "experts") and hasattr(gate, "top_k"):
            routers.append(gate)
    return routers


def is_sparse_moe(model: nn.Module) -> bool:
    """Whether ``model`` has at least one sparse-MoE layer (``moe_routers``)."""
    return bool(moe_routers(model))


def checkpoint_layout(
    named_tensors: Iterable[tuple[str, torch.Tensor]], checkpoint_names: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_tensors`` with every stacked expert parameter the checkpoint names per expert split
    into its per-expert tensors (see the module docstring); everything else as it comes."""
    for name, tensor in named_tensors:
        match = _STACKED.match(name)
        if match is None or name in checkpoint_names or tensor.dim() != 3:
            yield name, tensor
            continue
        owner, kind = match["owner"], match["kind"]
        if kind == "gate_up_proj" and f"{owner}.0.gate_proj.weight" in checkpoint_names:
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{owner}.{e}.gate_proj.weight", tensor[e, :half]
                yield f"{owner}.{e}.up_proj.weight", tensor[e, half:]
        elif kind == "down_proj" and f"{owner}.0.down_proj.weight" in checkpoint_names:
            for e in range(tensor.shape[0]):
                yield f"{owner}.{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor
