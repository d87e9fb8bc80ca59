"""Data cells: the slice of each collected batch that one policy rank trains on.

With ``POLICY_RANKS`` ranks each is one data cell; the k-th optimizer step of every cell holds its
share of the global k-th mini-batch, so the update equals the one a single process makes on the
whole batch. In one process there is one cell, holding everything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from posttrain.config.schema import RunConfig
from posttrain.errors import ConfigError

BatchT = TypeVar("BatchT")


@dataclass(frozen=True)
class Cells:
    """This process's data cell: ``index`` of ``count`` policy ranks (cell 0 of 1 in one process)."""

    index: int = 0
    count: int = 1

    @property
    def multi(self) -> bool:
        """Whether several policy ranks share the step (every helper below is then a collective)."""
        return self.count > 1


def cell_rows(num_rows: int, *, group_size: int, mini_batch: int, cell: int, cells: int) -> list[int]:
    """Rows of the collected batch that data cell ``cell`` of ``cells`` trains on.

    Each mini-batch (optimizer step) is split into ``cells`` contiguous slices of whole groups, and
    the cell takes its slice of every mini-batch in order. With one mini-batch per collected batch
    this is simply "cell r gets the r-th contiguous slice of groups"; with several, the cell's k-th
    local mini-batch is its slice of the global k-th, so the optimizer steps match one process.
    Uneven cells are refused, not padded: every rank must run the same micro-batches (collectives),
    and the preflight refuses configs whose mini-batch groups do not divide over the policy ranks.
    """
    if not 0 <= cell < cells:
        raise ValueError(f"cell={cell} is outside the {cells} data cells")
    rows: list[int] = []
    for start in range(0, num_rows, mini_batch):
        size = min(mini_batch, num_rows - start)
        if size % (group_size * cells):
            raise ValueError(
                f"a mini-batch of {size} trajectories is not {cells} equal slices of whole groups of "
                f"{group_size}: rl.mini_batch_per_replica (or rl.batch_per_replica) must be a multiple of "
                f"rl.group_size x POLICY_RANKS = {group_size * cells}"
            )
        per_cell = size // cells
        rows.extend(range(start + cell * per_cell, start + (cell + 1) * per_cell))
    return rows


def take_rows(batch: BatchT, rows: list[int]) -> BatchT:
    """A copy of the dataclass ``batch`` (a ``TrainBatch``: ``completion_ids`` counts its rows) holding
    only ``rows``.

    Every list or tensor field is per trajectory and is indexed; a dataclass-valued field (a
    per-feature payload such as ``SamplerHead`` or ``TeacherTopK``) is sliced the same way, field by
    field; other fields (``group_size``, None) are kept. A list or tensor of another length is an
    error, never silently kept whole.
    """
    if not dataclasses.is_dataclass(batch) or isinstance(batch, type):
        raise TypeError(f"take_rows needs a dataclass instance, got {type(batch).__name__}")
    n = len(batch.completion_ids)  # type: ignore[attr-defined]
    return _take(batch, rows, n, type(batch).__name__)


def _take(obj: BatchT, rows: list[int], n: int, where: str) -> BatchT:
    """``obj`` (a dataclass instance) with every per-row list or tensor field, nested payloads
    included, narrowed to ``rows`` of ``n``."""
    index = torch.tensor(rows, dtype=torch.long)
    picked: dict[str, Any] = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            picked[f.name] = _take(value, rows, n, f"{where}.{f.name}")
        elif isinstance(value, (list, Tensor)):
            if len(value) != n:
                raise ValueError(f"{where}.{f.name} has {len(value)} rows, expected {n}")
            picked[f.name] = value[index.to(value.device)] if isinstance(value, Tensor) else [value[i] for i in rows]
    return dataclasses.replace(obj, **picked)  # type: ignore[type-var]


def cell_config(cfg: RunConfig, cells: int) -> RunConfig:
    """The config as one data cell sees it: ``rl.batch_per_replica`` and ``rl.mini_batch_per_replica``
    divided by ``cells`` (the number of optimizer steps, ``n_mini``, is unchanged).
    ``rl.micro_batch_per_replica`` is per rank already and stays."""
    rl = cfg.rl
    if rl.batch_per_replica % cells or rl.mini_batch % cells:
        raise ConfigError(
            [
                f"rl.batch_per_replica={rl.batch_per_replica} and the mini-batch ({rl.mini_batch}) must divide "
                f"evenly over the {cells} data cells (policy ranks)"
            ]
        )
    update: dict[str, Any] = {"batch_per_replica": rl.batch_per_replica // cells}
    if rl.mini_batch_per_replica is not None:
        update["mini_batch_per_replica"] = rl.mini_batch_per_replica // cells
    return cfg.model_copy(update={"rl": rl.model_copy(update=update)})


def cell_group_indices(num_rows: int, *, group_size: int, mini_batch: int, cells: Cells) -> list[int]:
    """Indices of the prompt groups of one collected batch of ``num_rows`` trajectories that data cell
    ``cells.index`` trains on: its slice of whole groups of every mini-batch (``cell_rows``), so the
    k-th optimizer step of every rank holds its share of the global k-th mini-batch, as in one
    process. One cell holds every group, in order (its mini-batches need not be whole groups)."""
    if cells.count == 1:
        return list(range(num_rows // group_size))
    rows = cell_rows(num_rows, group_size=group_size, mini_batch=mini_batch, cell=cells.index, cells=cells.count)
    return [row // group_size for row in rows[::group_size]]
