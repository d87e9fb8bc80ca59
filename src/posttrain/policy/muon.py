"""Muon (Newton-Schulz orthogonalised momentum) for hidden Linear weights, AdamW for the rest.

Muon (K. Jordan et al., 2024, "Muon: an optimizer for hidden layers in neural networks") replaces
the update of a 2-D weight by the nearest semi-orthogonal matrix to its momentum, ``U V^T`` of the
momentum's SVD, approximated with a few Newton-Schulz iterations. It is only meant for the matrices
of the transformer body: embeddings, the output head, norms, biases and anything whose 2-D shape is
not one linear map (fused projections, routers, convolutions) stay on an auxiliary AdamW.

The update RMS is matched to AdamW's typical RMS as in Moonshot's "Muon is Scalable for LLM
Training" (arXiv 2502.16982, §2.2): an orthogonal ``m x n`` matrix has RMS ``1/sqrt(max(m, n))``,
so scaling it by ``rms_match · sqrt(max(m, n))`` gives an update of RMS ``rms_match`` and lets one
learning rate serve both groups (a starting point; re-tune lr).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Quintic Newton-Schulz coefficients ``(a, b, c)`` of ``x -> a x + b x^3 + c x^5`` applied to the
singular values. Chosen (Jordan et al. 2024) for a steep slope at 0 rather than convergence to
exactly 1: after 5 steps the singular values of the result lie in a band around 1 (about
[0.68, 1.13] for a well-conditioned input) instead of exactly 1, which works as well for training
and needs far fewer iterations."""

# Module-name pieces that mark a Linear whose weight is not one hidden linear map.
_AMBIGUOUS_NAME_PARTS = ("lm_head", "embed", "head", "score", "classifier", "router", "qkv", "gate_up")
_ROUTER_LEAF_NAMES = ("gate", "router")


def newton_schulz_orthogonalize(G: Tensor, steps: int, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """Approximate ``U V^T`` of ``G = U S V^T`` with ``steps`` quintic Newton-Schulz iterations.

    ``G`` is ``[..., m, n]`` (leading batch dims allowed). The matrix is first scaled by its
    Frobenius norm so every singular value is <= 1 (the iteration's basin), and iterated in the
    wide orientation (``m <= n``, transposing a tall input and transposing back) so the Gram
    matrix ``X X^T`` is the small one. ``dtype`` is the compute dtype (``torch.bfloat16`` is
    enough on GPU, float32 by default); the result is returned in ``G``'s dtype.
    """
    if G.dim() < 2:
        raise ValueError(f"Newton-Schulz needs a matrix, got shape {tuple(G.shape)}")
    if steps < 1:
        raise ValueError(f"rl.optimizer.muon_ns_steps must be >= 1, got {steps}")
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


class MuonWithAuxAdamW(torch.optim.Optimizer):
    """Muon on ``muon_params`` (2-D), AdamW on ``adamw_params``; one optimizer, two param groups.

    Both groups share ``lr`` (schedulers scale both) and ``weight_decay`` (decoupled:
    ``p *= 1 - lr · wd``). Muon step for a weight ``W`` of shape ``m x n``::

        buf = momentum · buf + grad
        u   = grad + momentum · buf        (Nesterov)   or  buf (nesterov=False)
        W  -= lr · rms_match · sqrt(max(m, n)) · NS(u)

    The AdamW group follows ``torch.optim.AdamW`` exactly (bias-corrected moments, ``eps`` added
    to ``sqrt(v_hat)``). State round-trips through ``state_dict`` / ``load_state_dict``.
    Parameters that are DTensors (FSDP2) are orthogonalised on their full matrix (gathered per
    parameter) and the local shard of the result is applied.
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
        rms_match: float = 0.2,
        nesterov: bool = True,
    ) -> None:
        muon_list, adamw_list = list(muon_params), list(adamw_params)
        for p in muon_list:
            if p.dim() != 2:
                raise ValueError(f"Muon takes 2-D weights only; got a parameter of shape {tuple(p.shape)}")
        groups: list[dict[str, object]] = []
        if muon_list:
            groups.append(
                {
                    "params": muon_list,
                    "use_muon": True,
                    "momentum": momentum,
                    "ns_steps": ns_steps,
                    "rms_match": rms_match,
                    "nesterov": nesterov,
                }
            )
        if adamw_list:
            groups.append({"params": adamw_list, "use_muon": False, "betas": betas, "eps": eps})
        if not groups:
            raise ValueError("MuonWithAuxAdamW got no parameters at all")
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(p.grad)
            update = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf
            ortho = _orthogonalize_maybe_sharded(update, group["ns_steps"])
            rows, cols = p.shape
            scale = group["rms_match"] * math.sqrt(max(rows, cols))
            if wd != 0:
                p.mul_(1.0 - lr * wd)
            p.add_(ortho.to(p.dtype), alpha=-lr * scale)

    def _adamw_group(self, group: dict) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device="cpu")
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = float(state["step"])  # a CPU scalar: no device sync
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(p.grad, 1.0 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
            bias1 = 1.0 - beta1**step
            bias2 = 1.0 - beta2**step
            denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(group["eps"])
            if wd != 0:
                p.mul_(1.0 - lr * wd)
            p.addcdiv_(exp_avg, denom, value=-lr / bias1)


def _orthogonalize_maybe_sharded(update: Tensor, steps: int) -> Tensor:
    """Newton-Schulz on the full matrix; a DTensor (FSDP2 shard) is gathered, orthogonalised and
    re-sharded locally (every rank computes the same full result, so no scatter is needed)."""
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:  # a torch build without distributed
        return newton_schulz_orthogonalize(update, steps)
    if not isinstance(update, DTensor):
        return newton_schulz_orthogonalize(update, steps)
    full = newton_schulz_orthogonalize(update.full_tensor(), steps)
    replicated = DTensor.from_local(full, update.device_mesh, [Replicate()] * update.device_mesh.ndim)
    return replicated.redistribute(update.device_mesh, update.placements)


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
