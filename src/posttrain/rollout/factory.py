"""The rollout engine ``rollout.backend`` names, built from the policy it samples for.

Colocated (the default) it lives in the policy's process: the transformers engine samples with the
policy module itself, the vLLM engine holds its own copy of the weights. Under
``grid.gpu_placement=disaggregated`` (Ray) the engine is a proxy to this rank's rollout replica.
"""

from __future__ import annotations

import copy
from typing import Any

from posttrain.config.schema import GRPOConfig
from posttrain.distributed.fsdp import will_shard_policy
from posttrain.distributed.world import rank_and_world
from posttrain.metrics.sinks import MetricsLogger
from posttrain.models.loading import resolve_model_path
from posttrain.rollout.base import RolloutEngine
from posttrain.rollout.hf_engine import HFRolloutEngine


def build_rollout_engine(cfg: GRPOConfig, model: Any, tokenizer: Any, log: MetricsLogger) -> RolloutEngine:
    """This rank's rollout engine, built from the whole (not yet sharded) policy ``model``."""
    ro = cfg.rollout
    if cfg.grid.gpu_placement == "disaggregated":
        from posttrain.launch.ray_backend import rollout_proxy

        return rollout_proxy(cfg, rank_and_world()[0])
    if ro.backend != "vllm":
        # The transformers engine samples with the module it is given; a policy about to be sharded
        # over several ranks cannot be sampled from, so the engine gets its own whole copy then.
        engine_model = copy.deepcopy(model) if will_shard_policy() else model
        return HFRolloutEngine(engine_model, tokenizer, batch_size=ro.batch_size)
    from posttrain.rollout.vllm_engine import engine_from_config

    engine = engine_from_config(
        ro,
        resolve_model_path(cfg.model.name_or_path),
        tokenizer,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        policy=model,
    )
    log.info(f"vLLM engine started in {engine.start_s:.1f}s (logprobs_mode={engine.logprobs_mode})")
    return engine
