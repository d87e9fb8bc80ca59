"""Hugging Face hub ids (``org/name``) as model names: found in the standard hub cache, or downloaded.

A hub id resolves to the snapshot directory huggingface_hub keeps for it
(``<cache>/models--org--name/snapshots/<commit>/``), so every consumer (transformers, vLLM, the
tokenizer, the reference anchor hash) reads one plain local directory. The cache is the one
huggingface_hub uses (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``) and
``HF_HUB_OFFLINE=1`` restricts resolution to it. Both are read when a name is resolved, not when
huggingface_hub is imported, so a test or a launcher that sets them late is still obeyed.

Nothing here imports torch; huggingface_hub itself is imported only when a hub id is resolved
(the preflight stays light).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from posttrain.errors import ConfigError

# ``org/name`` exactly: the characters the hub allows in each part, neither part starting with a dot
# (``./x`` and ``../x`` are relative paths). One slash only: ``a/b/c`` can only be a path.
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
_TRUE = {"1", "on", "yes", "true"}
# Formats no consumer here reads; skipping them keeps a download to what transformers/vLLM load.
_IGNORED_FILES = ["*.gguf", "*.onnx", "*.onnx_data", "*.msgpack", "*.h5", "*.tflite", "*.ot", "onnx/*", "original/*"]


class HubModelNotCachedError(ConfigError):
    """A hub id (at a revision) that is not in the Hugging Face cache and cannot be downloaded now
    (``HF_HUB_OFFLINE=1``, or the hub did not answer). The message names the cache it looked in and
    how to fetch the model."""

    def __init__(self, key: str, repo_id: str, revision: str | None, *, offline: bool) -> None:
        self.repo_id, self.revision, self.cache_dir = repo_id, revision, hub_cache_dir()
        super().__init__([not_cached_message(key, repo_id, revision, offline=offline)])


def is_hub_id(value: str) -> bool:
    """Whether ``value`` has the shape of a hub id (``org/name``). Shape only: a local directory of
    that name wins over the hub (``resolve_model_path`` checks the file system first)."""
    return bool(_HUB_ID_RE.match(value)) and ".." not in value and "--" not in value


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` is set to a true value (1, on, yes, true): only the cache is used."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub uses: ``HF_HUB_CACHE`` (or the older ``HUGGINGFACE_HUB_CACHE``),
    else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def revision_key(key: str) -> str:
    """The revision knob beside a model key: ``model.name_or_path`` -> ``model.revision``,
    ``rl.ref.model_dir`` -> ``rl.ref.revision``, ``rl.teacher.name_or_path`` -> ``rl.teacher.revision``."""
    return f"{key.rpartition('.')[0]}.revision" if "." in key else "revision"


def _named(key: str, repo_id: str, revision: str | None) -> str:
    at = f" at {revision_key(key)}={revision}" if revision is not None else " (revision main)"
    return f"{key}={repo_id}{at}"


def not_cached_message(key: str, repo_id: str, revision: str | None, *, offline: bool) -> str:
    """Why a hub id cannot be used now, where it was looked for, and how to fetch it."""
    rev = f" --revision {revision}" if revision is not None else ""
    why = "HF_HUB_OFFLINE is set, so only the cache is read" if offline else "the hub could not be reached"
    fix = f"`hf download {repo_id}{rev}` (older huggingface_hub: `huggingface-cli download {repo_id}{rev}`)"
    fix += " on a machine with a network and the same HF_HOME/HF_HUB_CACHE"
    if offline:
        fix += ", or unset HF_HUB_OFFLINE to let the run download it"
    return (
        f"{_named(key, repo_id, revision)}: not a local directory, and not in the Hugging Face cache "
        f"{hub_cache_dir()} ({why}); fetch it with {fix}"
    )


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot directory of ``repo_id`` at ``revision`` (a branch, tag or commit; None is
    main) holding a ``config.json``, or None. Reads the cache only: never touches the network."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache_dir(), revision=revision)
    except (ValueError, OSError):  # HFValidationError (a ValueError): not a valid id or revision
        return None
    return Path(found).parent if isinstance(found, str) else None


def resolve_hub_model(repo_id: str, revision: str | None = None, *, key: str = "model.name_or_path") -> str:
    """The local snapshot directory of ``repo_id`` at ``revision``: from the cache under
    ``HF_HUB_OFFLINE=1``, else through ``snapshot_download`` (which checks the hub for the newest
    commit of the revision, downloads what is missing with its progress bar, and falls back to the
    cache when the hub cannot be reached). Errors name ``key`` and the revision."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline()
    named = _named(key, repo_id, revision)
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=hub_cache_dir(),
            local_files_only=offline,
            ignore_patterns=None if offline else _IGNORED_FILES,
        )
    except LocalEntryNotFoundError:
        raise HubModelNotCachedError(key, repo_id, revision, offline=offline) from None
    except GatedRepoError:
        raise ConfigError(
            [f"{named}: the repository is gated; accept its terms on huggingface.co and log in (`hf auth login`)"]
        ) from None
    except RevisionNotFoundError:
        raise ConfigError([f"{named}: the hub has no such revision; name a branch, tag or commit of it"]) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            [f"{named}: no such model on the hub (or it is private: log in with `hf auth login`)"]
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ConfigError([f"{named}: downloading it failed: {exc}"]) from None
    return str(path)
