"""Routing replay in the trainer: lay the sampler's per-completion expert traces onto the trainer's
batch layouts, token by token (pure host-side functions), and pin a forward to them.

vLLM returns, per completion, the experts of every position it ran: ``[P + C - 1, M, K]`` (prompt
positions, then completion positions; the last sampled token was never fed back). The trainer's
forward sees the same tokens in other layouts, and each layout needs the trace re-placed:

* padded (``build_policy_batch``): sequence ``b`` right-padded in its own row;
* packed (``model.sequence_packing``): sequences end to end, at ``PolicyBatch.seq_start_B``;
* shared prompt (``build_grouped_batch``): a prompt pass of LEFT-padded prompts (prompt ``i`` ends
  at the last column), then a completion pass of right-padded completions on top of the cache.

The shared-prompt pass runs a prompt once for its whole group, so it is pinned to the group's first
member's prompt trace; members' prompt traces differ only where vLLM recomputed the prompt for one
of them, and ``model.share_prompt_prefix=false`` pins every member to its own.

Each layout is its own function here; padding the trace on the wrong side would pin every real token to
a neighbour's experts without any error, which the tests check position by position. The last real
position of every sequence (the final completion token, which vLLM never ran) and padding positions
are pinned to a placeholder (the previous position's experts; ``0..K-1`` for padding): their
outputs predict no token the loss reads, and causal attention keeps them from reaching one that does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor, nn

from posttrain.errors import TrainingError
from posttrain.models.moe import moe_routers
from posttrain.models.routing_replay import pin_routing
from posttrain.policy.batching import PolicyBatch
from posttrain.policy.shared_prefix import GroupedBatch
from posttrain.policy.train_batch import RoutingTrace, TrainBatch
from posttrain.policy.transfer import to_device


def sequence_routing(trace_SMK: Tensor, length: int, where: str = "completion") -> Tensor:
    """The routing of all ``length`` (= P + C) positions of one sequence from its sampler trace,
    which covers the first ``length - 1`` (or all ``length``); the last position repeats the one
    before it (a placeholder, see the module docstring)."""
    rows = int(trace_SMK.shape[0])
    if rows not in (length - 1, length) or trace_SMK.dim() != 3:
        raise TrainingError(
            f"routing replay: {where} has {length} prompt + completion tokens but a routing trace of shape "
            f"{tuple(trace_SMK.shape)}; the engine must return [prompt + completion - 1, layers, top_k]"
        )
    if rows == length:
        return trace_SMK
    if rows == 0:  # a one-token prompt and an empty completion: nothing ran, nothing is read
        return _filler(1, trace_SMK.shape[1], trace_SMK.shape[2], trace_SMK.dtype)
    return torch.cat([trace_SMK, trace_SMK[-1:]], dim=0)


def _filler(positions: int, layers: int, top_k: int, dtype: torch.dtype) -> Tensor:
    """Distinct valid experts ``0..K-1`` at every position (padding), in the traces' dtype (int16
    from vLLM: the laid-out routing of a micro-batch costs 2 bytes per position, layer and expert)."""
    return torch.arange(top_k, dtype=dtype).expand(positions, layers, top_k).clone()


def check_trace_shape(trace: RoutingTrace, layers: int, top_k: int, num_experts: int) -> None:
    """Refuse traces whose layer count, top-k or expert ids do not fit the policy."""
    for i, t in enumerate(trace.experts):
        if t.dim() != 3 or t.shape[1] != layers or t.shape[2] != top_k:
            raise TrainingError(
                f"routing replay: completion {i} has a routing trace of shape {tuple(t.shape)}, but the policy "
                f"has {layers} MoE layers with top-{top_k}; the rollout model and the policy must match"
            )
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_experts):
            raise TrainingError(
                f"routing replay: completion {i} routes to expert ids in [{int(t.min())}, {int(t.max())}], "
                f"outside the policy's {num_experts} experts"
            )


def policy_batch_routing(pb: PolicyBatch, traces: list[Tensor], lengths: list[int]) -> Tensor:
    """``[R * L, M, K]``: sequence ``b``'s routing (``traces[b]`` for its ``lengths[b]`` positions)
    placed at ``pb.seq_start_B[b]`` of the flattened padded or packed input; padding gets filler."""
    flat = int(pb.input_ids_RL.numel())
    layers, top_k = int(traces[0].shape[1]), int(traces[0].shape[2])
    out_NMK = _filler(flat, layers, top_k, traces[0].dtype)
    for b, (trace, n) in enumerate(zip(traces, lengths)):
        start = pb.seq_start_B[b]
        out_NMK[start : start + n] = sequence_routing(trace, n, f"completion {b}")
    return out_NMK


def grouped_batch_routing(
    gb: GroupedBatch, traces: list[Tensor], prompt_lengths: list[int], completion_lengths: list[int]
) -> tuple[Tensor, Tensor]:
    """The routing of the two body calls of the shared-prompt forward: the prompt pass ``[N * P, M, K]``
    (prompt ``i`` LEFT-padded, pinned to its group's first member's prompt positions) and the
    completion pass ``[B * T, M, K]`` (completion ``b`` right-padded, its trace after the prompt)."""
    g = gb.group_size
    n_prompts, width_p = gb.prompt_ids_NP.shape
    rows, width_t = gb.completion_ids_BT.shape
    layers, top_k = int(traces[0].shape[1]), int(traces[0].shape[2])
    dtype = traces[0].dtype
    prompt_NPMK = _filler(n_prompts * width_p, layers, top_k, dtype).view(n_prompts, width_p, layers, top_k)
    comp_BTMK = _filler(rows * width_t, layers, top_k, dtype).view(rows, width_t, layers, top_k)
    for b in range(rows):
        p, c = prompt_lengths[b], completion_lengths[b]
        full = sequence_routing(traces[b], p + c, f"completion {b}")
        if b % g == 0:
            prompt_NPMK[b // g, width_p - p :] = full[:p]
        comp_BTMK[b, :c] = full[p:]
    return prompt_NPMK.reshape(-1, layers, top_k), comp_BTMK.reshape(-1, layers, top_k)


def batch_routing(
    mb: PolicyBatch | GroupedBatch, trace: RoutingTrace, prompt_ids: list[list[int]], completion_ids: list[list[int]]
) -> list[Tensor]:
    """The routing tensor of each body call a forward of ``mb`` makes (``models.routing_replay.pin_routing``'s
    argument), from the traces of its rows (``trace.experts[b]`` belongs to ``prompt_ids[b]`` +
    ``completion_ids[b]``; for a ``GroupedBatch`` one prompt list entry per completion)."""
    p_lens = [len(p) for p in prompt_ids]
    c_lens = [len(c) for c in completion_ids]
    if isinstance(mb, GroupedBatch):
        return list(grouped_batch_routing(mb, trace.experts, p_lens, c_lens))
    return [policy_batch_routing(mb, trace.experts, [p + c for p, c in zip(p_lens, c_lens)])]


class RoutingReplay:
    """The trainer's side of ``rl.routing_replay``: the routing of the micro-batch being computed
    (``prepare``), pinned around each of its forwards (``pinned``: the training forward, the pi_old
    pass, the reference forward). Disabled, it pins nothing and computes nothing."""

    def __init__(self, enabled: bool, model: nn.Module, device: torch.device) -> None:
        self.enabled = enabled
        self.device = device
        self._calls: list[Tensor] | None = None
        self._shape = (0, 0, 0)  # MoE layers, top-k, experts of the policy
        if enabled:
            routers = moe_routers(model)
            if not routers:
                raise TrainingError(
                    f"rl.routing_replay=rollout needs a sparse-MoE policy; {type(model).__name__} has no MoE router"
                )
            first = routers[0]
            self._shape = (len(routers), int(getattr(first, "top_k", 0)), int(getattr(first, "num_experts", 0)))

    def prepare(self, batch: TrainBatch, rows: list[int], mb: PolicyBatch | GroupedBatch) -> int:
        """Lay out the traces of ``rows`` for ``mb``'s forwards; returns how many real positions
        (prompt + completion tokens) they pin (0 when disabled)."""
        if not self.enabled:
            return 0
        if batch.routing is None:
            raise TrainingError(
                "rl.routing_replay=rollout but the batch carries no routing trace: the rollout engine must "
                "return the experts it routed to (rollout.backend=vllm)"
            )
        prompts = [batch.prompt_ids[i] for i in rows]
        completions = [batch.completion_ids[i] for i in rows]
        trace = RoutingTrace([batch.routing.experts[i] for i in rows])
        check_trace_shape(trace, *self._shape)
        self._calls = [to_device(t, self.device) for t in batch_routing(mb, trace, prompts, completions)]
        return sum(len(p) + len(c) for p, c in zip(prompts, completions))

    def pinned(self, model: nn.Module) -> AbstractContextManager[None]:
        """Pin ``model``'s next forward to the prepared routing (nothing when disabled)."""
        if self._calls is None:
            return nullcontext()
        return pin_routing(model, self._calls)
