"""Recipe loading and dotted overrides.

A recipe is a Python file (or the name of a recipe shipped in ``posttrain.recipes``) defining
``make_config()``. Overrides are ``dotted.key=value`` strings whose values are parsed as YAML, so
``rl.max_steps=5`` is an int, ``grid.shapes.policy=[1,2]`` a list and ``rl.data.path=null`` None.
Every problem (unknown keys, wrong types, out-of-range values) is collected and raised together in
one ``ConfigError``; unknown keys come with the nearest known keys.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from posttrain.config.schema import GRPOConfig
from posttrain.errors import ConfigError


class _OverrideLoader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-5`` as a string; users mean a float, as in YAML 1.2."""


_OverrideLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."),
)

RECIPES_PACKAGE_DIR = Path(__file__).resolve().parent.parent / "recipes"
# The recipe each command runs without --config, by the config class it builds.
DEFAULT_RECIPES = {"GRPOConfig": "default", "OPDConfig": "opd_direct"}


def builtin_recipes() -> list[str]:
    """Names of the recipes shipped with posttrain (usable as ``--config NAME``)."""
    return sorted(p.stem for p in RECIPES_PACKAGE_DIR.glob("*.py") if not p.name.startswith("_"))


def resolve_recipe_path(recipe: str) -> Path:
    """A recipe argument as a file path: an existing file, or a shipped recipe's name."""
    path = Path(recipe)
    if path.is_file():
        return path
    shipped = RECIPES_PACKAGE_DIR / f"{recipe.removesuffix('.py')}.py"
    if shipped.is_file() and "/" not in recipe:
        return shipped
    raise ConfigError(
        [
            f"--config {recipe}: no such file, and no shipped recipe of that name "
            f"(shipped: {', '.join(builtin_recipes())})"
        ]
    )


def load_recipe(recipe: str | None, config_type: type[GRPOConfig] = GRPOConfig) -> GRPOConfig:
    """Run a recipe's ``make_config()``; ``None`` gives the embedded default recipe (``default`` for
    GRPO, ``opd_direct`` for OPD). The recipe must return exactly ``config_type``: a GRPO recipe given
    to the OPD command (or the reverse) is refused with the command to use instead."""
    if recipe is None:
        recipe = DEFAULT_RECIPES.get(config_type.__name__, "default")
    path = resolve_recipe_path(recipe)
    module_name = f"_posttrain_recipe_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError([f"--config {path}: cannot be imported as a Python file"])
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # a recipe is user code: report whatever it raised, with the file
        raise ConfigError([f"--config {path}: importing the recipe failed: {exc!r}"]) from exc
    make_config = getattr(module, "make_config", None)
    if not callable(make_config):
        raise ConfigError([f"--config {path}: the recipe defines no make_config() function"])
    try:
        config = make_config()
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from exc
    if type(config) is not config_type:
        raise ConfigError([_wrong_config_type(path, config, config_type)])
    return config


def _wrong_config_type(path: Path, config: object, expected: type[GRPOConfig]) -> str:
    got = type(config).__name__
    commands = {"GRPOConfig": "posttrain grpo", "OPDConfig": "posttrain opd"}
    hint = f"; run it with `{commands[got]}`" if got in commands else ""
    return f"--config {path}: make_config() returned {got}, expected {expected.__name__}{hint}"


def parse_overrides(items: Iterable[str]) -> list[tuple[str, Any]]:
    """``["rl.max_steps=5", ...]`` -> ``[("rl.max_steps", 5), ...]`` with YAML-typed values."""
    parsed: list[tuple[str, Any]] = []
    problems: list[str] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"override {item!r} is not of the form dotted.key=value")
            continue
        try:
            value = yaml.load(raw, Loader=_OverrideLoader) if raw.strip() else ""
        except yaml.YAMLError as exc:
            problems.append(f"override {key}: value {raw!r} is not valid YAML ({exc.__class__.__name__})")
            continue
        parsed.append((key, value))
    if problems:
        raise ConfigError(problems)
    return parsed


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
    keys = known_keys(model)
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    if not close:
        # also match on the last component, so `rl.grupsize` and `grupsize` both find rl.group_size
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in keys if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.75)]
    hint = f"; did you mean {', '.join(close[:3])}?" if close else ""
    return f"unknown key {key!r}{hint}"


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


def apply_overrides(config: GRPOConfig, overrides: list[tuple[str, Any]]) -> GRPOConfig:
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


def format_validation_error(exc: ValidationError, model: type[BaseModel] = GRPOConfig) -> list[str]:
    """Pydantic errors as ``field=value: what is wrong`` lines."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(_unknown_key_message(loc, model))
            continue
        value = err.get("input")
        shown = value if not isinstance(value, dict) else "{...}"
        lines.append(f"{loc}={shown!r}: {err['msg']}")
    return lines


def build_config(
    recipe: str | None, override_items: Iterable[str] = (), config_type: type[GRPOConfig] = GRPOConfig
) -> GRPOConfig:
    """The recipe with its overrides applied (not yet cross-validated: see ``validate``)."""
    config = load_recipe(recipe, config_type)
    overrides = parse_overrides(override_items)
    return apply_overrides(config, overrides) if overrides else config


def build_config_best_effort(
    recipe: str | None, override_items: Iterable[str], config_type: type[GRPOConfig] = GRPOConfig
) -> GRPOConfig | None:
    """The recipe with every override that is valid on its own applied, skipping the rest.

    ``--validate-manifest`` uses it after an invalid override so that the model-free checks still
    run on everything else and every problem is reported in one pass.
    """
    try:
        config = load_recipe(recipe, config_type)
        overrides = parse_overrides(override_items)
    except ConfigError:
        return None
    for item in overrides:
        try:
            config = apply_overrides(config, [item])
        except ConfigError:
            continue
    return config
