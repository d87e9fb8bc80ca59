"""Optimizer and learning-rate schedule from ``rl.optimizer``."""

from __future__ import annotations

import torch
from torch import nn

from posttrain.config.schema import OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (plain or fused) or Muon with auxiliary AdamW, over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name == "muon":
        from posttrain.policy.muon import MuonWithAuxAdamW, split_params_for_muon

        muon_params, adamw_params = split_params_for_muon(model)
        return MuonWithAuxAdamW(
            muon_params=muon_params,
            adamw_params=adamw_params,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum,
            ns_steps=cfg.muon_ns_steps,
            rms_match=cfg.muon_rms_match,
        )
    # The fused kernel exists for CUDA tensors; on CPU `fusedadam` falls back to the foreach path,
    # which computes the same update.
    fused = cfg.name == "fusedadam" and device.type == "cuda"
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=fused or None,
        foreach=None if fused else True,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps`` optimizer steps, then constant."""

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
