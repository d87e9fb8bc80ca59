"""The rollout engine ``rollout.backend`` names, built from the policy it samples for.

Colocated (the default) it lives in the policy's process: the transformers engine samples with the
policy module itself, the vLLM engine holds its own copy of the weights. Under
``grid.gpu_placement=disaggregated`` (Ray) the engine is a proxy to this rank's rollout replica
(``rollout/remote.py``), and the replica builds its own engine with ``build_hf_engine`` /
``build_vllm_engine`` below (``rollout/replica.py``): one construction for both places.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from posttrain.config.schema import RunConfig
from posttrain.distributed.fsdp import will_shard_policy
from posttrain.distributed.world import rank_and_world
from posttrain.metrics.sinks import MetricsLogger
from posttrain.models.loading import resolve_device, resolve_model_path
from posttrain.models.precision import Precision, dtype_name, resolve_precision
from posttrain.rollout.base import RolloutEngine
from posttrain.rollout.hf_engine import HFRolloutEngine

if TYPE_CHECKING:
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine
    from posttrain.rollout.vllm_fleet import VLLMEngineFleet


def build_rollout_engine(cfg: RunConfig, model: Any, tokenizer: Any, log: MetricsLogger) -> RolloutEngine:
    """This rank's rollout engine, built from the whole (not yet sharded) policy ``model``."""
    if cfg.grid.gpu_placement == "disaggregated":
        from posttrain.rollout.remote import rollout_proxy

        return rollout_proxy(cfg, rank_and_world()[0])
    if cfg.rollout.backend != "vllm":
        # The transformers engine samples with the module it is given; a policy about to be sharded
        # over several ranks cannot be sampled from, so the engine gets its own whole copy then.
        engine_model = copy.deepcopy(model) if will_shard_policy() else model
        hf_engine = build_hf_engine(cfg, engine_model, tokenizer)
        if next(model.parameters()).device.type == "cpu":  # the layout changes the draws: say which
            log.info(f"rollout: transformers engine, {hf_engine.weight_layout_note}")
        else:  # so do graphs
            log.info(f"rollout: transformers engine, {hf_engine.decode_note}")
        return hf_engine
    # vLLM runs in the compute dtype (bf16 under mixed precision, whatever the master weights'
    # dtype: its attention kernels take no fp32) and receives the weights cast to it.
    model_dir = resolve_model_path(cfg.model.name_or_path, cfg.model.revision)
    dtype = policy_precision(cfg, model).compute_name
    engines = cfg.rollout.engines_per_device
    engine: VLLMRolloutEngine | VLLMEngineFleet
    if engines == 1:
        engine = build_vllm_engine(cfg, model_dir, tokenizer, dtype=dtype)
    else:  # rollout/vllm_fleet.py: the preflight checked that each engine core runs apart
        from posttrain.rollout.vllm_fleet import VLLMEngineFleet

        def member(share: float) -> VLLMRolloutEngine:
            return build_vllm_engine(cfg, model_dir, tokenizer, dtype=dtype, gpu_memory_utilization=share)

        engine = VLLMEngineFleet(member, engines, cfg.rollout.gpu_memory_utilization)
    from posttrain.rollout.vllm_seeding import seeding_note

    started = "vLLM engine started" if engines == 1 else f"{engines} vLLM engines (one process each) started"
    log.info(
        f"{started} in {engine.start_s:.1f}s (logprobs_mode={engine.logprobs_mode}, "
        f"{seeding_note(engine.seeding)}, {engine.model_runner.upper()} model runner)"
    )
    return engine


def policy_precision(cfg: RunConfig, model: Any) -> Precision:
    """The precision the policy ``model`` trains in: its parameters' dtype, ``model.compute_dtype``."""
    first = next(model.parameters())
    return resolve_precision(dtype_name(first.dtype), cfg.model.compute_dtype, first.device)


def vllm_dtype(cfg: RunConfig) -> str:
    """The dtype a vLLM engine for the policy runs in, from the config alone (a replica holds no
    policy): ``model.compute_dtype`` over ``model.dtype`` on ``model.device``."""
    return resolve_precision(cfg.model.dtype, cfg.model.compute_dtype, resolve_device(cfg.model.device)).compute_name


def build_hf_engine(cfg: RunConfig, model: Any, tokenizer: Any) -> HFRolloutEngine:
    """The transformers engine the ``rollout`` section describes, sampling with ``model`` in the
    policy's compute dtype (reading the weights as the training forward does when mixed)."""
    return HFRolloutEngine(
        model,
        tokenizer,
        batch_size=cfg.rollout.batch_size,
        precision=policy_precision(cfg, model),
        cpu_weight_layout=cfg.rollout.cpu_weight_layout,
        cuda_graphs=cfg.rollout.cuda_graphs,
    )


def build_vllm_engine(
    cfg: RunConfig,
    model_dir: str,
    tokenizer: Any,
    *,
    dtype: str,
    enable_sleep_mode: bool | None = None,
    launcher_args: dict[str, Any] | None = None,
    gpu_memory_utilization: float | None = None,
) -> VLLMRolloutEngine:
    """The vLLM engine the ``rollout`` section describes, on ``model_dir``'s weights in ``dtype``;
    ``enable_sleep_mode`` overrides ``rollout.enable_sleep_mode`` (a replica with a GPU of its own
    has nothing to make room for); ``launcher_args``: a tensor-parallel lane's vLLM launcher
    arguments (``launch/rollout_lanes.py``); ``gpu_memory_utilization``: a fleet member's share
    (``rollout/vllm_fleet.py``) instead of ``rollout.gpu_memory_utilization``."""
    from posttrain.models.vision import vision_model_type
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine
    from posttrain.rollout.vllm_seeding import wants_call_seeds

    ro = cfg.rollout
    return VLLMRolloutEngine(
        model_dir,
        tokenizer,
        temperature=ro.temperature,
        gpu_memory_utilization=ro.gpu_memory_utilization if gpu_memory_utilization is None else gpu_memory_utilization,
        tensor_parallel_size=ro.tensor_parallel_size,
        max_model_len=ro.max_model_len,
        enforce_eager=ro.enforce_eager,
        cudagraph_capture_max=ro.cudagraph_capture_max,
        enable_sleep_mode=ro.enable_sleep_mode if enable_sleep_mode is None else enable_sleep_mode,
        async_scheduling=ro.async_scheduling,
        sleep_level=ro.sleep_level,
        seed=ro.seed,
        dtype=dtype,
        separate_process=ro.separate_engine_process,
        lora_rank=cfg.model.lora.rank,
        moe_backend=ro.moe_backend,
        return_routed_experts=cfg.rl.routing_replay == "rollout",
        call_seeds=wants_call_seeds(cfg),  # rollout/vllm_seeding.py: per call where it holds
        # a vision-language policy: image prompts, up to a row's limit (rollout/vllm_images.py)
        max_images_per_prompt=cfg.rl.data.images.max_per_row if vision_model_type(model_dir) else 0,
        launcher_args=launcher_args,
        model_runner=ro.vllm_model_runner,
    )
