"""Prompt sources of a vision-language run: every row format, read into canonical multimodal samples.

A run whose policy is a vision-language model (``models.vision.vision_model_type``) reads its rows
here instead of through the text row rules (which refuse message contents that are lists of
parts): a JSONL file, a table file (parquet, CSV, Arrow, JSON list, ``save_to_disk`` directory), a
dataset for ``datasets.load_dataset``, or a factory (dict rows, or ``PromptSample``s such as the
built-in shape-count task, ``posttrain.data.visual:shape_count_rows``). Each row becomes the
canonical messages of ``posttrain.data.images.normalize_prompt`` (images as raw bytes, in reading
order; ``rl.data.images``: the image column and the per-row limits), with ``rl.data.items_fn`` and
``rl.data.system_prompt`` applied as for text rows. Text-only rows (a string prompt, string
contents) are valid too. A relative image path is read against the data file's directory.

The arithmetic generator (no source set) gives text prompts, which a vision-language model also
takes, so it is served by the text builder. The samples are served with the corpus cursor
(``CorpusSource``): a resume continues exactly as for text data.

``check_image_rows(cfg)`` is the preflight's pass over every row of a local source (a factory runs
user code and is checked when the source is built, as for text runs): each problem names the file
and line (or table row) and the image's index.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from posttrain.data.base import PromptSample
from posttrain.data.images import ImageLimits, image_row_to_sample, normalize_prompt
from posttrain.data.jsonl import (
    CorpusSource,
    ItemsFn,
    apply_system_prompt,
    corpus_provides,
    decode_json_row,
    jsonl_lines,
    map_row,
)
from posttrain.data.tables import open_dataset_table, open_path_table
from posttrain.errors import DataError

if TYPE_CHECKING:
    from posttrain.config.schema import DataConfig, RunConfig

Row = tuple[str, "PromptSample | DataError"]
MAX_LISTED = 20
"""Problem rows listed by name by the preflight; the rest are counted."""


def image_limits(data_cfg: DataConfig) -> ImageLimits:
    """``rl.data.images``' limits."""
    return ImageLimits(max_images=data_cfg.images.max_per_row, max_pixels=data_cfg.images.max_pixels)


def _to_sample(
    row: Any, where: str, uid: str, *, data_cfg: DataConfig, items_fn: ItemsFn | None, base_dir: str | None
) -> PromptSample:
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: expected an object (JSON object / dict) per row, got {type(row).__name__}")
    if items_fn is not None:
        row = map_row(items_fn, row, where)
    sample = image_row_to_sample(
        row,
        where=where,
        uid=uid,
        prompt_column=data_cfg.prompt_column,
        images_column=data_cfg.images.column,
        response_column=data_cfg.response_column,
        limits=image_limits(data_cfg),
        base_dir=base_dir,
    )
    if data_cfg.system_prompt is None:
        return sample
    prompt = apply_system_prompt(sample.prompt, data_cfg.system_prompt)
    return PromptSample(prompt=prompt, ground_truth=sample.ground_truth, uid=sample.uid, metadata=sample.metadata)


def _guarded(where: str, make: Any) -> Row:
    try:
        return where, make()
    except DataError as exc:
        return where, exc


def _jsonl_rows(path: str, data_cfg: DataConfig, items_fn: ItemsFn | None) -> Iterator[Row]:
    base = os.path.dirname(os.path.abspath(path))
    for lineno, text in jsonl_lines(path):
        where = f"{path} line {lineno}"
        if isinstance(text, DataError):
            yield where, text
            continue
        uid = f"{os.path.basename(path)}:{lineno}"
        yield _guarded(
            where,
            lambda t=text, w=where, u=uid: _to_sample(
                decode_json_row(t, w), w, u, data_cfg=data_cfg, items_fn=items_fn, base_dir=base
            ),
        )


def _table_rows(data_cfg: DataConfig, items_fn: ItemsFn | None) -> Iterator[Row]:
    if data_cfg.path is not None:
        table = open_path_table(data_cfg.path, data_cfg.split)
        base: str | None = os.path.dirname(os.path.abspath(data_cfg.path))
    else:
        assert data_cfg.name is not None
        table = open_dataset_table(
            data_cfg.name, subset=data_cfg.subset, split=data_cfg.split, data_files=data_cfg.data_files
        )
        base = None
    for i, row in table.rows():
        where, uid = table.where(i), f"{table.uid_prefix}:{i}"
        yield _guarded(
            where,
            lambda r=row, w=where, u=uid: _to_sample(r, w, u, data_cfg=data_cfg, items_fn=items_fn, base_dir=base),
        )


def _factory_rows(data_cfg: DataConfig, seed: int, items_fn: ItemsFn | None) -> Iterator[Row]:
    from posttrain.data.factory import import_callable

    factory = data_cfg.factory
    assert factory is not None
    fn = import_callable(factory, what="rl.data.factory")
    try:
        produced = fn(seed=seed) if _accepts_seed(fn) else fn()
        items = list(produced) if isinstance(produced, Iterable) else None
    except Exception as exc:  # user code: name the factory, keep the cause
        raise DataError(f"rl.data.factory: {factory!r} raised {exc!r}") from exc
    if items is None:
        raise DataError(f"rl.data.factory: {factory!r} returned {type(produced).__name__}, not an iterable of rows")
    for i, item in enumerate(items):
        where, uid = f"factory {factory} row {i}", f"{factory}:{i}"
        if isinstance(item, PromptSample):
            yield _guarded(where, lambda s=item, w=where, u=uid: _ready_sample(s, w, u, data_cfg))
        else:
            yield _guarded(
                where,
                lambda r=item, w=where, u=uid: _to_sample(r, w, u, data_cfg=data_cfg, items_fn=items_fn, base_dir=None),
            )


def _accepts_seed(fn: Any) -> bool:
    """Whether the factory takes ``seed=`` (by name or through ``**kwargs``), as for text factories."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any((p.name == "seed" and p.kind != p.VAR_POSITIONAL) or p.kind == p.VAR_KEYWORD for p in params)


def _ready_sample(item: PromptSample, where: str, uid: str, data_cfg: DataConfig) -> PromptSample:
    """A factory's ready sample: its prompt normalised and checked like a row's."""
    if data_cfg.response_column is not None and item.ground_truth is None:
        raise DataError(
            f"{where}: PromptSample has ground_truth=None while rl.data.response_column is set; "
            "set rl.data.response_column=null when the factory carries no ground truth"
        )
    prompt = normalize_prompt(item.prompt, where=where, limits=image_limits(data_cfg))
    return PromptSample(
        prompt=apply_system_prompt(prompt, data_cfg.system_prompt),
        ground_truth=item.ground_truth if data_cfg.response_column is not None else None,
        uid=item.uid or uid,
        metadata=dict(item.metadata),
    )


def image_rows(data_cfg: DataConfig, seed: int, *, run_factory: bool = True) -> Iterator[Row] | None:
    """Every row of the configured source as ``(where, sample or its DataError)``; None for the
    arithmetic generator (text prompts), and for a factory unless ``run_factory``."""
    from posttrain.data.build import reads_jsonl, resolve_items_fn

    items_fn = resolve_items_fn(data_cfg)
    path = data_cfg.path
    if path is not None:
        if not os.path.exists(path):
            raise DataError(f"rl.data.path: {path} does not exist")
        if os.path.isfile(path) and reads_jsonl(path):
            return _jsonl_rows(path, data_cfg, items_fn)
        return _table_rows(data_cfg, items_fn)
    if data_cfg.name is not None:
        return _table_rows(data_cfg, items_fn)
    if data_cfg.factory is not None:
        return _factory_rows(data_cfg, seed, items_fn) if run_factory else None
    return None


def build_image_source(data_cfg: DataConfig, data_seed: int) -> CorpusSource:
    """The corpus of image-bearing samples ``rl.data`` selects (not the arithmetic generator); the
    first bad row raises its ``DataError``."""
    rows = image_rows(data_cfg, data_seed)
    if rows is None:
        raise DataError("rl.data selects the arithmetic generator, which has no image rows")
    samples = []
    for _, sample in rows:
        if isinstance(sample, DataError):
            raise sample
        samples.append(sample)
    if not samples:
        raise DataError("rl.data: the prompt source holds no rows")
    return CorpusSource(
        samples, shuffle=data_cfg.shuffle, seed=data_seed, provides=corpus_provides(data_cfg.response_column)
    )


def check_image_rows(cfg: RunConfig) -> list[str]:
    """Every problem of every row of a local image source (the limits, unreadable images, bad rows,
    ground truths the reward cannot use), the first ``MAX_LISTED`` by name; empty when none."""
    from posttrain.rewards.registry import get_reward, ground_truth_problem

    data = cfg.rl.data
    try:
        rows = image_rows(data, cfg.data_seed, run_factory=False)
    except DataError as exc:
        return [str(exc)]
    if rows is None:
        return []
    rewards = []
    for name in [cfg.rl.reward] if isinstance(cfg.rl.reward, str) else cfg.rl.reward:
        try:
            rewards.append(get_reward(name))
        except (ValueError, ImportError):
            continue  # the preflight's reward check reports it
    problems: list[str] = []
    more = count = 0
    try:
        for where, sample in rows:
            count += 1
            problem = str(sample) if isinstance(sample, DataError) else None
            if problem is None and data.response_column is not None and isinstance(sample, PromptSample):
                found = (ground_truth_problem(r, sample.ground_truth) for r in rewards)
                bad = next((p for p in found if p is not None), None)
                problem = None if bad is None else f"{where}: column {data.response_column!r}: {bad}"
            if problem is not None:
                if len(problems) < MAX_LISTED:
                    problems.append(problem)
                else:
                    more += 1
    except DataError as exc:  # the file itself could not be read
        problems.append(str(exc))
    if more:
        problems.append(f"rl.data: {more} more problem(s) in {count} rows, not listed")
    return problems
