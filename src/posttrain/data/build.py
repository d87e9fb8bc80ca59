"""Pick the prompt source ``rl.data`` selects, and check it without building it.

``check_data_config`` and ``provided_fields`` serve the model-free preflight
(``--validate-manifest``): they read at most the first row of a file and a dataset's JSON metadata,
and never import torch or ``datasets``; the pass over every row is ``posttrain.data.rows``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from posttrain.config.schema import DataConfig
from posttrain.data.arithmetic import ArithmeticSource, arithmetic_problems
from posttrain.data.base import DataSource
from posttrain.data.factory import FactorySource, import_callable
from posttrain.data.hf_disk import HFDiskSource
from posttrain.data.jsonl import JsonlSource, iter_jsonl_lines, parse_jsonl_line
from posttrain.errors import DataError


def _set_sources(data_cfg: DataConfig) -> list[str]:
    return [
        f"rl.data.{key}={value!r}"
        for key, value in (("path", data_cfg.path), ("name", data_cfg.name), ("factory", data_cfg.factory))
        if value is not None
    ]


def build_data_source(data_cfg: DataConfig, data_seed: int) -> DataSource:
    """The source ``data_cfg`` selects, seeded with ``data_seed`` (``rl.seed`` or ``rollout.seed``)."""
    chosen = _set_sources(data_cfg)
    if len(chosen) > 1:
        raise DataError(f"rl.data: set only one of path, name and factory (got {', '.join(chosen)})")
    common: dict[str, Any] = {
        "prompt_column": data_cfg.prompt_column,
        "response_column": data_cfg.response_column,
        "shuffle": data_cfg.shuffle,
        "seed": data_seed,
        "system_prompt": data_cfg.system_prompt,
    }
    if data_cfg.path is not None:
        return JsonlSource(data_cfg.path, **common)
    if data_cfg.name is not None:
        return HFDiskSource(data_cfg.name, split=data_cfg.split, **common)
    if data_cfg.factory is not None:
        return FactorySource(data_cfg.factory, **common)
    return ArithmeticSource(
        data_seed,
        min_operand=data_cfg.arithmetic_min,
        max_operand=data_cfg.arithmetic_max,
        ops=list(data_cfg.arithmetic_ops),
        template=data_cfg.arithmetic_template,
        system_prompt=data_cfg.system_prompt,
    )


def provided_fields(data_cfg: DataConfig) -> frozenset[str]:
    """The sample fields the selected source carries (what a reward's ``requires`` is checked against)."""
    if data_cfg.kind == "arithmetic" or data_cfg.response_column is not None:
        return frozenset({"prompt", "ground_truth"})
    return frozenset({"prompt"})


def _check_jsonl(data_cfg: DataConfig) -> list[str]:
    path = data_cfg.path
    assert path is not None
    if not os.path.exists(path):
        return [f"rl.data.path: JSONL file {path} does not exist"]
    if not os.path.isfile(path):
        return [f"rl.data.path: {path} is not a file"]
    try:
        for lineno, text in iter_jsonl_lines(path):
            # Only the first row here; the preflight's row pass (posttrain.data.rows) reads them all.
            parse_jsonl_line(
                text,
                path=path,
                lineno=lineno,
                prompt_column=data_cfg.prompt_column,
                response_column=data_cfg.response_column,
            )
            return []
    except DataError as exc:
        message = str(exc)
        return [message if message.startswith("rl.data.path") else f"rl.data.path: {message}"]
    return [f"rl.data.path: JSONL file {path} has no rows (it is empty or only blank lines)"]


def _read_json(path: str) -> object:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _check_hf_disk(data_cfg: DataConfig) -> list[str]:
    name = data_cfg.name
    assert name is not None
    if not os.path.isdir(name):
        return [f"rl.data.name: {name!r} is not a directory; give a dataset saved with save_to_disk"]
    split_dir = name
    dict_meta = os.path.join(name, "dataset_dict.json")
    if os.path.isfile(dict_meta):
        meta = _read_json(dict_meta)
        splits = meta.get("splits") if isinstance(meta, dict) else None
        if isinstance(splits, list) and data_cfg.split not in splits:
            return [f"rl.data.split: dataset {name!r} has no split {data_cfg.split!r}; it has {splits}"]
        split_dir = os.path.join(name, data_cfg.split)
    elif not os.path.isfile(os.path.join(name, "state.json")):
        return [f"rl.data.name: {name!r} is not a dataset written by Dataset.save_to_disk or DatasetDict.save_to_disk"]
    # The column names sit in the split's metadata; when it is unreadable the build reports it.
    info = _read_json(os.path.join(split_dir, "dataset_info.json"))
    features = info.get("features") if isinstance(info, dict) else None
    if not isinstance(features, dict):
        return []
    return [
        f"rl.data.{field}: dataset {name!r} split {data_cfg.split!r} has no column {column!r}; "
        f"its columns are {sorted(features)}"
        for field, column in (
            ("prompt_column", data_cfg.prompt_column),
            ("response_column", data_cfg.response_column),
        )
        if column is not None and column not in features
    ]


def check_data_config(data_cfg: DataConfig) -> list[str]:
    """Every problem with ``rl.data`` found without building the source (empty when none)."""
    chosen = _set_sources(data_cfg)
    if len(chosen) > 1:
        return [f"rl.data: set only one of path, name and factory (got {', '.join(chosen)})"]
    kind = data_cfg.kind
    if kind == "jsonl":
        return _check_jsonl(data_cfg)
    if kind == "hf_disk":
        return _check_hf_disk(data_cfg)
    if kind == "factory":
        assert data_cfg.factory is not None
        try:
            import_callable(data_cfg.factory, what="rl.data.factory")
        except DataError as exc:
            return [str(exc)]
        return []
    return arithmetic_problems(
        data_cfg.arithmetic_min,
        data_cfg.arithmetic_max,
        list(data_cfg.arithmetic_ops),
        data_cfg.arithmetic_template,
    )
