"""How one pydantic error reads in a config problem line (``loading.format_validation_error``):
pydantic's message with a bound written as Python writes it, a hint where the message alone does not
say what to write, and a value that fits no member of a union as one line, not one per member."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

# errors whose location ends in a key of the config, never in a union member's tag
NOT_UNION_MEMBER_TYPES = frozenset({"extra_forbidden", "no_such_attribute", "missing"})


def merge_union_errors(errors: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Pydantic reports a value that fits no member of a union (``bool | Literal["auto"]``) once per
    member, at the field's location plus the member's tag (``bool``, ``literal['auto']``). Those become
    one error at the field's location: "Input should be a valid boolean or 'auto'". Errors are taken
    for one union's when they share the location but its last part and the input, and some last part
    is not an identifier (a field name always is); any others pass unchanged."""
    runs: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for err in errors:
        loc = tuple(err["loc"])
        member = len(loc) > 1 and isinstance(loc[-1], str) and err["type"] not in NOT_UNION_MEMBER_TYPES
        runs.setdefault((loc[:-1], repr(err.get("input"))) if member else (loc, id(err)), []).append(err)
    out: list[Mapping[str, Any]] = []
    for run in runs.values():
        if len(run) < 2 or all(str(e["loc"][-1]).isidentifier() for e in run):
            out.extend(run)
            continue
        head, parts = "Input should be ", [str(e["msg"]) for e in run]
        if all(p.startswith(head) for p in parts):  # "a valid boolean, unable to interpret input" -> "a valid boolean"
            msg = head + " or ".join(p[len(head) :].split(", ")[0] for p in parts)
        else:
            msg = "; or ".join(parts)
        out.append({"loc": tuple(run[0]["loc"])[:-1], "input": run[0].get("input"), "type": "union", "msg": msg})
    return out


_SEXAGESIMAL = re.compile(r"^[-+]?[0-9]+(?::[0-5]?[0-9])+$")


def value_hint(err: Mapping[str, Any]) -> str:
    """What to write instead, where the error alone does not say."""
    value = err.get("input")
    if err["type"] in ("int_parsing", "float_parsing") and isinstance(value, str) and _SEXAGESIMAL.match(value):
        sign = -1 if value.startswith("-") else 1
        total = 0
        for part in value.lstrip("+-").split(":"):
            total = total * 60 + int(part)
        return f" (override values are YAML 1.2, which reads no base-60 numbers: write {sign * total})"
    if err["type"] == "finite_number":
        return " (no setting takes inf or nan: write a finite number)"
    return ""


_BOUNDS = {
    "greater_than": "greater than",
    "greater_than_equal": "greater than or equal to",
    "less_than": "less than",
    "less_than_equal": "less than or equal to",
}


def error_message(err: Mapping[str, Any]) -> str:
    """Pydantic's message, with a bound written as Python writes it (``1e-30``; pydantic spells
    every digit)."""
    words, ctx = _BOUNDS.get(err["type"]), err.get("ctx") or {}
    bound = next(iter(ctx.values()), None)
    if words is not None and isinstance(bound, int | float):
        return f"Input should be {words} {bound!r}"
    return str(err["msg"])
