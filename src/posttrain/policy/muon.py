"""Muon for hidden Linear weights (``torch.optim.Muon``) and, per expert, for sparse-MoE expert
stacks; AdamW for the rest; as one optimizer.

Muon (K. Jordan et al., 2024, "Muon: an optimizer for hidden layers in neural networks") replaces
the update of a 2-D weight by the nearest semi-orthogonal matrix to its momentum, ``U V^T`` of the
momentum's SVD, approximated with a few Newton-Schulz iterations. It is only meant for the matrices
of the transformer body: embeddings, the output head, norms, biases and anything whose 2-D shape is
not one linear map (fused projections, routers, convolutions) stay on an auxiliary AdamW.

The 2-D weights and the rest go to torch's own optimizers (``torch.optim.Muon``,
``torch.optim.AdamW``); the expert stacks to ``ExpertStackMuon``, torch's Muon arithmetic applied per
expert. This module chooses the parameters and puts the parts behind one ``torch.optim.Optimizer``,
so the trainer, the LR scheduler and the checkpoints see one object with one state dict.

The update RMS is matched to AdamW's typical RMS as in Moonshot's "Muon is Scalable for LLM
Training" (arXiv 2502.16982, §2.2): an orthogonal ``m x n`` matrix has RMS ``1/sqrt(max(m, n))``,
so scaling it by ``rms_match · sqrt(max(m, n))`` gives an update of RMS ``rms_match`` and lets one
learning rate serve both groups (a starting point; re-tune lr).

Sparse-MoE expert stacks (``ExpertStack``): transformers holds a Qwen3-MoE layer's experts as two
3-D parameters, ``experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows) and
``experts.down_proj`` ``[E, H, I]``, which ``torch.optim.Muon`` (2-D only) cannot take. Each expert is
its own set of linear maps, so a declared stack takes Newton-Schulz per expert: every ``[2I, H]``
slice is split into its gate and up halves and each half orthogonalised on its own, every ``[H, I]``
down slice on its own, with torch's momentum, Nesterov, RMS matching (of each ``[I, H]`` / ``[H, I]``
matrix) and weight decay (``ExpertStackMuon``). Only the module classes in ``EXPERT_STACK_LAYOUTS``
are declared; any other 3-D parameter stays on AdamW. Routers (Qwen3-MoE's ``mlp.gate`` is not an
``nn.Linear``) stay on AdamW too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr

TORCH_RMS_MATCH = 0.2
"""The update RMS that ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")`` scales to (its
``0.2 · sqrt(max(m, n))``); another ``rms_match`` is reached through the Muon group's lr."""

# Param-group keys only the hand-written Muon (before torch.optim.Muon) wrote into its state dict.
_HAND_WRITTEN_GROUP_KEYS = ("use_muon", "rms_match")

# Module-name pieces that mark a Linear whose weight is not one hidden linear map.
_AMBIGUOUS_NAME_PARTS = ("lm_head", "embed", "head", "score", "classifier", "router", "qkv", "gate_up")
_ROUTER_LEAF_NAMES = ("gate", "router")

EXPERT_STACK_LAYOUTS: dict[str, dict[str, int]] = {
    "Qwen3MoeExperts": {"gate_up_proj": 2, "down_proj": 1},
    "Qwen3VLMoeTextExperts": {"gate_up_proj": 2, "down_proj": 1},
}
"""The declared expert-stack modules (by class name): each stacked parameter's name and how many
fused halves its dim 1 holds (``gate_up_proj``: gate rows, then up rows). Experts are dim 0."""


@dataclass(frozen=True)
class ExpertStack:
    """A declared stack of per-expert weights: ``param`` is ``[E, halves * m, n]``, expert ``e``'s
    weight is ``param[e]`` and it fuses ``halves`` maps of ``m x n`` along its rows (2 for a fused
    gate/up projection, 1 for a plain one)."""

    param: nn.Parameter
    halves: int = 1


class MuonSplit(NamedTuple):
    """Every trainable parameter once: 2-D hidden weights (``torch.optim.Muon``), the rest
    (``torch.optim.AdamW``) and the declared expert stacks (``ExpertStackMuon``)."""

    muon: list[nn.Parameter]
    adamw: list[nn.Parameter]
    experts: list[ExpertStack]


def zeropower_via_newtonschulz_batched(
    grad_BMN: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz`` on every ``[M, N]`` matrix of a batch
    ``[B, M, N]``, in bfloat16 (torch's own takes 2-D input only). Step for step torch's iteration:
    the wide orientation, each matrix divided by its Frobenius norm (clamped at ``eps``), then
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` (``baddbmm`` for torch's ``addmm``). On CPU each
    matrix's result is bitwise torch's (tests/unit/test_muon_experts.py); on a GPU the batched
    matmul kernels may round differently, within bfloat16."""
    a, b, c = ns_coefficients
    ortho = grad_BMN.bfloat16()
    tall = grad_BMN.size(-2) > grad_BMN.size(-1)
    if tall:
        ortho = ortho.mT
    # out of place: torch divides in place, which writes into an input that is bf16 already (a bf16
    # momentum buffer without Nesterov); the values are the same
    ortho = ortho / torch.linalg.vector_norm(ortho, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(ns_steps):
        gram = ortho @ ortho.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.baddbmm(ortho, gram_update, ortho, beta=a)
    return ortho.mT if tall else ortho


def _whole_experts(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The experts of ``t`` this rank holds, whole: the local tensor of a DTensor sharded on the
    expert axis (FSDP2's default ``Shard(0)``) or replicated; ``t`` itself when it is a plain tensor."""
    if not isinstance(t, DTensor):
        return t
    for placement in t.placements:
        if not (placement.is_replicate() or (placement.is_shard() and getattr(placement, "dim", None) == 0)):
            raise ValueError(
                f"Muon on expert stacks: a stack of shape {shape} is laid out {tuple(t.placements)}, but each "
                "rank must hold whole experts (Shard(0) on the expert axis, FSDP2's default, or Replicate); "
                "shard it on dim 0 or set rl.optimizer.name=adamw"
            )
    return t.to_local()


class ExpertStackMuon(torch.optim.Optimizer):
    """Muon per expert on declared expert stacks (``ExpertStack``), with ``torch.optim.Muon``'s
    arithmetic on every expert matrix. Its param groups are one per ``halves`` (key
    ``expert_halves``), with ``torch.optim.Muon``'s keys. Step for a stack ``W [E, h * m, n]``::

        buf = momentum · buf + (1 - momentum) · grad          (the whole stack: elementwise)
        u   = (1 - momentum) · grad + momentum · buf   (Nesterov)   or  buf
        W  *= 1 - lr · wd
        W[e, j-th m rows] -= adjust_lr(lr, (m, n)) · NS(u[e, j-th m rows])   for every e, j < h

    ``adjust_lr`` is torch's (``match_rms_adamw``: ``0.2 · sqrt(max(m, n))`` of one expert's matrix).
    A DTensor stack (FSDP2) is updated on this rank's local experts only: with ``Shard(0)`` (FSDP2's
    default placement) every rank holds whole experts, so no expert's matrix spans ranks and the
    update needs no collective; the momentum buffer is a DTensor like the parameter."""

    def __init__(
        self,
        stacks: Iterable[ExpertStack],
        *,
        lr: float,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        ns_steps: int,
        adjust_lr_fn: str = "match_rms_adamw",
    ) -> None:
        stack_list = list(stacks)
        for stack in stack_list:
            shape = tuple(stack.param.shape)
            if stack.param.dim() != 3 or stack.halves < 1 or shape[1] % stack.halves:
                raise ValueError(
                    f"an expert stack must be [E, halves * m, n]; got shape {shape} with {stack.halves} halves"
                )
        halves_values = sorted({stack.halves for stack in stack_list}, reverse=True)  # fused gate/up first
        groups = [
            {"params": [s.param for s in stack_list if s.halves == halves], "expert_halves": halves}
            for halves in halves_values
        ]
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": (DEFAULT_A, DEFAULT_B, DEFAULT_C),
            "eps": EPS,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every stack that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                self._update(p, p.grad, state["momentum_buffer"], group)
        return loss

    @staticmethod
    def _update(p: Tensor, grad: Tensor, buf: Tensor, group: dict[str, Any]) -> None:
        shape = tuple(p.shape)
        param_l, grad_l, buf_l = (_whole_experts(t, shape) for t in (p, grad, buf))
        momentum, halves = group["momentum"], group["expert_halves"]
        buf_l.lerp_(grad_l, 1 - momentum)
        update = grad_l.lerp(buf_l, momentum) if group["nesterov"] else buf_l
        experts, rows, cols = update.shape
        if experts == 0:  # more ranks than experts: this rank holds none of this stack
            return
        # [E, h * m, n] -> [E * h, m, n]: expert e's j-th half is matrix e * h + j
        matrices = update.reshape(experts * halves, rows // halves, cols)
        ortho = zeropower_via_newtonschulz_batched(matrices, group["ns_coefficients"], group["ns_steps"], group["eps"])
        lr = group["lr"]
        adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], torch.Size((rows // halves, cols)))
        param_l.mul_(1 - lr * group["weight_decay"])
        param_l.add_(ortho.reshape(experts, rows, cols), alpha=-adjusted_lr)


class MuonWithAuxAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on ``muon_params`` (2-D), ``torch.optim.AdamW`` on ``adamw_params``,
    ``ExpertStackMuon`` on ``expert_stacks``; one optimizer whose param groups (AdamW's first, then
    Muon's, then the expert stacks' (fused gate/up, then plain); any may be absent) are the parts'
    own groups, sharing one ``state``. The expert groups take the Muon group's lr, weight decay,
    momentum, Nesterov and Newton-Schulz steps.

    All groups follow the same lr schedule (the scheduler scales each group's lr) and the same
    decoupled ``weight_decay`` (``p *= 1 - lr · wd``). Muon step for a weight ``W`` of shape
    ``m x n`` (torch's arithmetic)::

        buf = momentum · buf + (1 - momentum) · grad
        u   = (1 - momentum) · grad + momentum · buf   (Nesterov)   or  buf (nesterov=False)
        W  -= lr · rms_match · sqrt(max(m, n)) · NS(u)   with NS in bfloat16

    ``rms_match`` other than 0.2 multiplies the Muon group's lr by ``rms_match / 0.2`` and divides
    its weight decay by the same (torch's ``match_rms_adamw`` is fixed at 0.2), so the product
    ``lr · wd`` and the update are as documented; the group's ``lr`` then reads that multiple.
    ``fused`` goes to the AdamW half. Parameters that are DTensors (FSDP2 shards) are updated by
    torch through DTensor dispatch: every product of the iteration costs one bf16 collective (an
    all-gather of one operand, or an all-reduce of partial sums) and each rank computes its own rows
    or columns of the ``m x n`` results (the small Gram products of a column-sharded tall matrix are
    computed on every rank). Expert stacks sharded on the expert axis are updated on each rank's
    own experts, without a collective (``ExpertStackMuon``). State round-trips through
    ``state_dict`` / ``load_state_dict``.
    """

    def __init__(
        self,
        muon_params: Iterable[nn.Parameter],
        adamw_params: Iterable[nn.Parameter],
        expert_stacks: Iterable[ExpertStack] = (),
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        ns_steps: int = 5,
        rms_match: float = TORCH_RMS_MATCH,
        nesterov: bool = True,
        fused: bool | None = None,
    ) -> None:
        muon_list, adamw_list, stack_list = list(muon_params), list(adamw_params), list(expert_stacks)
        for p in muon_list:
            if p.dim() != 2:
                raise ValueError(f"Muon takes 2-D weights only; got a parameter of shape {tuple(p.shape)}")
        if not muon_list and not adamw_list and not stack_list:
            raise ValueError("MuonWithAuxAdamW got no parameters at all")
        if not 1 <= ns_steps < 100:  # torch.optim.Muon refuses 100 or more, but only at its first step
            raise ValueError(f"rl.optimizer.muon_ns_steps must be in [1, 99], got {ns_steps}")
        parts: list[torch.optim.Optimizer] = []
        if adamw_list:
            adamw = torch.optim.AdamW(adamw_list, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)
            parts.append(adamw)
        # exactly lr and wd at the default 0.2: the product lr * wd is then torch's own
        ratio = rms_match / TORCH_RMS_MATCH
        muon_lr = lr * ratio if ratio != 1.0 else lr
        muon_wd = weight_decay / ratio if ratio != 1.0 else weight_decay
        if muon_list:
            muon = torch.optim.Muon(
                muon_list,
                lr=muon_lr,
                weight_decay=muon_wd,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                adjust_lr_fn="match_rms_adamw",
            )
            parts.append(muon)
        if stack_list:
            experts = ExpertStackMuon(
                stack_list, lr=muon_lr, weight_decay=muon_wd, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps
            )
            parts.append(experts)
        self._parts = parts
        # the same group dicts: a scheduler (or a loaded state) that sets one sets it for its optimizer
        super().__init__([group for part in parts for group in part.param_groups], {})
        self._share_groups_and_state()

    def _share_groups_and_state(self) -> None:
        """Point every part at its slice of this optimizer's groups and at this optimizer's state."""
        start = 0
        for part in self._parts:
            end = start + len(part.param_groups)
            part.param_groups = self.param_groups[start:end]
            part.state = self.state
            start = end

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient: AdamW's, then Muon's, then the expert stacks'."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self._parts:
            part.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state written by this optimizer; refuse the hand-written Muon's state by name."""
        if any(key in group for group in state_dict["param_groups"] for key in _HAND_WRITTEN_GROUP_KEYS):
            raise ValueError(
                "this optimizer state was written by posttrain's hand-written Muon (before torch.optim.Muon): "
                "its momentum buffers are sums where torch.optim.Muon keeps averages, and its groups come in "
                "another order, so it cannot resume here. Resume it with the posttrain release that wrote it, "
                "or start a new run from its weights (posttrain export-hf CHECKPOINT OUT_DIR, then "
                "model.name_or_path=OUT_DIR)"
            )
        if any("expert_halves" in group for group in self.param_groups) and not any(
            "expert_halves" in group for group in state_dict["param_groups"]
        ):
            raise ValueError(
                "this Muon optimizer state was written before declared expert stacks took per-expert "
                "Newton-Schulz (posttrain kept the stacked experts on the auxiliary AdamW then), so its groups "
                "do not fit this optimizer and it cannot resume here. Start a new run from its weights "
                "(posttrain export-hf CHECKPOINT OUT_DIR, then model.name_or_path=OUT_DIR)"
            )
        super().load_state_dict(state_dict)  # replaces self.param_groups and self.state
        self._share_groups_and_state()


def _is_ambiguous_linear(name: str) -> bool:
    """A Linear whose name says it is a head, an embedding-like map, a router or a fused matrix."""
    lowered = name.lower()
    leaf = lowered.rsplit(".", 1)[-1]
    return leaf in _ROUTER_LEAF_NAMES or any(part in lowered for part in _AMBIGUOUS_NAME_PARTS)


def declared_expert_stacks(model: nn.Module) -> list[ExpertStack]:
    """The trainable stacked parameters of every module whose class ``EXPERT_STACK_LAYOUTS``
    declares, in module order."""
    stacks = []
    for module in model.modules():
        layout = EXPERT_STACK_LAYOUTS.get(type(module).__name__)
        for name, halves in (layout or {}).items():
            param = getattr(module, name, None)
            if isinstance(param, nn.Parameter) and param.requires_grad and param.dim() == 3:
                stacks.append(ExpertStack(param, halves))
    return stacks


def muon_param_split(model: nn.Module) -> MuonSplit:
    """``split_params_for_muon``'s split with the declared expert stacks (``declared_expert_stacks``)
    taken out of AdamW's list, for per-expert Newton-Schulz: ``MuonWithAuxAdamW(*muon_param_split(m))``."""
    muon, adamw = split_params_for_muon(model)
    experts = declared_expert_stacks(model)
    stack_ids = {id(stack.param) for stack in experts}
    return MuonSplit(muon, [p for p in adamw if id(p) not in stack_ids], experts)


def split_params_for_muon(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(muon_params, adamw_params)`` over the trainable parameters of ``model``.

    Muon gets the 2-D weights of ``nn.Linear`` modules of the transformer body. AdamW gets
    everything else: embeddings, the output head (``get_output_embeddings()``, anything named like
    a head) and any weight tied to one, norms, biases, non-Linear 2-D weights (e.g. GPT-2's
    ``Conv1D``), routers (a Linear named ``gate`` / ``router``) and fused projections (``qkv``,
    ``gate_up``), since orthogonalising a fused matrix as one map is not what Muon means.
    Each parameter appears once even when shared; frozen parameters are left out. 3-D expert stacks
    are AdamW's here (``torch.optim.Muon`` takes 2-D only); ``muon_param_split`` moves the declared
    ones to per-expert Newton-Schulz.
    """
    excluded: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        module = fn() if callable(fn) else None
        if isinstance(module, nn.Module):
            excluded.update(id(p) for p in module.parameters())
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            excluded.update(id(p) for p in module.parameters())

    muon_ids: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not _is_ambiguous_linear(name):
            w = module.weight
            if w.dim() == 2 and id(w) not in excluded:
                muon_ids.add(id(w))

    muon: list[nn.Parameter] = []
    adamw: list[nn.Parameter] = []
    for p in model.parameters():  # de-duplicates shared parameters
        if p.requires_grad:
            (muon if id(p) in muon_ids else adamw).append(p)
    return muon, adamw
