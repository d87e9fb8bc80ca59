"""Typed configuration: the models (``schema``), recipe loading and dotted overrides (``loading``),
cross-field rules and the model-free preflight (``validate``). Imports no torch."""

from posttrain.config.schema import GRPOConfig

__all__ = ["GRPOConfig"]
