"""Pure tensor math of the objectives: advantages, the GRPO family, KL, mismatch corrections, OPD credit.

Nothing here does I/O, talks to other processes or syncs with the device (no ``.item()``): global
quantities such as the step's token count arrive as arguments.

The names below are re-exported lazily: importing ``posttrain.algorithm`` (or a torch-free module
in it) must not import torch, because the config layer and ``--validate-manifest`` stay torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.algorithm.advantages import group_advantages, group_reward_spread, informative_groups
    from posttrain.algorithm.corrections import (
        CenteredScore,
        center_score,
        importance_weights,
        mis_weights,
        tis_weights,
    )
    from posttrain.algorithm.credit import opd_token_advantages
    from posttrain.algorithm.kl import k3_kl, k3_kl_with_clamped_grad
    from posttrain.algorithm.loss_types import LossInputs, LossNormalizer, LossStats, ObjectiveSpec
    from posttrain.algorithm.objectives import policy_loss
    from posttrain.algorithm.reductions import REDUCTIONS, reduce_loss
    from posttrain.algorithm.surrogates import clipped_surrogate, legacy_pg_surrogate, sequence_ratio, token_ratio

_SUBMODULE_OF = {
    **dict.fromkeys(["group_advantages", "group_reward_spread", "informative_groups"], "advantages"),
    **dict.fromkeys(
        ["CenteredScore", "center_score", "importance_weights", "mis_weights", "tis_weights"], "corrections"
    ),
    **dict.fromkeys(["k3_kl", "k3_kl_with_clamped_grad"], "kl"),
    **dict.fromkeys(["opd_token_advantages"], "credit"),
    **dict.fromkeys(["LossInputs", "LossNormalizer", "LossStats", "ObjectiveSpec"], "loss_types"),
    **dict.fromkeys(["policy_loss"], "objectives"),
    **dict.fromkeys(["REDUCTIONS", "reduce_loss"], "reductions"),
    **dict.fromkeys(["clipped_surrogate", "legacy_pg_surrogate", "sequence_ratio", "token_ratio"], "surrogates"),
}


def __getattr__(name: str) -> Any:
    """Import the submodule that defines ``name`` on first use."""
    if name not in _SUBMODULE_OF:
        raise AttributeError(f"module 'posttrain.algorithm' has no attribute {name!r}")
    return getattr(importlib.import_module(f"posttrain.algorithm.{_SUBMODULE_OF[name]}"), name)


__all__ = [
    "REDUCTIONS",
    "CenteredScore",
    "LossInputs",
    "LossNormalizer",
    "LossStats",
    "ObjectiveSpec",
    "center_score",
    "clipped_surrogate",
    "group_advantages",
    "group_reward_spread",
    "importance_weights",
    "informative_groups",
    "k3_kl",
    "k3_kl_with_clamped_grad",
    "legacy_pg_surrogate",
    "mis_weights",
    "opd_token_advantages",
    "policy_loss",
    "reduce_loss",
    "sequence_ratio",
    "tis_weights",
    "token_ratio",
]
