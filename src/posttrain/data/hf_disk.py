"""Prompts from a Hugging Face dataset saved on local disk (``save_to_disk``); never the hub.

``datasets`` is imported only when such a source is built, so the preflight and ``--help`` stay
light and a machine without it can still run the other sources.
"""

from __future__ import annotations

import os
from typing import Any

from posttrain.data.jsonl import CorpusSource, corpus_provides, row_to_sample
from posttrain.errors import DataError


def _load_split(name: str, split: str) -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise DataError(
            f"rl.data.name={name!r} needs the `datasets` package: pip install 'posttrain[datasets]'"
        ) from exc
    if not os.path.isdir(name):
        raise DataError(f"rl.data.name: {name!r} is not a directory; give a dataset saved with save_to_disk")
    try:
        loaded = datasets.load_from_disk(name)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DataError(
            f"rl.data.name: {name!r} is not a dataset written by Dataset.save_to_disk or "
            f"DatasetDict.save_to_disk ({exc})"
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"rl.data.split: {name!r} has no split {split!r}; it has {sorted(loaded)}")
        return loaded[split]
    return loaded


class HFDiskSource(CorpusSource):
    """Rows of one split of a dataset on disk, with the JSONL source's cursor and row checks."""

    def __init__(
        self,
        name: str,
        *,
        split: str = "train",
        prompt_column: str = "prompt",
        response_column: str | None = "answer",
        shuffle: bool = True,
        seed: int = 0,
        system_prompt: str | None = None,
    ) -> None:
        self.name = name
        self.split = split
        ds = _load_split(name, split)
        for field, column in (("prompt_column", prompt_column), ("response_column", response_column)):
            if column is not None and column not in ds.column_names:
                raise DataError(
                    f"rl.data.{field}: dataset {name!r} split {split!r} has no column {column!r}; "
                    f"its columns are {ds.column_names}"
                )
        # Read only the columns we use: whole-column reads are fast and skip unrelated (possibly
        # large) fields.
        prompts = list(ds[prompt_column])
        responses = list(ds[response_column]) if response_column is not None else [None] * len(prompts)
        base = os.path.basename(os.path.normpath(name))
        samples = []
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            row = {prompt_column: prompt}
            if response_column is not None:
                row[response_column] = response
            samples.append(
                row_to_sample(
                    row,
                    where=f"dataset {name} split {split} row {i}",
                    uid=f"{base}:{split}:{i}",
                    prompt_column=prompt_column,
                    response_column=response_column,
                    system_prompt=system_prompt,
                )
            )
        if not samples:
            raise DataError(f"rl.data.name: dataset {name!r} split {split!r} has no rows")
        super().__init__(samples, shuffle=shuffle, seed=seed, provides=corpus_provides(response_column))
