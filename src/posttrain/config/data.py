"""The ``rl.data`` section: which prompt source a run reads and how its rows become prompts.

Kept in its own module so that ``config/schema.py`` stays small; ``schema`` re-exports
``DataConfig`` and ``ArithmeticOp``. Like every config module it imports nothing above config.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from posttrain.config.section import Section
from posttrain.config.vision import ImageDataConfig

ArithmeticOp = Literal["+", "-", "*"]

DataFiles = str | list[str] | dict[str, str | list[str]]
"""What ``datasets.load_dataset(data_files=...)`` takes: one file, a list, or files per split."""


class DataConfig(Section):
    """The prompt source. Leave ``path``, ``name`` and ``factory`` unset for the arithmetic generator."""

    path: str | None = None
    """A local file or directory, read by what it is: ``.jsonl``; ``.json`` (a list of rows, or JSON
    lines); ``.parquet``; ``.csv``; ``.arrow``; a ``save_to_disk`` directory (its ``split``)."""
    name: str | None = None
    """A dataset for ``datasets.load_dataset``: a hub id (``org/name``, found in the cache under
    ``HF_HOME``; set ``HF_HUB_OFFLINE=1`` to stay offline), a builder (``parquet``, ``json``, ``csv``
    with ``data_files``), or a ``save_to_disk`` directory."""
    subset: str | None = None
    """The dataset's configuration (subset) name, e.g. ``main`` for ``openai/gsm8k``."""
    split: str = "train"
    """The split to read (of a hub dataset, a builder's ``data_files``, or a ``DatasetDict`` on disk)."""
    data_files: DataFiles | None = None
    """Files for a builder ``name`` (``parquet``/``json``/``csv``): one path, a list, or ``{split: paths}``."""
    factory: str | None = None
    """``module:function`` returning an iterable of rows (dicts) or of ``PromptSample``s."""
    items_fn: str | None = None
    """``module:function`` mapping each raw row (a dict) to a row dict in the prompt / ground-truth
    shape (``prompt_column``, ``response_column``, any other columns); pure, called once per row."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string or a chat-message list."""
    response_column: str | None = "answer"
    """Column holding the ground truth the reward compares against; ``null`` when there is none."""
    shuffle: bool = True
    """Permute the corpus with ``data seed + epoch`` each epoch."""
    system_prompt: str | None = None
    """A system message put in front of every prompt."""
    arithmetic_min: int = 1
    """Arithmetic generator: smallest operand."""
    arithmetic_max: int = 20
    """Arithmetic generator: largest operand."""
    arithmetic_ops: list[ArithmeticOp] = Field(default_factory=lambda: list[ArithmeticOp](["+"]))
    """Arithmetic generator: operators to draw from."""
    arithmetic_template: str = "What is {a} {op} {b}? Reply with only the number."
    """Arithmetic generator: the question, with ``{a}``, ``{op}`` and ``{b}`` filled in."""
    images: ImageDataConfig = Field(default_factory=ImageDataConfig)
    """Rows with images, for a vision-language policy (``config/vision.py``, docs/multimodal.md)."""

    @property
    def kind(self) -> Literal["arithmetic", "jsonl", "file", "dataset", "factory"]:
        """Which source these fields select (``jsonl`` for a ``.jsonl`` path, ``file`` for any other path)."""
        if self.path is not None:
            return "jsonl" if self.path.lower().endswith(".jsonl") else "file"
        if self.name is not None:
            return "dataset"
        if self.factory is not None:
            return "factory"
        return "arithmetic"
