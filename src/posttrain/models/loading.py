"""Resolve ``model.*`` settings into a loaded model and tokenizer.

``model.name_or_path`` (and ``rl.ref.model_dir``, ``rl.teacher.name_or_path``) is one of, in this
order:

1. ``embedded:<name>``: the embedded model, converted once and cached (``posttrain.models.embedded``);
2. a local Hugging Face directory holding ``config.json``. A path that exists always wins, so a
   relative directory ``org/name`` in the working directory is loaded as that directory, never
   looked up on the hub;
3. a hub id ``org/name`` (exactly one slash, hub characters), at ``model.revision`` (a branch, tag
   or commit; null is main): the snapshot directory of the standard Hugging Face cache
   (``HF_HUB_CACHE`` / ``HF_HOME``), downloaded first when missing, or, under ``HF_HUB_OFFLINE=1``,
   the cache only (``posttrain.models.hub``).

``resolve_model_path`` is the one place a name becomes a directory: the trainer, the reference, the
teacher, the vLLM engines and the resume anchor all load the directory it returns. torch and
transformers are imported inside the functions so that resolving a path stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.errors import ConfigError
from posttrain.models.cpu_attention import use_grouped_sdpa_on_cpu
from posttrain.models.embedded import embedded_model_dir, known_embedded_models
from posttrain.models.hub import cached_snapshot, is_hub_id, resolve_hub_model, revision_key
from posttrain.models.precision import resolve_precision

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from posttrain.config.schema import ModelConfig

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_DTYPES |= {"float16": "float16", "fp16": "float16"}


def resolve_model_path(name_or_path: str, revision: str | None = None, *, key: str = "model.name_or_path") -> str:
    """A local directory for ``name_or_path`` (see the module docstring for the order): ``embedded:...``
    is converted/cached, an existing path must be a directory holding ``config.json``, a hub id is
    found in (or downloaded into) the Hugging Face cache at ``revision``. ``key`` names the setting
    in errors (``model.name_or_path``, ``rl.ref.model_dir``, ``rl.teacher.name_or_path``)."""
    if name_or_path.startswith("embedded:"):
        _no_revision(key, name_or_path, revision)
        return embedded_model_dir(name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.exists() and is_hub_id(name_or_path):
        path = Path(resolve_hub_model(name_or_path, revision, key=key))
        where = f"{key}={name_or_path}: its snapshot {path}"
    else:
        _no_revision(key, name_or_path, revision)
        where = f"{key}: {name_or_path!r}"
    hint = (
        "pass a local model directory (one written by save_pretrained), a Hugging Face hub id (org/name), "
        f"or one of {', '.join(known_embedded_models())}"
    )
    if not path.exists():
        raise ConfigError([f"{where} does not exist; {hint}"])
    if not path.is_dir():
        raise ConfigError([f"{where} is a file, not a model directory; {hint}"])
    if not (path / "config.json").is_file():
        raise ConfigError([f"{where} holds no config.json, so it is not a Hugging Face model directory"])
    return str(path.resolve())


def _no_revision(key: str, name_or_path: str, revision: str | None) -> None:
    """A revision pins a hub id only: with a local or embedded model it would silently do nothing."""
    if revision is not None:
        raise ConfigError(
            [
                f"{revision_key(key)}={revision} applies to hub ids (org/name) only, but {key}={name_or_path} is "
                f"{'an embedded model' if name_or_path.startswith('embedded:') else 'a local path'}; "
                f"unset {revision_key(key)}"
            ]
        )


def local_model_dir(name_or_path: str, revision: str | None = None) -> Path | None:
    """The local directory ``name_or_path`` names, found without converting, downloading or loading
    anything (for the preflight); None for an embedded model not converted on this machine yet, a
    hub id not in the cache at ``revision``, or a path that is not a readable directory."""
    try:
        if name_or_path.startswith("embedded:"):
            from posttrain.models import embedded

            spec = embedded._EMBEDDED.get(name_or_path)
            if spec is None:
                return None
            target = embedded.default_cache_root() / "models" / spec.cache_name
            return target if embedded._has_complete_cache(target) else None
        path = Path(name_or_path).expanduser()
        if not path.exists() and is_hub_id(name_or_path):
            return cached_snapshot(name_or_path, revision)
        return path if path.is_dir() else None
    except (OSError, ValueError, RuntimeError):  # too long, a NUL byte, ~unknownuser: not a directory
        return None


def local_model_config(name_or_path: str, revision: str | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The ``config.json`` path and contents of the local directory ``name_or_path`` names
    (``local_model_dir``), read as JSON only, for the preflight; None when there is no such directory
    or its config.json is missing, unreadable or not a JSON object (``check_model_path`` names those)."""
    import json

    model_dir = local_model_dir(name_or_path, revision)
    if model_dir is None:
        return None
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return (path, config) if isinstance(config, dict) else None


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
    """A dtype name; ``auto`` is the device's compute dtype: bf16 on CUDA and fp32 elsewhere (CPU bf16
    matmuls are slow and lossy). The policy's parameter dtype is ``resolve_precision``'s."""
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


def load_model_and_tokenizer(
    model_cfg: ModelConfig, *, key: str = "model.name_or_path"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the model ``model.name_or_path`` at ``model.revision`` names on ``model.device`` with its
    parameters in ``model.dtype`` (``auto``: fp32, the master weights of mixed precision; see
    ``models/precision.py``) in eval mode, and its tokenizer; ``key`` names the setting in errors."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from posttrain.models.vision import vision_model_type

    path = resolve_model_path(model_cfg.name_or_path, model_cfg.revision, key=key)
    device = resolve_device(model_cfg.device)
    dtype = resolve_precision(model_cfg.dtype, model_cfg.compute_dtype, device).param_dtype
    tokenizer = load_tokenizer(path)
    # A vision-language directory (config.json with a vision_config, Qwen3-VL) loads with its vision
    # tower; AutoModelForCausalLM would build the text decoder alone (docs/multimodal.md).
    auto = AutoModelForImageTextToText if vision_model_type(path) is not None else AutoModelForCausalLM
    model: Any = auto.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.to(device)
    model.eval()
    use_grouped_sdpa_on_cpu()  # no key/value copies per attention call on a CPU (models/cpu_attention.py)
    if model_cfg.gradient_checkpointing:
        # Non-reentrant checkpointing works with inputs that do not require grad (frozen embeddings).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer
