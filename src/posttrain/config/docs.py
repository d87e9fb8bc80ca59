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
(`posttrain grpo -- rl.max_steps=5`). Values after `--` are YAML 1.2 core-schema values: `null`, `true`,
`5`, `0x1f`, `1e-5`, `[1,2]`, `{lr: 1e-5}`; anything else is text (`1:30`, `2024-02-30`, `yes`; `010` is 10).
Tags (`!!int`), anchors and aliases are refused. Every number must be finite and every integer fit a signed
64-bit integer.
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

An OPD recipe returns an `OPDConfig`: every key above except GRPO's own, plus the keys below
(docs/opd.md explains the teacher modes and which combinations the preflight accepts).
"""


def _opd_sections(out: list[str]) -> None:
    """How OPD's keys differ from GRPO's: the GRPO knobs it lacks, ``rl``'s new fields and the
    ``rl.teacher`` section (both lists computed from the models, so they cannot drift)."""
    from posttrain.config.loading import known_keys
    from posttrain.config.opd import OPDConfig, OPDRLConfig, TeacherConfig
    from posttrain.config.schema import GRPORLConfig

    out.append(OPD_HEADER)
    opd_keys = set(known_keys(OPDConfig))
    lacks = [k for k in known_keys(GRPOConfig) if k not in opd_keys]
    lacks = [k for k in lacks if k.rpartition(".")[0] not in lacks]  # a section, not each of its keys
    names = ", ".join(f"`{k}`" for k in lacks)
    out.append(f"GRPO's own keys, which an OPD config does not have (setting one is an unknown key): {names}.\n")
    added = {k: f for k, f in OPDRLConfig.model_fields.items() if k not in GRPORLConfig.model_fields and k != "teacher"}
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
