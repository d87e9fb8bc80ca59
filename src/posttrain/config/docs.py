"""Render the configuration reference (docs/config.md) from the config models themselves.

``python -m posttrain.config.docs > docs/config.md`` regenerates the page; a test fails when the
committed page and the models disagree, so the reference cannot drift from the code.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from posttrain.config.schema import GRPOConfig

HEADER = """# Configuration reference

Generated from `posttrain.config.schema` by `python -m posttrain.config.docs`; do not edit by hand.
Every key can be set in a recipe's `make_config()` or overridden after `--` on the command line
(`posttrain grpo -- rl.max_steps=5`). Values after `--` are YAML: `null`, `true`, `[1,2]`, `1e-5`.
"""


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value)}`"


def _type(field: Any) -> str:
    text = str(field.annotation).replace("typing.", "").replace("NoneType", "None")
    return text.replace("<class '", "").replace("'>", "").replace("|", "\\|")


def _row(key: str, field: Any) -> str:
    """One key's table row: name, type, default and its docstring on one line."""
    doc = " ".join((field.description or "").split()).replace("|", "\\|")
    return f"| `{key}` | {_type(field)} | {_default(field)} | {doc} |"


def _section(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    rows = []
    subsections = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            subsections.append((f"{prefix}{name}", ann))
            continue
        rows.append(_row(f"{prefix}{name}", field))
    if rows:
        title = prefix.rstrip(".") or "top level"
        out.append(f"\n## `{title}`\n")
        if model.__doc__:
            out.append(" ".join(model.__doc__.split()) + "\n")
        out.append("| key | type | default | meaning |\n| --- | --- | --- | --- |")
        out.extend(rows)
    for sub_prefix, sub_model in subsections:
        _section(sub_model, sub_prefix + ".", out)


OPD_HEADER = """
# On-policy distillation (`posttrain opd`)

An OPD recipe returns an `OPDConfig`: every key above, plus the keys below (docs/opd.md explains
the teacher modes and which combinations the preflight accepts).
"""


def _opd_sections(out: list[str]) -> None:
    """The keys OPD adds to the GRPO config: ``rl``'s new fields and the ``rl.teacher`` section."""
    from posttrain.config.opd import OPDRLConfig, TeacherConfig
    from posttrain.config.schema import RLConfig

    out.append(OPD_HEADER)
    added = {k: f for k, f in OPDRLConfig.model_fields.items() if k not in RLConfig.model_fields and k != "teacher"}
    out.append("\n## `rl` (OPD additions)\n")
    out.append("| key | type | default | meaning |\n| --- | --- | --- | --- |")
    out.extend(_row(f"rl.{name}", field) for name, field in added.items())
    _section(TeacherConfig, "rl.teacher.", out)


def render_config_reference() -> str:
    """The whole reference page as markdown."""
    out = [HEADER]
    _section(GRPOConfig, "", out)
    _opd_sections(out)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_config_reference())
