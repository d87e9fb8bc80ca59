"""The frozen reference policy a KL term (or its metrics) reads: a copy of the initial policy, the
model of ``rl.ref.model_dir``, or a LoRA policy with its adapter disabled."""

from __future__ import annotations

import copy

from torch import nn

from posttrain.config.schema import RunConfig
from posttrain.errors import PosttrainError
from posttrain.policy.objective import Objective


def build_reference(policy: nn.Module, cfg: RunConfig, objective: Objective) -> nn.Module | None:
    """A frozen copy of the initial policy (or of the objective's ``reference_dir``, GRPO's
    ``rl.ref.model_dir``) when the objective needs one; None otherwise. A LoRA policy's reference is
    the policy itself under ``disable_adapter()`` (``models/lora.py``)."""
    if not objective.builds_reference:
        return None
    if cfg.model.lora.enabled and objective.reference_dir is None:
        # LoRA: the initial policy IS the base model with the adapter disabled; no copy is built.
        from posttrain.models.lora import adapter_disabled_reference

        return adapter_disabled_reference(policy)
    ref: nn.Module
    if objective.reference_dir is not None:
        from posttrain.models.loading import load_model_and_tokenizer

        update = {"name_or_path": objective.reference_dir, "revision": cfg.rl.ref.revision}  # not model.revision
        ref, _ = load_model_and_tokenizer(cfg.model.model_copy(update=update), key="rl.ref.model_dir")
    else:
        ref = copy.deepcopy(policy)
    live = [name for name, mod in ref.named_modules() if isinstance(mod, nn.Dropout) and mod.p > 0]
    live += [
        k
        for k, v in vars(getattr(ref, "config", object())).items()
        if "dropout" in k and isinstance(v, float) and v > 0
    ]
    if live:
        raise PosttrainError(
            f"the reference model has live dropout ({', '.join(live[:4])}): its logprobs would be random; "
            "set the dropout probabilities to 0 in the model config"
        )
    ref.eval()
    ref.requires_grad_(False)
    return ref
