"""Muon for hidden Linear weights (``torch.optim.Muon``), AdamW for the rest, as one optimizer.

Muon (K. Jordan et al., 2024, "Muon: an optimizer for hidden layers in neural networks") replaces
the update of a 2-D weight by the nearest semi-orthogonal matrix to its momentum, ``U V^T`` of the
momentum's SVD, approximated with a few Newton-Schulz iterations. It is only meant for the matrices
of the transformer body: embeddings, the output head, norms, biases and anything whose 2-D shape is
not one linear map (fused projections, routers, convolutions) stay on an auxiliary AdamW.

Both halves are torch's own optimizers (``torch.optim.Muon``, ``torch.optim.AdamW``); this module
only chooses the parameters and puts the two behind one ``torch.optim.Optimizer``, so the trainer,
the LR scheduler and the checkpoints see one object with one state dict.

The update RMS is matched to AdamW's typical RMS as in Moonshot's "Muon is Scalable for LLM
Training" (arXiv 2502.16982, §2.2): an orthogonal ``m x n`` matrix has RMS ``1/sqrt(max(m, n))``,
so scaling it by ``rms_match · sqrt(max(m, n))`` gives an update of RMS ``rms_match`` and lets one
learning rate serve both groups (a starting point; re-tune lr).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

TORCH_RMS_MATCH = 0.2
"""The update RMS that ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")`` scales to (its
``0.2 · sqrt(max(m, n))``); another ``rms_match`` is reached through the Muon group's lr."""

# Param-group keys only the hand-written Muon (before torch.optim.Muon) wrote into its state dict.
_HAND_WRITTEN_GROUP_KEYS = ("use_muon", "rms_match")

# Module-name pieces that mark a Linear whose weight is not one hidden linear map.
_AMBIGUOUS_NAME_PARTS = ("lm_head", "embed", "head", "score", "classifier", "router", "qkv", "gate_up")
_ROUTER_LEAF_NAMES = ("gate", "router")


class MuonWithAuxAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on ``muon_params`` (2-D), ``torch.optim.AdamW`` on ``adamw_params``; one
    optimizer whose two param groups (AdamW's first, then Muon's; either may be absent) are the two
    torch optimizers' own groups, sharing one ``state``.

    Both groups follow the same lr schedule (the scheduler scales each group's lr) and the same
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
    computed on every rank). State round-trips through ``state_dict`` / ``load_state_dict``.
    """

    def __init__(
        self,
        muon_params: Iterable[nn.Parameter],
        adamw_params: Iterable[nn.Parameter],
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
        muon_list, adamw_list = list(muon_params), list(adamw_params)
        for p in muon_list:
            if p.dim() != 2:
                raise ValueError(f"Muon takes 2-D weights only; got a parameter of shape {tuple(p.shape)}")
        if not muon_list and not adamw_list:
            raise ValueError("MuonWithAuxAdamW got no parameters at all")
        if not 1 <= ns_steps < 100:  # torch.optim.Muon refuses 100 or more, but only at its first step
            raise ValueError(f"rl.optimizer.muon_ns_steps must be in [1, 99], got {ns_steps}")
        parts: list[torch.optim.Optimizer] = []
        if adamw_list:
            adamw = torch.optim.AdamW(adamw_list, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)
            parts.append(adamw)
        if muon_list:
            # exactly lr and wd at the default 0.2: the product lr * wd is then torch's own
            ratio = rms_match / TORCH_RMS_MATCH
            muon = torch.optim.Muon(
                muon_list,
                lr=lr * ratio if ratio != 1.0 else lr,
                weight_decay=weight_decay / ratio if ratio != 1.0 else weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                adjust_lr_fn="match_rms_adamw",
            )
            parts.append(muon)
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
        """One update of every parameter that has a gradient: AdamW's, then Muon's."""
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
        super().load_state_dict(state_dict)  # replaces self.param_groups and self.state
        self._share_groups_and_state()


def _is_ambiguous_linear(name: str) -> bool:
    """A Linear whose name says it is a head, an embedding-like map, a router or a fused matrix."""
    lowered = name.lower()
    leaf = lowered.rsplit(".", 1)[-1]
    return leaf in _ROUTER_LEAF_NAMES or any(part in lowered for part in _AMBIGUOUS_NAME_PARTS)


def split_params_for_muon(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(muon_params, adamw_params)`` over the trainable parameters of ``model``.

    Muon gets the 2-D weights of ``nn.Linear`` modules of the transformer body. AdamW gets
    everything else: embeddings, the output head (``get_output_embeddings()``, anything named like
    a head) and any weight tied to one, norms, biases, non-Linear 2-D weights (e.g. GPT-2's
    ``Conv1D``), routers (a Linear named ``gate`` / ``router``) and fused projections (``qkv``,
    ``gate_up``), since orthogonalising a fused matrix as one map is not what Muon means.
    Each parameter appears once even when shared; frozen parameters are left out.
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
