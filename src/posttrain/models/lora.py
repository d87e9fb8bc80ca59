"""LoRA adapters on the policy through ``peft`` (``model.lora``): applying them, the reference that
disables them, the adapter's tensors in peft's format, its checkpoint view, and merging for export.

* ``apply_lora`` wraps the loaded model in a ``peft.PeftModel`` (base weights frozen, adapter pairs
  ``B @ A`` with ``B = 0``, so the wrapped model computes exactly what the base did) and leaves it in
  eval mode like ``load_model_and_tokenizer`` does. The wrapper forwards ``get_decoder`` /
  ``get_output_embeddings`` / ``config`` to the base model, so the chunked logprob path, FSDP2 and
  the transformers engine run it unchanged; only adapter matrices (and ``modules_to_save``) require
  grad, so only they reach the optimizer.
* ``adapter_disabled_reference``: the KL reference of a LoRA policy is its base model, i.e. the policy
  itself run under ``disable_adapter()``; no second copy of the weights is built.
* ``adapter_state_dict`` / ``write_adapter``: the trainable tensors under peft's file names
  (``...lora_A.weight``, without the adapter name) plus ``adapter_config.json``: a directory that
  ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load.
* ``checkpoint_module``: what the checkpoint writer and reader are handed, so that a checkpoint holds
  the adapter alone (and the optimizer state, which covers only trainable tensors anyway).
* ``merged_model``: base model plus a saved adapter, merged into plain weights (``export-hf``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from posttrain.errors import ConfigError, PosttrainError

if TYPE_CHECKING:
    from posttrain.config.lora import LoraConfig

ADAPTER = "default"
"""The one adapter name posttrain uses (peft's default)."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAINED_MARKERS = (".lora_A.", ".lora_B.", ".modules_to_save.")
"""What marks a peft state-dict name as trained (adapter factors, fully trained copies)."""


def _import_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError(
            ["model.lora.rank > 0 needs peft, which is not installed: pip install 'posttrain[lora]' (or peft)"]
        ) from None
    return peft


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a policy with LoRA adapters (a ``peft.PeftModel``)."""
    peft_config = getattr(model, "peft_config", None)
    return isinstance(peft_config, dict) and ADAPTER in peft_config


def apply_lora(model: Any, cfg: LoraConfig) -> Any:
    """``model`` with ``cfg``'s adapters (a ``PeftModel``, in eval mode), or ``model`` itself when
    LoRA is off. Adapter initialisation draws from the global torch RNG (seeded by the run)."""
    if not cfg.enabled:
        return model
    peft = _import_peft()
    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    lora_config = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        modules_to_save=list(cfg.modules_to_save) or None,
        bias="none",
    )
    try:
        wrapped = peft.get_peft_model(model, lora_config)
    except ValueError as exc:  # e.g. target modules that match nothing in this model
        raise ConfigError([f"model.lora.target_modules={cfg.target_modules}: {exc}"]) from None
    # peft matches modules_to_save by plain suffix and says nothing when one matches no module
    missing = [name for name in cfg.modules_to_save if not any(n.endswith(name) for n, _ in wrapped.named_modules())]
    if missing:
        raise ConfigError(
            [f"model.lora.modules_to_save={cfg.modules_to_save}: no module of the model is named {missing[0]!r}"]
        )
    wrapped.eval()
    return wrapped


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts (the log line of a LoRA run)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


# -- the reference: the policy with its adapter disabled -------------------------------------------


class _AdapterOff(nn.Module):
    """Runs ``inner`` under the policy's ``disable_adapter()``. ``inner`` is held, not registered: the
    reference must never own (or freeze, or move) the policy's parameters."""

    def __init__(self, policy: Any, inner: nn.Module) -> None:
        super().__init__()
        self._refs = (policy, inner)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy, inner = self._refs
        with policy.disable_adapter():
            return inner(*args, **kwargs)


class AdapterDisabledReference(nn.Module):
    """The base model of a LoRA policy as the KL reference: the policy's own body and head, each run
    with the adapter disabled (``modules_to_save`` fall back to their original copies there too).
    ``parameters()`` yields the policy's (what the trainer reads a device or sharding from)."""

    runs_policy = True
    """Read by ``loop/run.py``: this reference is the policy itself (sharded with it); never shard it again."""

    def __init__(self, policy: Any) -> None:
        super().__init__()
        from posttrain.models.structure import split_body_and_head

        body, head = split_body_and_head(policy)
        self._policy = (policy,)
        self._body = _AdapterOff(policy, body)
        self._head = _AdapterOff(policy, head)
        self.config = policy.config

    def get_decoder(self) -> nn.Module:
        return self._body

    def get_output_embeddings(self) -> nn.Module:
        return self._head

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._policy[0].parameters(recurse)

    def disabled(self) -> AbstractContextManager[None]:
        """The context in which the policy computes the reference (for a whole forward of it)."""
        ctx: AbstractContextManager[None] = self._policy[0].disable_adapter()
        return ctx


def adapter_disabled_reference(policy: nn.Module) -> AdapterDisabledReference:
    """The KL reference of the LoRA ``policy``: itself with the adapter disabled (no copy)."""
    if not is_lora(policy):
        raise PosttrainError("adapter_disabled_reference needs a LoRA policy (model.lora.rank > 0)")
    return AdapterDisabledReference(policy)


# -- the adapter's tensors -------------------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor: an FSDP2 shard (DTensor) is gathered (a collective every rank calls in step)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t.detach()


def trained_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained tensors of a LoRA policy under its own state-dict names (adapter factors and
    ``modules_to_save`` copies), whole; the same names on every rank, in the same order."""
    return {k: _full(v) for k, v in model.state_dict().items() if any(m in k for m in TRAINED_MARKERS)}


def peft_file_names(trained: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``trained`` (policy state-dict names) under peft's file names: the adapter name dropped from
    ``lora_A.default.weight``, ``modules_to_save.default.x`` saved as the module's own ``x``."""
    out = {}
    for name, tensor in trained.items():
        if ".modules_to_save." in name:
            out[name.replace(f".modules_to_save.{ADAPTER}.", ".")] = tensor
        else:
            out[name.replace(f".{ADAPTER}.", ".")] = tensor
    return out


def write_adapter(model: Any, out_dir: Path, trained: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Save ``model``'s adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``)
    into ``out_dir``; ``trained``: its tensors when already gathered (``trained_state_dict``)."""
    trained = trained if trained is not None else trained_state_dict(model)
    return write_adapter_files(trained, model.peft_config[ADAPTER], out_dir)


def write_adapter_files(trained: Mapping[str, torch.Tensor], peft_config: Any, out_dir: Path) -> Path:
    """``trained`` (policy state-dict names) and ``peft_config`` (a ``peft.LoraConfig``) in peft's
    format into ``out_dir``: what a rollout replica that holds no peft policy writes (``write_adapter``)."""
    from safetensors.torch import save_file

    tensors = peft_file_names(trained)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out_dir / ADAPTER_WEIGHTS))
    peft_config.save_pretrained(str(out_dir))
    return out_dir


# -- checkpoints -----------------------------------------------------------------------------------


class _AdapterMeta:
    """``config`` of the checkpoint view: the base model's config (attributes read and set go to it)
    whose ``save_pretrained`` also writes the adapter's ``adapter_config.json`` (export-hf reads both).
    A deep copy copies the two configs, never the policy."""

    def __init__(self, base_config: Any, adapter_config: Any) -> None:
        object.__setattr__(self, "_configs", (base_config, adapter_config))

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_configs")[0], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._configs[0], name, value)

    def __deepcopy__(self, memo: dict[int, Any]) -> _AdapterMeta:
        return _AdapterMeta(*(copy.deepcopy(c, memo) for c in self._configs))

    def save_pretrained(self, out_dir: str | Path) -> None:
        for config in self._configs:
            config.save_pretrained(str(out_dir))


class AdapterCheckpoint(nn.Module):
    """The view of a LoRA policy a checkpoint saves and loads: ``state_dict`` holds the trained
    tensors only; ``load_state_dict`` takes exactly those back (names and shapes checked) into the
    policy; ``parameters()`` yields the trainable ones (what the optimizer state covers)."""

    def __init__(self, policy: Any) -> None:
        super().__init__()
        self._policy = (policy,)
        self.config = _AdapterMeta(policy.config, policy.peft_config[ADAPTER])
        self.generation_config = getattr(policy, "generation_config", None)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for p in self._policy[0].parameters(recurse) if p.requires_grad)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return {k: v for k, v in self._policy[0].state_dict().items() if any(m in k for m in TRAINED_MARKERS)}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        own = self.state_dict()
        missing, extra = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        shapes = [k for k in own if k in state_dict and tuple(own[k].shape) != tuple(state_dict[k].shape)]
        if missing or extra or shapes:
            raise RuntimeError(
                f"the adapter checkpoint does not fit this policy's model.lora (missing {missing[:3]}, unexpected "
                f"{extra[:3]}, other shapes {shapes[:3]}): resume with the model.lora settings it was trained with"
            )
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(state_dict[name])
        return None


def checkpoint_module(model: nn.Module) -> nn.Module:
    """What checkpoints save and load for ``model``: the adapter alone (``AdapterCheckpoint``) for a
    LoRA policy in one process; the model itself otherwise. A sharded LoRA policy saves its whole
    state dict (frozen base included), which the sharded writer and reader handle by name."""
    from posttrain.distributed.fsdp import checkpoint_view

    return checkpoint_view(model, AdapterCheckpoint) if is_lora(model) else model


def adapter_policy(adapter_dir: Path, base_model_dir: str | None = None, dtype: Any = None) -> Any:
    """A LoRA policy rebuilt from a saved ``adapter_config.json`` in ``adapter_dir``: the base model
    (``base_model_dir``, else the directory the adapter config names: the one the run trained on)
    with freshly initialised adapters, ready to take a checkpoint's adapter (``checkpoint_module``)."""
    peft = _import_peft()
    from transformers import AutoModelForCausalLM

    base = base_model_dir or adapter_base_dir(adapter_dir)
    if base is None or not (Path(base).expanduser() / "config.json").is_file():
        raise PosttrainError(
            f"{adapter_dir / ADAPTER_CONFIG}: the base model {base!r} it names is not a model directory here; pass "
            "the directory the adapter was trained on as base_model_dir (--base-model-dir)"
        )
    model = AutoModelForCausalLM.from_pretrained(str(Path(base).expanduser()), dtype=dtype, local_files_only=True)
    config = peft.LoraConfig.from_pretrained(str(adapter_dir))
    return peft.get_peft_model(model, config)


def adapter_base_dir(adapter_dir: Path) -> str | None:
    """The base model directory an ``adapter_config.json`` names (the one the policy loaded)."""
    path = adapter_dir / ADAPTER_CONFIG
    if not path.is_file():
        return None
    base = json.loads(path.read_text(encoding="utf-8")).get("base_model_name_or_path")
    return str(base) if base else None
