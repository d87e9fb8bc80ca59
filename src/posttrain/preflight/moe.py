"""The ``rl.routing_replay`` rules (rollout routing replay on a sparse-MoE policy), checked before any
model loads; each refusal names the knob that conflicts.

* Only the vLLM engine returns the experts it routed to (``enable_return_routed_experts``); the
  transformers engine samples with the policy module itself, so there is nothing to replay.
* Only the clipped surrogate prepares its batch through the pinned forwards; ``legacy_pg`` is refused.
* A dense policy has no router to pin.
* Activation checkpointing re-runs the decoder layers during backward, outside the pinned forward,
  so they would route by themselves there (``models/routing_replay.py``); ``model.compile`` would
  trace the pinning hooks and their per-micro-batch state into the compiled layers.
* The sampler's raw logprobs need unwarped sampling at temperature 1 (the shared rollout-logprob
  rule, ``preflight/common.py``, applies to ``rl.use_rollout_logprobs_for_loss`` with or without
  replay). OPD has no ``rl.routing_replay`` key (``config/opd.py`` explains why); a resume must keep the
  knob (it joins the exact-resume identity, ``GRPOConfig.resume_identity_extra``).

Nothing here imports torch.
"""

from __future__ import annotations

from posttrain.config.schema import GRPOConfig
from posttrain.models.loading import local_model_config
from posttrain.preflight.findings import Findings

KNOB = "rl.routing_replay=rollout"


def model_is_sparse_moe(config: dict[str, object]) -> bool:
    """Whether a Hugging Face ``config.json`` (or its ``text_config``) describes a sparse-MoE model: a
    number of experts (``num_experts``; transformers 5 writes Qwen3-MoE's as ``num_local_experts``)
    above one, and experts per token."""
    text = config.get("text_config")
    for c in (config, text if isinstance(text, dict) else {}):
        experts = c.get("num_experts", c.get("num_local_experts"))
        per_token = c.get("num_experts_per_tok")
        if isinstance(experts, int) and experts > 1 and isinstance(per_token, int) and per_token >= 1:
            return True
    return False


def check_routing_replay(cfg: GRPOConfig, out: Findings) -> None:
    """The rules of the module docstring, when ``rl.routing_replay=rollout``."""
    if cfg.rl.routing_replay != "rollout":
        return
    if cfg.rollout.backend != "vllm":
        out.errors.append(
            f"{KNOB} needs rollout.backend=vllm: only the vLLM engine returns the experts it routed to "
            f"(rollout.backend={cfg.rollout.backend} samples with the policy module itself)"
        )
    if cfg.rl.grpo_surrogate != "clipped":
        out.errors.append(
            f"{KNOB} needs rl.grpo_surrogate=clipped: only the clipped objective prepares its batch through the "
            f"pinned forwards (got rl.grpo_surrogate={cfg.rl.grpo_surrogate})"
        )
    if cfg.model.gradient_checkpointing:
        out.errors.append(
            f"{KNOB} cannot be combined with model.gradient_checkpointing=true: the recomputed layers would "
            "route by themselves during backward; set model.gradient_checkpointing=false"
        )
    if cfg.model.compile:
        out.errors.append(
            f"{KNOB} cannot be combined with model.compile=true: the pinning hooks and their per-micro-batch "
            "state would be traced into the compiled layers; set model.compile=false"
        )
    found = local_model_config(cfg.model.name_or_path, cfg.model.revision)
    if found is None:
        return  # check_model_path reports a missing or unreadable model
    config = found[1]
    if not model_is_sparse_moe(config):
        out.errors.append(
            f"{KNOB} needs a sparse-MoE policy, but model.name_or_path={cfg.model.name_or_path} is a dense "
            f"{config.get('model_type', 'model')} (its config.json declares no experts); "
            "set rl.routing_replay=off"
        )
