"""Override values (``-- key=value``) read as YAML 1.2 core-schema values, within limits.

PyYAML implements YAML 1.1, whose implicit types surprise on a command line: ``1:30`` is the base-60
number 90, ``010`` is octal 8, ``2024-02-30`` a timestamp (and an invalid date raises a bare
``ValueError``), ``yes`` a bool; explicit tags (``!!int x``, ``!!bool maybe``) reach constructors that
raise ``ValueError``/``KeyError``, a 5000-digit integer trips Python's int-conversion limit and 1100
nested ``[`` exhaust the composer's recursion. ``CoreSchemaLoader`` is a ``yaml.SafeLoader`` with the
YAML 1.2 core schema's implicit resolvers only (null, bool, int in base 10/8/16, float with
``.inf``/``.nan``; everything else is a string) and refuses what an override never needs: tags,
anchors and aliases, nesting deeper than ``MAX_DEPTH``, integers longer than ``MAX_INT_DIGITS``,
values longer than ``MAX_VALUE_CHARS``. ``parse_value`` raises only ``OverrideValueError``, whose message
says what to write instead (``config/loading.py`` adds the key). ``parse_document`` reads a whole
config file (``--config run.yaml``) by the same rules, minus the length limit, refusing duplicate
keys; its errors carry the line (``OverrideValueError.line``).
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

MAX_VALUE_CHARS = 65536
"""Longest override value; longer text (a system prompt, say) belongs in a recipe."""
MAX_DEPTH = 32
"""Deepest nesting of flow lists and maps; a config is at most a few sections deep."""
MAX_INT_DIGITS = 32
"""Longest integer literal: far above any signed 64-bit value (19 digits), far below Python's
4300-digit conversion limit."""


class OverrideValueError(ValueError):
    """An override value that is not read; the message says why and what to write instead. ``line``:
    the 1-based line of a config file where it was found, when known."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


def _line(node_or_event: Any) -> int | None:
    mark = getattr(node_or_event, "start_mark", None)
    return None if mark is None else int(mark.line) + 1


def _tag_shown(tag: str) -> str:
    return tag.replace("tag:yaml.org,2002:", "!!")


class CoreSchemaLoader(yaml.SafeLoader):
    """``SafeLoader`` with YAML 1.2 core-schema resolvers and no tags, anchors or deep nesting."""

    # Only the resolvers added below: SafeLoader's YAML 1.1 set (timestamps, base 60, yes/no, merge
    # keys, ``=``) would be copied on the first add_implicit_resolver otherwise.
    yaml_implicit_resolvers: dict[Any, Any] = {}  # noqa: RUF012 - PyYAML's class-level registry

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        """Refuse anchors, aliases and tags before composing a node, and bound the nesting (the
        composer recurses once per level)."""
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise OverrideValueError(
                "anchors and aliases (& and *) are not read; quote the value ('*x') to pass it as text", _line(event)
            )
        tag = getattr(event, "tag", None)
        if tag is not None:
            raise OverrideValueError(
                f"tag {_tag_shown(tag)!r}: tags are not read (the value's own form gives its type); write the "
                "value plainly (5, 0.5, true, null, [1, 2]), or quote it ('...') to pass it as text",
                _line(event),
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise OverrideValueError(
                    f"lists and maps nested deeper than {MAX_DEPTH} levels; write a flatter value", _line(event)
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        """A map, refusing a key given twice (YAML 1.2 requires unique keys; PyYAML keeps the last)."""
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, list | dict):
                continue  # unhashable: PyYAML's own error follows (not valid YAML)
            if key in seen:
                raise OverrideValueError(f"key {key!r} is given twice; write it once", _line(key_node))
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _construct_int(loader: CoreSchemaLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    digits = text.lstrip("+-")
    if len(digits) > MAX_INT_DIGITS:
        raise OverrideValueError(
            f"an integer of {len(digits)} digits: every integer setting is a signed 64-bit integer (at most 19 "
            "digits); write a smaller number",
            _line(node),
        )
    if digits.startswith(("0o", "0x")):  # the core schema's octal and hex forms carry no sign
        return int(digits[2:], 8 if digits[1] == "o" else 16)
    return int(text, 10)  # YAML 1.2: a leading 0 is decimal, not octal


def _construct_float(loader: CoreSchemaLoader, node: yaml.ScalarNode) -> float:
    text = str(loader.construct_scalar(node))
    lowered = text.lower()
    if lowered.endswith(".inf"):
        return -math.inf if text.startswith("-") else math.inf
    if lowered == ".nan":
        return math.nan
    return float(text)


# The YAML 1.2 core schema (spec 1.2.2, section 10.3.2). Int before float: both match "5".
_CORE_RESOLVERS = [
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", list("-+0123456789")),
    (
        "tag:yaml.org,2002:float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        list("-+0123456789."),
    ),
]
for _tag, _pattern, _first in _CORE_RESOLVERS:
    CoreSchemaLoader.add_implicit_resolver(_tag, re.compile(_pattern), _first)
CoreSchemaLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
CoreSchemaLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)

_VALID_FORMS = "a number, true/false, null, text, [a, b] or {k: v}"


def parse_value(raw: str) -> Any:
    """``raw`` as a YAML 1.2 core-schema value; anything refused raises ``OverrideValueError``."""
    if len(raw) > MAX_VALUE_CHARS:
        raise OverrideValueError(
            f"{len(raw)} characters: an override value holds at most {MAX_VALUE_CHARS}; write long text in a recipe"
        )
    try:
        return yaml.load(raw, Loader=CoreSchemaLoader)  # a SafeLoader subclass: no arbitrary objects
    except OverrideValueError:
        raise
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0][:200] or type(exc).__name__
        raise OverrideValueError(
            f"not valid YAML ({problem}); write {_VALID_FORMS}, or quote it ('...') to pass it as text"
        ) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # a constructor's own error
        raise OverrideValueError(
            f"cannot be read ({type(exc).__name__}: {exc}); write {_VALID_FORMS}, or quote it ('...') for text"
        ) from None


def parse_document(text: str) -> Any:
    """A whole YAML config file by the override rules (no length limit; duplicate keys refused);
    raises ``OverrideValueError`` with ``line`` set where the problem is located."""
    try:
        return yaml.load(text, Loader=CoreSchemaLoader)
    except OverrideValueError:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0][:200] or type(exc).__name__
        line = None if mark is None else int(mark.line) + 1
        raise OverrideValueError(f"not valid YAML ({problem})", line) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise OverrideValueError(f"cannot be read ({type(exc).__name__}: {exc})") from None


class CoreSchemaDumper(yaml.SafeDumper):
    """``SafeDumper`` quoting by the YAML 1.2 core schema: a string that ``CoreSchemaLoader`` would read
    as something else (``0o17``, ``1e5``, ``null``) is quoted, so every dumped value reads back as itself."""

    yaml_implicit_resolvers: dict[Any, Any] = {}  # noqa: RUF012 - PyYAML's class-level registry


for _tag, _pattern, _first in _CORE_RESOLVERS:
    CoreSchemaDumper.add_implicit_resolver(_tag, re.compile(_pattern), _first)


def dump_document(tree: Any) -> str:
    """``tree`` as YAML text that ``parse_document`` reads back to an equal tree (keys in order)."""
    return yaml.dump(tree, Dumper=CoreSchemaDumper, sort_keys=False, allow_unicode=True)
