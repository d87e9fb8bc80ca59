"""Resolve ``model.*`` settings into a loaded model and tokenizer, without ever touching the network.

``model.name_or_path`` is either ``embedded:<name>`` (converted once and cached, see
``posttrain.models.embedded``) or a local Hugging Face directory holding ``config.json``. Hub ids
are refused on purpose: a run must not depend on a download. torch and transformers are imported
inside the functions so that resolving a path stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.errors import ConfigError
from posttrain.models.embedded import embedded_model_dir, known_embedded_models

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from posttrain.config.schema import ModelConfig

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_DTYPES |= {"float16": "float16", "fp16": "float16"}


def resolve_model_path(name_or_path: str) -> str:
    """A local directory for ``name_or_path``: ``embedded:...`` is converted/cached, a path must be a
    directory holding ``config.json``."""
    if name_or_path.startswith("embedded:"):
        return embedded_model_dir(name_or_path)
    path = Path(name_or_path).expanduser()
    hint = (
        "posttrain never downloads from the Hugging Face Hub: pass a local model directory (one written by "
        f"save_pretrained, or `hf download ID --local-dir DIR`) or one of {', '.join(known_embedded_models())}"
    )
    if not path.exists():
        raise ConfigError([f"model.name_or_path: {name_or_path!r} does not exist; {hint}"])
    if not path.is_dir():
        raise ConfigError([f"model.name_or_path: {name_or_path!r} is a file, not a model directory; {hint}"])
    if not (path / "config.json").is_file():
        raise ConfigError(
            [f"model.name_or_path: {name_or_path!r} holds no config.json, so it is not a Hugging Face model directory"]
        )
    return str(path.resolve())


def local_model_dir(name_or_path: str) -> Path | None:
    """The local directory ``name_or_path`` names, found without converting, downloading or loading
    anything (for the preflight); None for an embedded model not converted on this machine yet, or a
    path that is not a readable directory."""
    try:
        if name_or_path.startswith("embedded:"):
            from posttrain.models import embedded

            spec = embedded._EMBEDDED.get(name_or_path)
            if spec is None:
                return None
            target = embedded.default_cache_root() / "models" / spec.cache_name
            return target if embedded._has_complete_cache(target) else None
        path = Path(name_or_path).expanduser()
        return path if path.is_dir() else None
    except (OSError, ValueError, RuntimeError):  # too long, a NUL byte, ~unknownuser: not a directory
        return None


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when a GPU is visible, else the CPU; asking for CUDA without one fails."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError([f"model.device: {device!r} but no CUDA device is visible; use 'auto' or 'cpu'"])
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bf16 on CUDA and fp32 elsewhere (CPU bf16 matmuls are slow and lossy)."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError([f"model.dtype: unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16"])
    resolved: torch.dtype = getattr(torch, _DTYPES[dtype])
    return resolved


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a resolved model directory, with a pad token (the EOS token when it has none).
    Padding side is left to callers (the rollout pads on the left, the trainer on the right)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError([f"model.name_or_path: the tokenizer in {path} has neither a pad nor an EOS token"])
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_and_tokenizer(model_cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the model on ``model.device`` in ``model.dtype`` (eval mode) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model_cfg.name_or_path)
    device = resolve_device(model_cfg.device)
    dtype = resolve_dtype(model_cfg.dtype, device)
    tokenizer = load_tokenizer(path)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.to(device)
    model.eval()
    if model_cfg.gradient_checkpointing:
        # Non-reentrant checkpointing works with inputs that do not require grad (frozen embeddings).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer
