"""Recipe loading and dotted overrides.

A recipe is a Python file (or the name of a recipe shipped in ``posttrain.recipes``) defining
``make_config()``. Overrides are ``dotted.key=value`` strings whose values are YAML 1.2 core-schema
values (``config/yaml_values.py``), so ``rl.max_steps=5`` is an int, ``grid.shapes.policy=[1,2]`` a
list, ``rl.data.path=null`` None and ``1:30`` or ``2024-02-30`` plain text. Every problem (unknown
keys, wrong types, out-of-range values, unreadable values, a recipe that raises) is collected and
raised in one ``ConfigError`` naming the key or the recipe file; unknown keys come with the nearest
known keys, or, for a key a config type lacks on purpose (a GRPO knob under OPD), with why
(``RunConfig.unknown_key_hints``).

``--config`` also takes a config file (``.yaml``/``.yml``/``.json``) holding the config tree, the
same tree ``config_resolved.yaml`` holds (whose extra keys, ``RESOLVED_EXTRA_KEYS``, are dropped on
load), so any run's resolved config can be given back. YAML files are read by the override rules
(``yaml_values.parse_document``); the file's ``algorithm`` picks GRPO or OPD, and the wrong command
is refused with the right one. ``resolved_tree`` is what ``config_resolved.yaml`` and
``--print-config`` write.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import re
import sys
import traceback
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar, get_args, overload

from pydantic import BaseModel, ValidationError

from posttrain.config.error_text import error_message, merge_union_errors, value_hint
from posttrain.config.schema import GRPOConfig, RunConfig
from posttrain.config.yaml_values import OverrideValueError, dump_document, parse_document, parse_value
from posttrain.errors import ConfigError

ConfigT = TypeVar("ConfigT", bound=RunConfig)
MAX_KEY_CHARS = 200  # far longer than any dotted key; a longer one is not echoed whole

RECIPES_PACKAGE_DIR = Path(__file__).resolve().parent.parent / "recipes"
# The recipe each command runs without --config, by the config class it builds.
DEFAULT_RECIPES = {"GRPOConfig": "default", "OPDConfig": "opd_direct"}
CONFIG_FILE_SUFFIXES = (".yaml", ".yml", ".json")
"""``--config`` arguments with these suffixes are config trees, not recipes."""
RESOLVED_EXTRA_KEYS = ("resolved", "argv", "provenance")
"""Top-level keys ``config_resolved.yaml`` holds beside the config (derived values, the command line,
the code's provenance); they are not settings, and a config file's are dropped on load."""
COMMANDS = {"GRPOConfig": "posttrain grpo", "OPDConfig": "posttrain opd"}
_RUN_KINDS = {"GRPOConfig": "a GRPO", "OPDConfig": "an OPD"}


def builtin_recipes() -> list[str]:
    """Names of the recipes shipped with posttrain (usable as ``--config NAME``)."""
    return sorted(p.stem for p in RECIPES_PACKAGE_DIR.glob("*.py") if not p.name.startswith("_"))


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False for a name the OS cannot hold (too long, a NUL byte) instead of raising."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def resolve_recipe_path(recipe: str) -> Path:
    """A recipe argument as a file path: an existing file, or a shipped recipe's name."""
    path = Path(recipe)
    if _is_file(path):
        return path
    shipped = RECIPES_PACKAGE_DIR / f"{recipe.removesuffix('.py')}.py"
    if "/" not in recipe and _is_file(shipped):
        return shipped
    raise ConfigError(
        [
            f"--config {shown(recipe)}: no such file, and no shipped recipe of that name "
            f"(shipped: {', '.join(builtin_recipes())})"
        ]
    )


def load_recipe(recipe: str | None, config_type: type[RunConfig] = GRPOConfig) -> RunConfig:
    """Run a recipe's ``make_config()``; ``None`` gives the embedded default recipe (``default`` for
    GRPO, ``opd_direct`` for OPD). The recipe must return exactly ``config_type``: a GRPO recipe given
    to the OPD command (or the reverse) is refused with the command to use instead. Whatever the
    recipe raises (it is user code) becomes a ``ConfigError`` naming the file, the line and the error."""
    if recipe is None:
        recipe = DEFAULT_RECIPES.get(config_type.__name__, "default")
    if Path(recipe).suffix.lower() in CONFIG_FILE_SUFFIXES:
        return load_config_file(recipe, config_type)
    path = resolve_recipe_path(recipe)
    module_name = f"_posttrain_recipe_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError([f"--config {path}: cannot be imported as a Python file"])
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a recipe is user code: report whatever it raised, with the file
        raise ConfigError(
            [f"--config {path}{_recipe_line(path, exc)}: importing the recipe failed: {_exc(exc)}"]
        ) from exc
    make_config = getattr(module, "make_config", None)
    if not callable(make_config):
        raise ConfigError([f"--config {path}: the recipe defines no make_config() function"])
    try:
        config = make_config()
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, config_type)) from exc
    except (Exception, SystemExit) as exc:
        raise ConfigError([_make_config_failed(path, exc, config_type)]) from exc
    if type(config) is not config_type:
        raise ConfigError([_wrong_config_type(path, config, config_type)])
    return config


def read_config_tree(path: Path) -> dict[str, Any]:
    """The config tree a ``.yaml``/``.yml``/``.json`` file holds, without ``RESOLVED_EXTRA_KEYS``; an
    unreadable file, invalid YAML/JSON (with its line) or a non-mapping is a ``ConfigError``."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"--config {path}: cannot be read ({exc})"]) from None
    try:
        tree = _parse_json(text) if path.suffix.lower() == ".json" else parse_document(text)
    except OverrideValueError as exc:
        where = f" line {exc.line}" if exc.line is not None else ""
        raise ConfigError([f"--config {path}{where}: {exc}"]) from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(
            [f"--config {path}: holds a {type(tree).__name__}; a config file is a map of sections (rl:, model:, ...)"]
        )
    return {k: v for k, v in tree.items() if k not in RESOLVED_EXTRA_KEYS}


def _parse_json(text: str) -> Any:
    """JSON text, refusing a key given twice; errors as ``OverrideValueError`` with the line."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise OverrideValueError(f"key {key!r} is given twice; write it once")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise OverrideValueError(f"not valid JSON ({exc.msg})", exc.lineno) from None
    except RecursionError:
        raise OverrideValueError("nested too deeply; write a flatter file") from None


def _algorithms(config_type: type[RunConfig]) -> tuple[object, ...]:
    return get_args(config_type.model_fields["algorithm"].annotation)


def load_config_file(recipe: str, config_type: type[RunConfig] = GRPOConfig) -> RunConfig:
    """A ``config_type`` from a config file's tree (fields it leaves out keep their defaults). A file
    whose ``algorithm`` belongs to the other command is refused naming that command; every invalid
    key or value is reported at once, each naming the file and the dotted key."""
    path = Path(recipe)
    if not _is_file(path):
        raise ConfigError([f"--config {shown(recipe)}: no such file"])
    tree = read_config_tree(path)
    algorithm = tree.get("algorithm")
    if algorithm is not None and algorithm not in _algorithms(config_type):
        from posttrain.config.opd import OPDConfig  # lazily: config/opd.py imports the schema this module does

        for other in (GRPOConfig, OPDConfig):
            if other is not config_type and algorithm in _algorithms(other):
                raise ConfigError(
                    [
                        f"--config {path}: algorithm={algorithm!r} is {_RUN_KINDS[other.__name__]} run, which "
                        f"this command does not train; run it with `{COMMANDS[other.__name__]} --config {path}`"
                    ]
                )
    try:
        return config_type.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError([f"--config {path}: {line}" for line in format_validation_error(exc, config_type)]) from None


def resolved_tree(cfg: RunConfig) -> dict[str, Any]:
    """Every field of ``cfg`` plus, under ``resolved``, the values the loop derives from them: what
    ``config_resolved.yaml`` holds (beside ``argv`` and ``provenance``) and ``--print-config`` prints."""
    tree = cfg.model_dump(mode="json")
    tree["resolved"] = {
        "n_mini": cfg.rl.n_mini,
        "groups_per_step": cfg.rl.groups_per_step,
        "effective_min_informative_groups": cfg.rl.effective_min_informative_groups,
        "data_seed": cfg.data_seed,
        "data_source": cfg.rl.data.kind,
    }
    return tree


def config_yaml(tree: Mapping[str, Any]) -> str:
    """A config tree as YAML that ``--config FILE.yaml`` reads back to the same values."""
    return dump_document(dict(tree))


def _exc(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError) and exc.msg:  # its repr is a tuple of the file's coordinates
        column = f" at column {exc.offset}" if exc.offset else ""
        return shown_text(f"{type(exc).__name__}: {exc.msg}{column}", 300)
    return shown_text(repr(exc), 300)


def _recipe_line(path: Path, exc: BaseException) -> str:
    """`` line N``: the recipe's own line where ``exc`` was raised (its deepest frame in the file),
    or, for a recipe that does not parse, the line the parser names."""
    target = path.resolve()
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno and Path(exc.filename).resolve() == target:
        return f" line {exc.lineno}"
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == target]
    return f" line {lines[-1]}" if lines else ""


_NO_SETTER = re.compile(r"property '(\w+)' of '(\w+)' object has no setter")


def _make_config_failed(path: Path, exc: BaseException, config_type: type[RunConfig]) -> str:
    """What to say when ``make_config()`` raised something other than a validation error."""
    where = f"--config {path}{_recipe_line(path, exc)}"
    match = _NO_SETTER.search(str(exc)) if isinstance(exc, AttributeError) else None
    prefix = _section_prefixes(config_type).get(match.group(2)) if match else None
    if match and prefix is not None:  # a read-only property: a knob this config type lacks on purpose
        return f"{where}: make_config() sets {prefix}{match.group(1)}: " + _unknown_key_message(
            prefix + match.group(1), config_type
        )
    hint = ""
    if isinstance(exc, TypeError) and not _recipe_line(path, exc):
        hint = "; make_config() is called with no arguments"
    return f"{where}: make_config() raised {_exc(exc)}{hint}"


def _wrong_config_type(path: Path, config: object, expected: type[RunConfig]) -> str:
    got = type(config).__name__
    hint = f"; run it with `{COMMANDS[got]}`" if got in COMMANDS else ""
    return f"--config {path}: make_config() returned {got}, expected {expected.__name__}{hint}"


def parse_overrides(items: Iterable[str]) -> list[tuple[str, Any]]:
    """``["rl.max_steps=5", ...]`` -> ``[("rl.max_steps", 5), ...]`` with YAML 1.2 core-schema values;
    an unreadable value is a problem naming the key, the value and what to write instead."""
    parsed, problems = _parse_each(items)
    if problems:
        raise ConfigError(problems)
    return parsed


def _parse_each(items: Iterable[str]) -> tuple[list[tuple[str, Any]], list[str]]:
    """The overrides that parse, and a problem for each one that does not."""
    parsed: list[tuple[str, Any]] = []
    problems: list[str] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"override {shown(item)} is not of the form dotted.key=value")
            continue
        if len(key) > MAX_KEY_CHARS:
            problems.append(
                f"override key {shown_text(key, 60)} ({len(key)} characters) is not a config key: keys are "
                "dotted names such as rl.max_steps"
            )
            continue
        try:
            value = parse_value(raw) if raw.strip() else ""
        except OverrideValueError as exc:
            problems.append(f"override {key}={shown(raw)}: {exc}")
            continue
        parsed.append((key, value))
    return parsed, problems


def shown_text(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def shown(value: object, limit: int = 80) -> str:
    """A value for an error message: its repr, shortened (a 5000-digit integer cannot even be
    printed: Python refuses int-to-text conversions past 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"<an integer of {math.floor(math.log10(abs(value))) + 1} digits>"
    try:
        text = repr(value)
    except ValueError:
        return f"<a {type(value).__name__} too large to show>"
    return shown_text(text, limit)


def known_keys(model: type[BaseModel] = GRPOConfig, prefix: str = "") -> list[str]:
    """Every dotted key a config accepts, sections included."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.extend(known_keys(annotation, dotted + "."))
    return keys


def _unknown_key_message(key: str, model: type[BaseModel] = GRPOConfig) -> str:
    hint = _key_hint(key, model)
    if hint is not None:
        return f"unknown key {key!r}: {hint}"
    keys = known_keys(model)
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    if not close:
        # also match on the last component, so `rl.grupsize` and `grupsize` both find rl.group_size
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in keys if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.75)]
    hint = f"; did you mean {', '.join(close[:3])}?" if close else ""
    return f"unknown key {key!r}{hint}"


def _key_hint(key: str, model: type[BaseModel]) -> str | None:
    """Why ``model`` lacks ``key`` when its ``unknown_key_hints`` says (OPD: the GRPO knobs it has
    not); a hint for a section covers every key under it."""
    hints: Mapping[str, str] = getattr(model, "unknown_key_hints", {})
    for prefix, hint in hints.items():
        if key == prefix or key.startswith(prefix + "."):
            return hint.format(key=key)
    return None


def _set_dotted(tree: dict[str, Any], key: str) -> tuple[dict[str, Any], str] | None:
    """The dict that holds ``key``'s last component, or None if a section on the way is unknown."""
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None and part in node:
            child = node[part] = {}
        if not isinstance(child, dict):
            return None
        node = child
    if parts[-1] not in node:
        return None
    return node, parts[-1]


def apply_overrides(config: ConfigT, overrides: list[tuple[str, Any]]) -> ConfigT:
    """A new config with the overrides applied; every unknown key or invalid value is reported."""
    tree = config.model_dump(mode="python")
    problems: list[str] = []
    for key, value in overrides:
        slot = _set_dotted(tree, key)
        if slot is None:
            problems.append(_unknown_key_message(key, type(config)))
            continue
        node, leaf = slot
        node[leaf] = value
    try:
        validated = type(config).model_validate(tree)
    except ValidationError as exc:
        problems.extend(format_validation_error(exc, type(config)))
    if problems:
        raise ConfigError(problems)
    return validated


def _section_prefixes(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """Each section class of ``model``'s tree by name -> its dotted prefix (``"OptimizerConfig"`` ->
    ``"rl.optimizer."``): an error raised while a recipe assigns a field names only the field."""
    found = {model.__name__: prefix}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            for title, dotted in _section_prefixes(annotation, f"{prefix}{name}.").items():
                found.setdefault(title, dotted)
    return found


def format_validation_error(exc: ValidationError, model: type[BaseModel] = GRPOConfig) -> list[str]:
    """Pydantic errors as ``field=value: what is wrong`` lines, with the full dotted key also when a
    recipe assigned one field of a section (the error then names only the field)."""
    prefix = _section_prefixes(model).get(exc.title, "")
    lines = []
    short: dict[str, tuple[int, Any, list[int]]] = {}  # tuple key -> (its line, value, missing positions)
    for err in merge_union_errors(exc.errors()):
        loc = prefix + ".".join(str(part) for part in err["loc"])
        if err["type"] in ("extra_forbidden", "no_such_attribute"):
            lines.append(_unknown_key_message(loc, model))
            continue
        value = err.get("input")
        if err["type"] == "missing" and err["loc"] and isinstance(err["loc"][-1], int):
            # a fixed-length tuple given too few values: pydantic names each missing index as a field
            key = loc.rsplit(".", 1)[0]
            if key not in short:
                short[key] = (len(lines), value, [])
                lines.append("")
            short[key][2].append(err["loc"][-1])
            continue
        value_text = "{...}" if isinstance(value, dict) else shown(value)
        lines.append(f"{loc}={value_text}: {error_message(err)}{value_hint(err)}")
    for key, (line, value, missing) in short.items():
        where = f"position{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        lines[line] = f"{key}={shown(value)}: too few values (none at {where}, counting from 0)"
    return lines


@overload
def build_config(recipe: str | None, override_items: Iterable[str] = ()) -> GRPOConfig: ...
@overload
def build_config(recipe: str | None, override_items: Iterable[str], config_type: type[ConfigT]) -> ConfigT: ...
def build_config(
    recipe: str | None, override_items: Iterable[str] = (), config_type: type[RunConfig] = GRPOConfig
) -> RunConfig:
    """The recipe with its overrides applied (not yet cross-validated: see ``posttrain.preflight``);
    a ``GRPOConfig`` unless ``config_type`` says otherwise. Every unreadable and every invalid
    override is reported in one ``ConfigError``."""
    config = load_recipe(recipe, config_type)
    overrides, problems = _parse_each(override_items)
    if overrides:
        try:
            config = apply_overrides(config, overrides)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems)
    return config


def build_config_best_effort(
    recipe: str | None, override_items: Iterable[str], config_type: type[RunConfig] = GRPOConfig
) -> RunConfig | None:
    """The recipe with every override that is valid on its own applied, skipping the rest.

    ``--validate-manifest`` uses it after an invalid override so that the model-free checks still
    run on everything else and every problem is reported in one pass.
    """
    try:
        config = load_recipe(recipe, config_type)
    except ConfigError:
        return None
    overrides, _unreadable = _parse_each(override_items)
    for item in overrides:
        try:
            config = apply_overrides(config, [item])
        except ConfigError:
            continue
    return config
