"""The preflight's pass over every row of a local prompt source, before any model loads.

``check_rows(cfg)`` reads the whole JSONL file (``rl.data.path``) or dataset split on disk
(``rl.data.name``) and reports, by file and line (dataset row) and field:

* rows the source would refuse (malformed JSON, over-long integers, deep nesting, bytes that are not
  UTF-8, lone surrogates, a message content that is not a string, missing columns, ...);
* chat-message prompts that the configured rendering cannot render (``model.use_chat_template=false``,
  or a tokenizer without a chat template);
* ground truths the reward cannot use, through the reward's own ``check_ground_truth``
  (``"twelve"``, ``""``, ``true``, a list, NaN or Infinity for ``arithmetic`` / ``gsm8k``);
* prompts longer than the model's context leaves once ``rollout.max_tokens`` are reserved, counted
  from the model directory's tokenizer files without torch (``posttrain.data.prompt_length``), when
  the directory is on disk with a ``config.json`` naming the context and a ``tokenizer.json`` (the
  embedded model once it has been converted on this machine; otherwise the check is skipped).

A custom factory (``rl.data.factory``) runs user code and is checked when the source is built,
at the start of the run, not here; the arithmetic generator's rows are valid by construction.

Cost, measured on this project's shared 2-core CPU machine (Python 3.11) with the SmolLM2 tokenizer
and ``config.json`` present: a 1,000,000-row JSONL file of short string prompts (76 MB,
``rl.reward=arithmetic``) takes about 7.5 s, the same rows as two-message chat prompts (155 MB,
``rl.reward=gsm8k``) about 10 s: 7-10 us a row, nearly all of it JSON decoding and the row checks
(building the source at the start of the run reads the file again, about 4.5 s). The length bound
skips the tokenizer for rows that clearly fit; a row near the context limit is rendered and
tokenized exactly, at about 70 us.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from posttrain.data.base import PromptSample
from posttrain.data.jsonl import jsonl_lines, parse_jsonl_line, row_to_sample
from posttrain.data.prompt_length import PromptBudget, PromptCounter, max_positions
from posttrain.errors import DataError

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.rewards.base import Reward

MAX_LISTED = 20
"""Problem rows listed by name; the rest are counted."""

Row = tuple[str, "PromptSample | DataError"]
"""``(where, the sample or the reason the row is refused)``."""


@dataclass
class _Report:
    """Problems of the pass: the first ``MAX_LISTED`` by name, the rest counted."""

    listed: list[str] = field(default_factory=list)
    more: int = 0
    rows: int = 0

    def add(self, problem: str) -> None:
        if len(self.listed) < MAX_LISTED:
            self.listed.append(problem)
        else:
            self.more += 1

    def lines(self, source: str) -> list[str]:
        if self.more:
            return [*self.listed, f"{source}: {self.more} more problem(s) in {self.rows} rows, not listed"]
        return self.listed


def _jsonl_rows(cfg: RunConfig) -> Iterator[Row]:
    data = cfg.rl.data
    path = data.path
    assert path is not None
    for lineno, text in jsonl_lines(path):
        where = f"{path} line {lineno}"
        if isinstance(text, DataError):
            yield where, text
            continue
        try:
            sample = parse_jsonl_line(
                text,
                path=path,
                lineno=lineno,
                prompt_column=data.prompt_column,
                response_column=data.response_column,
                system_prompt=data.system_prompt,
            )
        except DataError as exc:
            yield where, exc
            continue
        yield where, sample


def _dataset_rows(cfg: RunConfig) -> Iterator[Row]:
    data = cfg.rl.data
    assert data.name is not None
    from posttrain.data.hf_disk import _load_split  # imports `datasets`, only when a dataset is configured

    try:
        ds = _load_split(data.name, data.split)
    except DataError:
        return  # check_data_config reports an unreadable dataset
    columns = [c for c in (data.prompt_column, data.response_column) if c is not None]
    if any(c not in ds.column_names for c in columns):
        return  # reported by check_data_config, from the dataset's metadata
    base = os.path.basename(os.path.normpath(data.name))
    for i, row in enumerate(ds.select_columns(columns)):
        where, uid = f"dataset {data.name} split {data.split} row {i}", f"{base}:{data.split}:{i}"
        try:
            sample = row_to_sample(
                row,
                where=where,
                uid=uid,
                prompt_column=data.prompt_column,
                response_column=data.response_column,
                system_prompt=data.system_prompt,
            )
        except DataError as exc:
            yield where, exc
            continue
        yield where, sample


def _resolve_reward(name: str) -> Reward | None:
    from posttrain.rewards.registry import get_reward

    try:
        return get_reward(name)
    except (ValueError, ImportError):
        return None  # the preflight's reward check reports it


@dataclass
class _Lengths:
    """What the length check needs, or why there is none."""

    counter: PromptCounter | None
    budget: PromptBudget | None
    model: str


def _length_setup(cfg: RunConfig, problems: list[str]) -> _Lengths:
    """The model's context and a tokenizer counter, when the model directory is on disk (an embedded
    model is checked once it has been converted). A context that ``rollout.max_tokens`` fills
    is reported here, for every kind of data source."""
    from posttrain.models.loading import local_model_dir

    model = cfg.model.name_or_path
    model_dir = local_model_dir(model)
    positions = max_positions(model_dir) if model_dir is not None else None
    if model_dir is None or positions is None:
        return _Lengths(None, None, model)
    budget = PromptBudget(positions, cfg.rollout.max_tokens)
    if budget.limit <= 0:
        problems.append(
            f"rollout.max_tokens={cfg.rollout.max_tokens} leaves no room for a prompt: model.name_or_path={model} "
            f"has max_position_embeddings={positions}; lower rollout.max_tokens"
        )
        return _Lengths(None, None, model)
    return _Lengths(PromptCounter.for_model(model_dir, use_chat_template=cfg.model.use_chat_template), budget, model)


def _check_sample(
    cfg: RunConfig, sample: PromptSample, where: str, reward: Reward | None, lengths: _Lengths
) -> str | None:
    """The first problem of one parsed row, else None."""
    data = cfg.rl.data
    chat = not isinstance(sample.prompt, str)
    if chat and not cfg.model.use_chat_template:
        return (
            f"{where}: column {data.prompt_column!r} is a chat-message list, but model.use_chat_template=false "
            "renders plain-string prompts only; set model.use_chat_template=true or give string prompts"
        )
    counter = lengths.counter
    if chat and counter is not None and counter.template is None:
        return (
            f"{where}: column {data.prompt_column!r} is a chat-message list, but the tokenizer of "
            f"model.name_or_path={lengths.model} has no chat template; give string prompts"
        )
    if reward is not None and data.response_column is not None:
        from posttrain.rewards.registry import ground_truth_problem

        problem = ground_truth_problem(reward, sample.ground_truth)
        if problem is not None:
            return f"{where}: column {data.response_column!r}: {problem}"
    if counter is not None and lengths.budget is not None:
        try:
            tokens = counter.too_long(sample.prompt, lengths.budget)
        except Exception as exc:  # a chat template that raises (raise_exception) fails the same way in the run
            return f"{where}: the chat template of model.name_or_path={lengths.model} refuses this prompt: {exc}"
        if tokens is not None:
            return f"{where} (sample {sample.uid}): {lengths.budget.describe(tokens)}"
    return None


def check_rows(cfg: RunConfig) -> list[str]:
    """Every problem of every row of a local prompt source (see the module docstring); empty when none."""
    data = cfg.rl.data
    problems: list[str] = []
    lengths = _length_setup(cfg, problems)
    if data.kind == "jsonl":
        rows, source = _jsonl_rows(cfg), f"rl.data.path={data.path}"
    elif data.kind == "hf_disk":
        rows, source = _dataset_rows(cfg), f"rl.data.name={data.name}"
    else:
        return problems
    if data.system_prompt is not None and not cfg.model.use_chat_template:
        problems.append(
            "rl.data.system_prompt turns every prompt into a chat-message list (a system message, then the "
            "prompt), which model.use_chat_template=false cannot render; drop one of the two"
        )
        return problems
    reward = _resolve_reward(cfg.rl.reward)
    report = _Report()
    try:
        for where, sample in rows:
            report.rows += 1
            problem = (
                str(sample) if isinstance(sample, DataError) else _check_sample(cfg, sample, where, reward, lengths)
            )
            if problem is not None:
                report.add(problem)
    except DataError as exc:  # the file itself became unreadable
        report.add(str(exc))
    return problems + report.lines(source)
