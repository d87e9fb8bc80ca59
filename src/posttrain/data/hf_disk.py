"""Prompts from a Hugging Face dataset: a ``save_to_disk`` directory or anything
``datasets.load_dataset`` opens (a hub id from the cache under ``HF_HOME``, a builder such as
``parquet`` with ``data_files``).

``datasets`` is imported only when such a source is built, so the preflight and ``--help`` stay
light and a machine without it can still run the other sources.
"""

from __future__ import annotations

from typing import Any

from posttrain.data.jsonl import ItemsFn
from posttrain.data.table_source import TableSource
from posttrain.data.tables import open_dataset_table


class HFDiskSource(TableSource):
    """Rows of one split of a dataset (on disk or through ``load_dataset``), with the corpus cursor."""

    def __init__(
        self,
        name: str,
        *,
        subset: str | None = None,
        split: str = "train",
        data_files: Any = None,
        prompt_column: str = "prompt",
        response_column: str | None = "answer",
        shuffle: bool = True,
        seed: int = 0,
        system_prompt: str | None = None,
        items_fn: ItemsFn | None = None,
    ) -> None:
        self.name = name
        self.split = split
        table = open_dataset_table(name, subset=subset, split=split, data_files=data_files)
        super().__init__(
            table,
            prompt_column=prompt_column,
            response_column=response_column,
            shuffle=shuffle,
            seed=seed,
            system_prompt=system_prompt,
            items_fn=items_fn,
        )


DatasetSource = HFDiskSource
"""The same class under the name that says what it now reads (not only datasets on disk)."""
