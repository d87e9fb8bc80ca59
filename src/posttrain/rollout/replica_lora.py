"""LoRA adapters on disaggregated rollout replicas (``model.lora`` with ``grid.gpu_placement=disaggregated``).

**The policy side** (``sync_tensors``, called by ``rollout/remote.py``'s proxy on every policy rank):
a LoRA policy's weight sync sends its trained tensors alone (the ``lora_A`` / ``lora_B`` factors under
the policy's state-dict names: ``models/lora.py``'s ``trained_state_dict``, a collective when the
policy is sharded), not the full state dict, through whichever ``rl.weight_sync_transport`` the run
uses. A full fine-tuning policy sends its full state dict as before.

**The replica side** (``ReplicaAdapter``, held by ``rollout/replica.py``'s ``Replica``):

* a transformers replica wraps its own copy of the base model with the same adapters
  (``apply_lora`` with the run's ``model.lora``), so its trained names are the policy's; each version
  is copied in place through the engine's ``load_weights`` (stamped only once every tensor was
  copied; a failure midway poisons it) and sampled with unmerged, like the colocated engine does;
* a vLLM replica keeps the base weights it was built with (``enable_lora``) and loads each version as
  a new ``LoRARequest`` (``VLLMRolloutEngine.load_adapter``, ``rollout/vllm_lora.py``), with the
  ``peft.LoraConfig`` of a meta-device skeleton of the model wrapped the same way (no weights loaded).

Before anything is written the received names and shapes are checked against the adapter the
replica expects: a transfer that brought part of the adapter, or another one, is refused (and the
actor poisons the replica: ``launch/ray_backend.py``). The first version received is described
once on the replica's stderr (tensor count and bytes), which the Ray driver forwards.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from posttrain.errors import TrainingError
from posttrain.models.lora import ADAPTER, apply_lora, is_lora, trained_state_dict

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.distributed.fsdp import PolicyWeights

Layout = dict[str, tuple[tuple[int, ...], str]]


def sync_tensors(weights: PolicyWeights) -> dict[str, torch.Tensor]:
    """What a weight sync sends a rollout replica: the adapter alone for a LoRA policy, else the full
    state dict (each a collective every policy rank calls, in step, when the policy is sharded)."""
    if is_lora(weights.module):
        return trained_state_dict(weights.module)
    return weights.full_state_dict()


def _layout(tensors: Mapping[str, torch.Tensor]) -> Layout:
    return {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()}


def _skeleton_config(cfg: RunConfig, model_dir: str) -> tuple[Any, Layout]:
    """The ``peft.LoraConfig`` and adapter layout a policy loaded from ``model_dir`` gets, from a
    meta-device copy of the model (nothing allocated, no weights read) wrapped with ``model.lora``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        skeleton = apply_lora(AutoModelForCausalLM.from_config(config), cfg.model.lora)
    peft_config = skeleton.peft_config[ADAPTER]
    peft_config.base_model_name_or_path = model_dir
    return peft_config, _layout(trained_state_dict(skeleton))


class ReplicaAdapter:
    """The adapter of one replica's engine: what each version must bring, and how it goes in."""

    def __init__(self, engine: Any, layout: Layout, peft_config: Any = None) -> None:
        """``peft_config``: the vLLM engine's adapter config (None: a transformers engine, whose model
        carries its adapters and takes the tensors in place)."""
        self.engine = engine
        self.expected = layout
        self.peft_config = peft_config
        self.versions = 0

    @classmethod
    def for_hf(cls, engine: Any) -> ReplicaAdapter:
        """A transformers replica whose model was wrapped with ``apply_lora``."""
        if not is_lora(engine.model):
            raise TrainingError("the rollout replica's model has no LoRA adapters (apply_lora first)")
        return cls(engine, _layout(trained_state_dict(engine.model)))

    @classmethod
    def for_vllm(cls, engine: Any, cfg: RunConfig, model_dir: str) -> ReplicaAdapter:
        """A vLLM replica built with LoRA (``lora_rank``) on ``model_dir``'s base weights."""
        peft_config, layout = _skeleton_config(cfg, model_dir)
        return cls(engine, layout, peft_config)

    def layout(self) -> Layout | None:
        """Name -> (shape, dtype) of what each version brings (the nixl transport's coverage check);
        None for vLLM, which casts to its own dtype (``load`` checks names and shapes)."""
        return dict(self.expected) if self.peft_config is None else None

    def check(self, named: Mapping[str, torch.Tensor], version: int) -> None:
        """Refuse ``named`` unless it is exactly the adapter this replica serves (names and shapes)."""
        missing = sorted(set(self.expected) - set(named))
        extra = sorted(set(named) - set(self.expected))
        shapes = [k for k, t in named.items() if k in self.expected and tuple(t.shape) != self.expected[k][0]]
        if missing or extra or shapes:
            raise TrainingError(
                f"the adapter of version {version} does not fit the rollout replica's model.lora: "
                f"{len(missing)} missing (first {missing[:2]}), {len(extra)} unexpected (first {extra[:2]}), "
                f"{len(shapes)} of other shapes (first {shapes[:2]}); the policy and the replica must use the same "
                "model and model.lora"
            )

    def load(self, named: Mapping[str, torch.Tensor], version: int) -> None:
        """Version ``version`` of the adapter into the engine, stamped once it is whole."""
        self.check(named, version)
        if self.peft_config is None:
            self.engine.load_weights(named, version)
        else:
            self.engine.load_adapter(named, self.peft_config, version)
        self.versions += 1
        if self.versions == 1:
            size = sum(t.numel() * t.element_size() for t in named.values())
            print(
                f"rollout replica: weight version {version} is the LoRA adapter alone: {len(named)} tensors, "
                f"{size / 2**20:.2f} MiB",
                file=sys.stderr,
                flush=True,
            )


def replica_adapter(cfg: RunConfig, engine: Any, model_dir: str | None = None) -> ReplicaAdapter | None:
    """The replica's ``ReplicaAdapter`` for a LoRA run (None without ``model.lora``); ``model_dir``:
    the vLLM engine's base model directory."""
    if not cfg.model.lora.enabled:
        return None
    if cfg.rollout.backend == "vllm":
        if model_dir is None:
            raise TrainingError("a vLLM replica's adapter needs the base model directory it was built from")
        return ReplicaAdapter.for_vllm(engine, cfg, model_dir)
    return ReplicaAdapter.for_hf(engine)
