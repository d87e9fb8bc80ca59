"""Pick the prompt source ``rl.data`` selects, and check it without building it.

``check_data_config`` and ``provided_fields`` serve the model-free preflight
(``--validate-manifest``): they read at most the first row of a JSONL / JSON-lines file, a table's
schema (pyarrow) and a saved dataset's JSON metadata, and never import torch or ``datasets``; the
pass over every row (and the loading of a ``rl.data.name`` that is not a directory) is
``posttrain.data.rows``.
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
from posttrain.data.jsonl import ItemsFn, JsonlSource, iter_jsonl_lines, map_row, parse_jsonl_line
from posttrain.data.table_source import TableSource, missing_columns
from posttrain.data.tables import (
    has_data_files,
    is_disk_dataset,
    json_holds_list,
    looks_like_path,
    open_path_table,
    path_format,
)
from posttrain.errors import DataError


def _set_sources(data_cfg: DataConfig) -> list[str]:
    return [
        f"rl.data.{key}={value!r}"
        for key, value in (("path", data_cfg.path), ("name", data_cfg.name), ("factory", data_cfg.factory))
        if value is not None
    ]


def resolve_items_fn(data_cfg: DataConfig) -> ItemsFn | None:
    """The ``rl.data.items_fn`` function, or None; a bad path is a ``DataError`` naming the knob."""
    if data_cfg.items_fn is None:
        return None
    return import_callable(data_cfg.items_fn, what="rl.data.items_fn")


def reads_jsonl(path: str) -> bool:
    """``rl.data.path`` is read line by line by the JSONL source (``.jsonl``, or ``.json`` holding JSON lines)."""
    fmt = path_format(path)
    return fmt == "jsonl" or (fmt == "json" and not json_holds_list(path))


def build_data_source(data_cfg: DataConfig, data_seed: int, *, images: bool = False) -> DataSource:
    """The source ``data_cfg`` selects, seeded with ``data_seed`` (``rl.seed`` or ``rollout.seed``).
    ``images``: the policy is a vision-language model, whose rows may carry images
    (``data/vision_source.py``; the arithmetic generator stays the text one)."""
    if problems := _knob_problems(data_cfg):
        raise DataError(problems[0])
    if images and data_cfg.kind != "arithmetic":
        from posttrain.data.vision_source import build_image_source

        return build_image_source(data_cfg, data_seed)
    items_fn = resolve_items_fn(data_cfg)
    common: dict[str, Any] = {
        "prompt_column": data_cfg.prompt_column,
        "response_column": data_cfg.response_column,
        "shuffle": data_cfg.shuffle,
        "seed": data_seed,
        "system_prompt": data_cfg.system_prompt,
        "items_fn": items_fn,
    }
    if data_cfg.path is not None:
        path = data_cfg.path
        if not os.path.exists(path):
            raise DataError(f"rl.data.path: {path} does not exist")
        if os.path.isfile(path) and reads_jsonl(path):
            return JsonlSource(path, **common)
        return TableSource(open_path_table(path, data_cfg.split), **common)
    if data_cfg.name is not None:
        return HFDiskSource(
            data_cfg.name, subset=data_cfg.subset, split=data_cfg.split, data_files=data_cfg.data_files, **common
        )
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


def source_knob_problems(data_cfg: DataConfig) -> list[str]:
    """Settings of ``rl.data`` that contradict each other, found before anything is read."""
    return _knob_problems(data_cfg)


def _knob_problems(data_cfg: DataConfig) -> list[str]:
    """Settings that contradict each other (before anything is read)."""
    chosen = _set_sources(data_cfg)
    if len(chosen) > 1:
        return [f"rl.data: set only one of path, name and factory (got {', '.join(chosen)})"]
    problems = [
        f"rl.data.{knob} is read only with rl.data.name (a dataset for datasets.load_dataset); "
        f"drop it or set rl.data.name"
        for knob, value in (("subset", data_cfg.subset), ("data_files", data_cfg.data_files))
        if value is not None and data_cfg.name is None
    ]
    if data_cfg.items_fn is not None and data_cfg.kind == "arithmetic":
        problems.append(
            "rl.data.items_fn maps the rows of rl.data.path, rl.data.name or rl.data.factory; the built-in "
            "arithmetic generator has none: set a data source or drop rl.data.items_fn"
        )
    return problems


def provided_fields(data_cfg: DataConfig) -> frozenset[str]:
    """The sample fields the selected source carries (what a reward's ``requires`` is checked against):
    the prompt, the ground truth when there is one, and the columns of a local file or saved dataset
    (they reach the reward in ``RewardInput.metadata``) when they are known without loading a dataset."""
    if data_cfg.kind == "arithmetic" or data_cfg.response_column is not None:
        base = frozenset({"prompt", "ground_truth"})
    else:
        base = frozenset({"prompt"})
    try:
        columns = _known_columns(data_cfg)
    except (DataError, OSError, ValueError):
        columns = []  # check_data_config reports an unreadable source
    return base | {c for c in columns if c != data_cfg.prompt_column}


def _known_columns(data_cfg: DataConfig) -> list[str]:
    path = data_cfg.path
    if path is None or not os.path.exists(path):
        return []
    items_fn = resolve_items_fn(data_cfg)
    if items_fn is None and not reads_jsonl(path) and path_format(path) != "disk":
        return open_path_table(path, data_cfg.split).columns  # the table's schema
    row = _first_row(data_cfg)
    if row is None:
        return []
    return [str(k) for k in (row if items_fn is None else map_row(items_fn, row, path))]


def _first_row(data_cfg: DataConfig) -> dict[str, Any] | None:
    from posttrain.data.jsonl import decode_json_row

    path = data_cfg.path
    assert path is not None
    if os.path.isfile(path) and reads_jsonl(path):
        for lineno, text in iter_jsonl_lines(path):
            row = decode_json_row(text, f"{path} line {lineno}")
            return row if isinstance(row, dict) else None
        return None
    if path_format(path) == "disk":
        return None  # needs `datasets`; the run's build reads it
    table = open_path_table(path, data_cfg.split)
    return next((row for _, row in table.rows()), None)


def _prefixed(message: str, knob: str) -> str:
    return message if message.startswith("rl.data") else f"{knob}: {message}"


def _check_jsonl(data_cfg: DataConfig, items_fn: ItemsFn | None) -> list[str]:
    path = data_cfg.path
    assert path is not None
    try:
        for lineno, text in iter_jsonl_lines(path):
            # Only the first row here; the preflight's row pass (posttrain.data.rows) reads them all.
            parse_jsonl_line(
                text,
                path=path,
                lineno=lineno,
                prompt_column=data_cfg.prompt_column,
                response_column=data_cfg.response_column,
                items_fn=items_fn,
            )
            return []
    except DataError as exc:
        return [_prefixed(str(exc), "rl.data.path")]
    return [f"rl.data.path: JSONL file {path} has no rows (it is empty or only blank lines)"]


def _check_path(data_cfg: DataConfig, items_fn: ItemsFn | None) -> list[str]:
    path = data_cfg.path
    assert path is not None
    if not os.path.exists(path):
        return [f"rl.data.path: {path} does not exist"]
    try:
        if path_format(path) == "disk":
            return _check_disk(path, data_cfg, "rl.data.path", items_fn)
        if reads_jsonl(path):
            return _check_jsonl(data_cfg, items_fn)
        table = open_path_table(path, data_cfg.split)
    except DataError as exc:
        return [_prefixed(str(exc), "rl.data.path")]
    if table.num_rows == 0:
        return [f"rl.data.path: {path} has no rows"]
    return [] if items_fn is not None else missing_columns(table, data_cfg.prompt_column, data_cfg.response_column)


def _read_json(path: str) -> object:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _check_disk(name: str, data_cfg: DataConfig, knob: str, items_fn: ItemsFn | None) -> list[str]:
    """A ``save_to_disk`` directory, from its JSON metadata only (no ``datasets`` import)."""
    if not os.path.isdir(name):
        return [f"{knob}: {name!r} is not a directory; give a dataset saved with save_to_disk"]
    split_dir = name
    dict_meta = os.path.join(name, "dataset_dict.json")
    if os.path.isfile(dict_meta):
        meta = _read_json(dict_meta)
        splits = meta.get("splits") if isinstance(meta, dict) else None
        if isinstance(splits, list) and data_cfg.split not in splits:
            return [f"rl.data.split: dataset {name!r} has no split {data_cfg.split!r}; it has {splits}"]
        split_dir = os.path.join(name, data_cfg.split)
    elif not os.path.isfile(os.path.join(name, "state.json")):
        return [f"{knob}: {name!r} is not a dataset written by Dataset.save_to_disk or DatasetDict.save_to_disk"]
    # The column names sit in the split's metadata; when it is unreadable the build reports it.
    info = _read_json(os.path.join(split_dir, "dataset_info.json"))
    features = info.get("features") if isinstance(info, dict) else None
    if not isinstance(features, dict) or items_fn is not None:
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


def _check_name(data_cfg: DataConfig, items_fn: ItemsFn | None) -> list[str]:
    name = data_cfg.name
    assert name is not None
    if not looks_like_path(name) or data_cfg.data_files is not None:
        return []  # loaded (from the cache, or by a builder) in the row pass, posttrain.data.rows
    if os.path.isdir(name) and not is_disk_dataset(name) and has_data_files(name):
        return []  # a directory of data files: load_dataset reads it in the row pass
    return _check_disk(name, data_cfg, "rl.data.name", items_fn)


def check_data_config(data_cfg: DataConfig) -> list[str]:
    """Every problem with ``rl.data`` found without building the source (empty when none)."""
    if problems := _knob_problems(data_cfg):
        return problems
    try:
        items_fn = resolve_items_fn(data_cfg)
    except DataError as exc:
        return [str(exc)]
    kind = data_cfg.kind
    if kind in ("jsonl", "file"):
        return _check_path(data_cfg, items_fn)
    if kind == "dataset":
        return _check_name(data_cfg, items_fn)
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
