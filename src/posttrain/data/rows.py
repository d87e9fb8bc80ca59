"""The preflight's pass over every row of a local prompt source, before any model loads.

``check_rows(cfg)`` reads the whole ``rl.data.path`` (JSONL / JSON lines by line; a JSON list,
parquet, CSV, Arrow file or ``save_to_disk`` directory by row index) or the split of ``rl.data.name``
(a dataset on disk, or loaded through ``datasets.load_dataset``, which the run's build then reads
from the ``datasets`` cache), with ``rl.data.items_fn`` applied, and reports, by file and line
(table or dataset row) and field:

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
at the start of the run, not here; the arithmetic generator's rows are valid by construction, but
``rl.data.system_prompt`` can make them too long, so its longest question is counted. What no pass
here can count (a factory's rows, a model not yet on disk) the run checks per rendered prompt
(``loop.collect.check_prompt_lengths``).

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
from posttrain.data.jsonl import ItemsFn, apply_system_prompt, jsonl_lines, parse_jsonl_line, row_to_sample
from posttrain.data.prompt_length import PromptBudget, PromptCounter, max_positions, prompt_budget
from posttrain.data.table_source import missing_columns
from posttrain.data.tables import RowTable, open_dataset_table, open_path_table
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


def _jsonl_rows(cfg: RunConfig, items_fn: ItemsFn | None) -> Iterator[Row]:
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
                items_fn=items_fn,
            )
        except DataError as exc:
            yield where, exc
            continue
        yield where, sample


def _open_table(cfg: RunConfig) -> RowTable:
    """The table of a non-JSONL ``rl.data.path`` or of ``rl.data.name`` (loading it through ``datasets``)."""
    data = cfg.rl.data
    if data.path is not None:
        return open_path_table(data.path, data.split)
    assert data.name is not None
    return open_dataset_table(data.name, subset=data.subset, split=data.split, data_files=data.data_files)


def _table_rows(table: RowTable, cfg: RunConfig, items_fn: ItemsFn | None) -> Iterator[Row]:
    data = cfg.rl.data
    for i, row in table.rows():
        where = table.where(i)
        try:
            sample = row_to_sample(
                row,
                where=where,
                uid=f"{table.uid_prefix}:{i}",
                prompt_column=data.prompt_column,
                response_column=data.response_column,
                system_prompt=data.system_prompt,
                items_fn=items_fn,
            )
        except DataError as exc:
            yield where, exc
            continue
        yield where, sample


def _source_rows(cfg: RunConfig, problems: list[str]) -> tuple[Iterator[Row], str] | None:
    """The rows to check and the source's name, or None (with the reason in ``problems`` when there is one)."""
    from posttrain.data.build import reads_jsonl, resolve_items_fn

    data = cfg.rl.data
    if data.kind == "arithmetic":
        return _longest_arithmetic_row(cfg), "the arithmetic generator"
    if data.kind not in ("jsonl", "file", "dataset"):
        return None  # a factory runs user code (checked when built)
    source = f"rl.data.path={data.path}" if data.path is not None else f"rl.data.name={data.name}"
    try:
        items_fn = resolve_items_fn(data)
        path = data.path
        if path is not None and (not os.path.exists(path) or (os.path.isfile(path) and reads_jsonl(path))):
            return _jsonl_rows(cfg, items_fn), source
        table = _open_table(cfg)
    except DataError as exc:  # a hub dataset is first loaded here; local files were checked already
        problems.append(str(exc))
        return None
    if items_fn is None and (missing := missing_columns(table, data.prompt_column, data.response_column)):
        problems.extend(missing)
        return None
    return _table_rows(table, cfg, items_fn), source


def _longest_arithmetic_row(cfg: RunConfig) -> Iterator[Row]:
    """The generator's rows are valid by construction except for their length, which a
    ``rl.data.system_prompt`` can push past the context: with one set, its longest question (the
    operand with the most characters on both sides, the longest operator), which the length check
    then counts. Without one the questions are a short template's (and ``--validate-manifest`` of the
    default recipe stays clear of transformers' template renderer)."""
    from posttrain.data.arithmetic import arithmetic_problems, template_format_problem

    data = cfg.rl.data
    ops, template = list(data.arithmetic_ops), data.arithmetic_template
    if data.system_prompt is None or arithmetic_problems(data.arithmetic_min, data.arithmetic_max, ops, template):
        return  # nothing to count, or the preflight's data check names the settings
    operand, op = max((data.arithmetic_min, data.arithmetic_max), key=lambda v: len(str(v))), max(ops, key=len)
    if template_format_problem(template, op, operand, operand) is not None:
        return  # the preflight's template check names it
    question = template.format(a=operand, op=op, b=operand)
    prompt = apply_system_prompt(question, data.system_prompt)
    sample = PromptSample(prompt=prompt, ground_truth=0, uid="arith:longest")  # only its length is in question
    yield "rl.data (the arithmetic generator's longest question)", sample


def _resolve_rewards(names: str | list[str]) -> list[Reward]:
    from posttrain.rewards.registry import get_reward

    rewards = []
    for name in [names] if isinstance(names, str) else names:
        try:
            rewards.append(get_reward(name))
        except Exception:  # user code may raise anything on import; the preflight's reward check names it
            continue
    return rewards


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
    model_dir = local_model_dir(model, cfg.model.revision)
    positions = max_positions(model_dir) if model_dir is not None else None
    if model_dir is None or positions is None:
        return _Lengths(None, None, model)
    if positions <= cfg.rollout.max_tokens:
        problems.append(
            f"rollout.max_tokens={cfg.rollout.max_tokens} leaves no room for a prompt: model.name_or_path={model} "
            f"has max_position_embeddings={positions}; lower rollout.max_tokens"
        )
        return _Lengths(None, None, model)
    budget = prompt_budget(positions, cfg.rollout)  # a vLLM engine's smaller max_model_len, where set
    if budget is None or budget.limit <= 0:
        return _Lengths(None, None, model)  # a max_model_len without room: the preflight's engine check names it
    counter = PromptCounter.for_model(
        model_dir, use_chat_template=cfg.model.use_chat_template, template_kwargs=cfg.model.chat_template_kwargs
    )
    return _Lengths(counter, budget, model)


def _check_sample(
    cfg: RunConfig, sample: PromptSample, where: str, rewards: list[Reward], lengths: _Lengths
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
    if data.response_column is not None:
        from posttrain.rewards.registry import ground_truth_problem

        for reward in rewards:
            problem = ground_truth_problem(reward, sample.ground_truth)
            if problem is not None:
                return f"{where}: column {data.response_column!r}: {problem}"
    if counter is not None and lengths.budget is not None:
        try:
            tokens = counter.too_long(sample.prompt, lengths.budget)
        except Exception as exc:  # a chat template that raises (raise_exception) fails the same way in the run
            return f"{where}: the chat template of model.name_or_path={lengths.model} refuses this prompt: {exc}"
        if tokens is not None:
            arithmetic = data.kind == "arithmetic"
            remedy = "shorten rl.data.system_prompt or arithmetic_template" if arithmetic else "shorten or drop the row"
            return f"{where} (sample {sample.uid}): {lengths.budget.describe(tokens, remedy)}"
    return None


def check_rows(cfg: RunConfig) -> list[str]:
    """Every problem of every row of a local prompt source (see the module docstring); empty when none."""
    data = cfg.rl.data
    problems: list[str] = []
    lengths = _length_setup(cfg, problems)
    found = _source_rows(cfg, problems)
    if found is None:
        return problems
    rows, source = found
    if data.system_prompt is not None and not cfg.model.use_chat_template:
        problems.append(
            "rl.data.system_prompt turns every prompt into a chat-message list (a system message, then the "
            "prompt), which model.use_chat_template=false cannot render; drop one of the two"
        )
        return problems
    rewards = _resolve_rewards(cfg.rl.reward)
    report = _Report()
    try:
        for where, sample in rows:
            report.rows += 1
            problem = (
                str(sample) if isinstance(sample, DataError) else _check_sample(cfg, sample, where, rewards, lengths)
            )
            if problem is not None:
                report.add(problem)
    except DataError as exc:  # the file itself became unreadable
        report.add(str(exc))
    return problems + report.lines(source)
