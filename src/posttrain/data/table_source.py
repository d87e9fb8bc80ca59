"""Prompts from an opened table (a parquet / CSV / Arrow / JSON-list file, a dataset on disk or from
``datasets.load_dataset``), served with the corpus cursor every local source shares.

The rows are read once, at construction, through ``row_to_sample`` (the JSONL file's row rules, the
``items_fn`` transformer, every other column kept as metadata), so a bad row anywhere fails with its
table and index before any model loads, and the cursor (``CorpusSource``) resumes exactly.
"""

from __future__ import annotations

from posttrain.data.base import PromptSample
from posttrain.data.jsonl import CorpusSource, ItemsFn, corpus_provides, row_to_sample
from posttrain.data.tables import RowTable
from posttrain.errors import DataError


def missing_columns(table: RowTable, prompt_column: str, response_column: str | None) -> list[str]:
    """The configured columns the table lacks, one message each (checked on raw rows: without ``items_fn``)."""
    return [
        f"rl.data.{field}: {table.label} has no column {column!r}; its columns are {table.columns}"
        for field, column in (("prompt_column", prompt_column), ("response_column", response_column))
        if column is not None and column not in table.columns
    ]


def table_samples(
    table: RowTable,
    *,
    prompt_column: str,
    response_column: str | None,
    system_prompt: str | None,
    items_fn: ItemsFn | None,
) -> list[PromptSample]:
    """Every row of ``table`` as a sample; the first bad row raises ``DataError`` naming it."""
    if items_fn is None and (problems := missing_columns(table, prompt_column, response_column)):
        raise DataError(problems[0])
    samples = [
        row_to_sample(
            row,
            where=table.where(i),
            uid=f"{table.uid_prefix}:{i}",
            prompt_column=prompt_column,
            response_column=response_column,
            system_prompt=system_prompt,
            items_fn=items_fn,
        )
        for i, row in table.rows()
    ]
    if not samples:
        raise DataError(f"rl.data: {table.label} has no rows")
    return samples


class TableSource(CorpusSource):
    """The rows of one ``RowTable``, checked up front and served epoch after epoch."""

    def __init__(
        self,
        table: RowTable,
        *,
        prompt_column: str = "prompt",
        response_column: str | None = "answer",
        shuffle: bool = True,
        seed: int = 0,
        system_prompt: str | None = None,
        items_fn: ItemsFn | None = None,
    ) -> None:
        self.label = table.label
        samples = table_samples(
            table,
            prompt_column=prompt_column,
            response_column=response_column,
            system_prompt=system_prompt,
            items_fn=items_fn,
        )
        super().__init__(samples, shuffle=shuffle, seed=seed, provides=corpus_provides(response_column))
