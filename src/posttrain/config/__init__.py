"""Typed configuration: the models (``schema``: the shared ``RunConfig`` and ``GRPOConfig``; ``opd``:
``OPDConfig``; ``grid``: topology; ``section``: the base class and the rules every field obeys),
recipe loading and dotted overrides (``loading``; values read by ``yaml_values`` as YAML 1.2) and
the reference page (``docs``).
A leaf layer: it imports nothing else of posttrain but ``errors``, and no torch. Cross-field rules and
the model-free checks are the preflight's (``posttrain.preflight``)."""

from posttrain.config.schema import GRPOConfig, RunConfig

__all__ = ["GRPOConfig", "RunConfig"]
