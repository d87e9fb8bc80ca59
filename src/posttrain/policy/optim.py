"""Optimizer and learning-rate schedule from ``rl.optimizer``."""

from __future__ import annotations

import math

import torch
from torch import nn

from posttrain.config.optimizer import OptimizerConfig

# Devices with torch's fused AdamW kernel (CPU since torch 2.4); Muon's auxiliary AdamW uses it there.
_FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (plain or fused) or ``torch.optim.Muon`` with an auxiliary fused AdamW (and per-expert
    Muon on declared sparse-MoE expert stacks), over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name == "muon":
        from posttrain.policy.muon import MuonWithAuxAdamW, muon_param_split

        split = muon_param_split(model)
        return MuonWithAuxAdamW(
            muon_params=split.muon,
            adamw_params=split.adamw,
            expert_stacks=split.experts,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum,
            ns_steps=cfg.muon_ns_steps,
            rms_match=cfg.muon_rms_match,
            fused=device.type in _FUSED_ADAMW_DEVICES,
        )
    # torch's fused AdamW kernel (one pass over each parameter, its gradient and both moments) where
    # the device has one: on the 2-core CPU 89 ms per step against 299 ms for the multi-tensor
    # (foreach) path's seven passes (docs/benchmarks.md). It rounds differently from foreach by an ulp,
    # so runs before 2026-12-01 (fourth session) are not reproduced bit for bit; `fusedadam` is the same.
    fused = device.type in _FUSED_ADAMW_DEVICES
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=fused or None,
        foreach=None if fused else True,
    )


def lr_factor(step: int, *, warmup_steps: int, schedule: str, min_lr_ratio: float, total_steps: int) -> float:
    """The multiple of ``lr`` that optimizer step ``step + 1`` runs at (``step``: scheduler steps taken).

    Optimizer step k (1-based) runs at ``k / warmup_steps`` during the warm-up. The peak is step
    ``P = max(warmup_steps, 1)``; ``linear`` and ``cosine`` then decay over the steps P..total so that
    step P runs at 1 and the last step (``total_steps``) at ``min_lr_ratio``; later steps stay there.
    """
    k = step + 1
    if warmup_steps > 0 and k < warmup_steps:
        return k / warmup_steps
    if schedule == "constant":
        # the historical form, kept verbatim so the default job's learning rates are bit-identical
        return min(1.0, k / warmup_steps) if warmup_steps > 0 else 1.0
    peak = max(warmup_steps, 1)
    progress = min(1.0, (k - peak) / (total_steps - peak)) if total_steps > peak else 1.0
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, *, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``rl.optimizer``'s schedule as a ``LambdaLR``: linear warm-up over ``warmup_steps`` optimizer
    steps, then ``lr_schedule`` (constant, or a decay over ``total_steps`` optimizer steps: the run's
    ``rl.max_steps x n_mini``). Its state (the steps taken) is in every checkpoint, so a resumed run
    continues the same curve."""

    def factor(step: int) -> float:
        return lr_factor(
            step,
            warmup_steps=cfg.warmup_steps,
            schedule=cfg.lr_schedule,
            min_lr_ratio=cfg.min_lr_ratio,
            total_steps=total_steps,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
