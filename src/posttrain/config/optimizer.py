"""The ``rl.optimizer`` section: the policy optimizer (AdamW or Muon), its learning-rate schedule and
gradient clipping (``policy/optim.py`` builds them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from posttrain.config.section import Section


class OptimizerConfig(Section):
    """The policy optimizer."""

    name: Literal["adamw", "fusedadam", "muon"] = "adamw"
    """``adamw`` (torch's fused kernel on CUDA and CPU); ``fusedadam`` (the same); ``muon`` (``torch.optim.Muon``,
    Newton-Schulz in bf16, for hidden 2-D weights; fused AdamW for the rest; a Muon state saved
    before torch.optim.Muon does not resume)."""
    lr: float = Field(2e-5, gt=0.0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = Field(1e-8, ge=1e-30)
    """Adam's denominator floor; belongs to the loss reduction (see ``rl.loss_type``). At least
    1e-30: smaller values round to 0 in fp32/bf16 (smallest normal 1.2e-38), and a parameter whose
    gradient is zero then updates by 0/0 = NaN."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay."""
    grad_clip_norm: float | None = Field(1.0, gt=0.0)
    """Clip the total gradient norm to this; ``null`` disables clipping (the norm is still logged)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up length in optimizer steps."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After the warm-up: ``constant`` keeps ``lr``; ``linear`` and ``cosine`` decay it to
    ``min_lr_ratio * lr`` at the last optimizer step (``rl.max_steps x n_mini`` steps in all)."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Floor of the ``linear`` / ``cosine`` decay, as a fraction of ``lr``; unused by ``constant``."""
    muon_momentum: float = Field(0.95, ge=0.0, lt=1.0)
    """Muon momentum."""
    muon_ns_steps: int = Field(5, ge=1)
    """Muon Newton-Schulz iterations."""
    muon_rms_match: float = Field(0.2, gt=0.0)
    """Muon update RMS scale (an initial LR-scale heuristic; re-tune lr)."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v
