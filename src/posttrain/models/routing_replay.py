"""Rollout routing replay (R3, arXiv 2510.11370): pin a sparse-MoE forward to a given expert routing.

A sparse-MoE layer's router picks each token's top-k experts from near-tied scores, so two forwards
of the same weights on different kernels (the vLLM sampler and the training forward) can route a
token through different experts. R3 records the experts the sampler used and replays them in the
training forward. ``pin_routing`` does that for transformers' Qwen3-MoE / Qwen3-VL-MoE text
routers: while it is active, every MoE layer's router returns the given expert indices instead of
its own top-k, and ``record_routing`` captures the indices a forward chose by itself.

Gating weights over the pinned experts (``pinned_gate_weights``): the router's logits are still
computed from the current weights; the weights are ``softmax`` over ALL ``E`` router logits,
gathered at the pinned indices, and renormalised over the ``k`` gathered values when the model sets
``norm_topk_prob`` (Qwen3-MoE does), exactly the router's own formula with its top-k replaced by the
pinned set. This is the convention of the R3 paper (the mask is replayed, the weights stay a
function of the training logits so the router keeps its gradient) and of Megatron-core's router
replay, which NeMo-RL and slime build on: gather the full-softmax scores at the replayed indices.
When the pinned set is the router's own top-k the result is bitwise the unpinned router output.

Calls: one forward of the policy may run its decoder body more than once (the shared-prompt path
runs the prompts, then the completions on top of the cache). ``pin_routing`` takes one routing
tensor per body call, in call order, each ``[N, M, K]`` over the ``N`` positions of that call's input
flattened row-major (``[rows, length]`` -> ``rows * length``), ``M`` MoE layers in layer order, ``K``
the router's top-k. Pinning does not survive the context: activation checkpointing, which re-runs
the layers during backward, cannot be combined with it (the preflight refuses
``model.gradient_checkpointing`` with ``rl.routing_replay``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.errors import TrainingError
from posttrain.models.moe import moe_routers
from posttrain.models.structure import split_body_and_head


def pinned_gate_weights(router_logits_NE: Tensor, experts_NK: Tensor, *, norm_topk_prob: bool) -> Tensor:
    """The gating weights of the pinned experts: ``softmax(router_logits_NE)`` (fp32, over all ``E``
    experts) gathered at ``experts_NK``, renormalised over the ``K`` when ``norm_topk_prob``, in the
    logits' dtype (the router's own output dtype)."""
    probs_NE = torch.softmax(router_logits_NE, dim=-1, dtype=torch.float)
    weights_NK = probs_NE.gather(-1, experts_NK.long())
    if norm_topk_prob:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return weights_NK.to(router_logits_NE.dtype)


class _Calls:
    """Which body call is running, and the routing tensors of each call."""

    def __init__(self, routings: Sequence[Tensor] | None, layers: int) -> None:
        self.routings = routings
        self.layers = layers
        self.index = -1
        self.recorded: list[list[Tensor | None]] = []

    def start(self) -> None:
        self.index += 1
        if self.routings is not None and self.index >= len(self.routings):
            raise TrainingError(
                f"routing replay: the policy body ran {self.index + 1} times inside pin_routing, but routings "
                f"were given for {len(self.routings)} call(s)"
            )
        self.recorded.append([None] * self.layers)

    def pinned(self, layer: int, tokens: int, top_k: int) -> Tensor:
        assert self.routings is not None
        routing_NMK = self.routings[self.index]
        if routing_NMK.shape != (tokens, self.layers, top_k):
            raise TrainingError(
                f"routing replay: MoE layer {layer} of body call {self.index} routes {tokens} positions with "
                f"top-{top_k} over {self.layers} MoE layers, but the routing given for that call has shape "
                f"{tuple(routing_NMK.shape)}; the trace does not match the batch layout"
            )
        # expert ids are range-checked on the host when the trace is laid out (policy/routing.py)
        return routing_NMK[:, layer]


def _router_hook(calls: _Calls, layer: int, pin: bool) -> Any:
    def hook(router: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        logits_NE, weights_NK, experts_NK = output
        if calls.index < 0:
            raise TrainingError("routing replay: an MoE router ran outside a body call (no body pre-hook fired)")
        if not pin:
            calls.recorded[calls.index][layer] = experts_NK.detach()
            return None
        pinned_NK = calls.pinned(layer, logits_NE.shape[0], experts_NK.shape[-1])
        pinned_NK = pinned_NK.to(device=experts_NK.device, dtype=experts_NK.dtype)
        # Qwen3-VL-MoE's text router has no norm_topk_prob: it always renormalises
        norm = bool(getattr(router, "norm_topk_prob", True))
        weights = pinned_gate_weights(logits_NE, pinned_NK, norm_topk_prob=norm)
        calls.recorded[calls.index][layer] = pinned_NK
        return logits_NE, weights.to(weights_NK.dtype), pinned_NK

    return hook


@contextmanager
def _hooked(model: nn.Module, routings: Sequence[Tensor] | None) -> Iterator[_Calls]:
    routers = moe_routers(model)
    if not routers:
        raise TrainingError(f"routing replay needs a sparse-MoE model; {type(model).__name__} has no MoE router")
    body, _ = split_body_and_head(model)
    calls = _Calls(routings, len(routers))
    handles = [body.register_forward_pre_hook(lambda *_: calls.start())]
    handles += [r.register_forward_hook(_router_hook(calls, m, routings is not None)) for m, r in enumerate(routers)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def pin_routing(model: nn.Module, routings: Sequence[Tensor]) -> Iterator[None]:
    """Inside the context, body call ``i`` of ``model`` routes position ``n`` of MoE layer ``m`` to the
    experts ``routings[i][n, m]`` (``[N, M, K]`` integer tensors; see the module docstring)."""
    with _hooked(model, routings) as calls:
        yield
    if calls.index + 1 != len(routings):
        raise TrainingError(
            f"routing replay: routings were given for {len(routings)} body call(s) but the body ran "
            f"{calls.index + 1} time(s)"
        )


@contextmanager
def record_routing(model: nn.Module) -> Iterator[list[Tensor]]:
    """Inside the context the model routes by itself; on exit the yielded list holds, per body call,
    the ``[N, M, K]`` experts its routers chose (what ``pin_routing`` takes back)."""
    recorded: list[Tensor] = []
    with _hooked(model, None) as calls:
        yield recorded
    for call in calls.recorded:
        if any(t is None for t in call):
            raise TrainingError("record_routing: some MoE layer did not run in a body call")
        recorded.append(torch.stack([t for t in call if t is not None], dim=1))
