"""Rows of local table files and Hugging Face datasets, opened by what they are.

``path_format`` tells a ``rl.data.path`` apart by extension or directory layout; ``open_path_table``
and ``open_dataset_table`` open one as a ``RowTable``: its column names, how its rows are named in
errors (``data.parquet row 3``, ``dataset org/name split train row 3``) and an iterator over its rows
as plain dicts. The reading is pyarrow's and ``datasets``' (both imported only here, when such a
source is used); every way a file can fail to open is a ``DataError`` naming the file and the fix.
JSONL (and ``.json`` holding JSON lines) stays with ``posttrain.data.jsonl``, which names lines.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from posttrain.errors import DataError

PathFormat = Literal["jsonl", "json", "parquet", "csv", "arrow", "disk"]
EXTENSIONS: dict[str, PathFormat] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
_BATCH = 1024


@dataclass
class RowTable:
    """One opened table: ``label`` names it in errors, ``uid_prefix`` starts each row's uid."""

    label: str
    uid_prefix: str
    columns: list[str]
    num_rows: int
    batches: Callable[[], Iterator[list[dict[str, Any]]]]

    def where(self, index: int) -> str:
        """How row ``index`` (0-based) is named in errors."""
        return f"{self.label} row {index}"

    def rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(index, row)`` for every row, read batch by batch."""
        index = 0
        for batch in self.batches():
            for row in batch:
                yield index, row
                index += 1


def is_disk_dataset(path: str) -> bool:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, meta)) for meta in ("dataset_dict.json", "state.json")
    )


def path_format(path: str) -> PathFormat:
    """What ``rl.data.path`` holds, by its extension or directory layout; ``DataError`` when unknown."""
    if os.path.isdir(path):
        if is_disk_dataset(path):
            return "disk"
        raise DataError(
            f"rl.data.path: {path} is not a file, nor a directory written by Dataset.save_to_disk or "
            "DatasetDict.save_to_disk (no dataset_dict.json or state.json); point at a file, or load a "
            "directory of parquet/json/csv files with rl.data.name=parquet and rl.data.data_files"
        )
    ext = os.path.splitext(path)[1].lower()
    if ext in EXTENSIONS:
        return EXTENSIONS[ext]
    known = ", ".join(sorted(EXTENSIONS))
    raise DataError(
        f"rl.data.path: {path} has extension {ext or '(none)'!r}; give one of {known} or a save_to_disk "
        "directory (or load it with rl.data.name=<builder> and rl.data.data_files)"
    )


def json_holds_list(path: str) -> bool:
    """A ``.json`` file whose first non-blank character is ``[`` holds a list of rows; else JSON lines."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    except OSError as exc:
        raise DataError(f"rl.data.path: cannot read {path}: {exc}") from exc
    return head.startswith(b"[")


def _arrow_batches(table: Any) -> Callable[[], Iterator[list[dict[str, Any]]]]:
    return lambda: (batch.to_pylist() for batch in table.to_batches(max_chunksize=_BATCH))


def _from_arrow(table: Any, label: str, uid_prefix: str) -> RowTable:
    return RowTable(label, uid_prefix, list(table.column_names), table.num_rows, _arrow_batches(table))


def _read_parquet(path: str) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except Exception as exc:  # pyarrow's ArrowInvalid / OSError: not parquet, truncated, unreadable
        raise DataError(
            f"rl.data.path: {path} is not a readable Parquet file ({exc}); write it with "
            "pandas.DataFrame.to_parquet / pyarrow.parquet.write_table, or fix the extension"
        ) from None


def _read_csv(path: str) -> Any:
    import pyarrow.csv as pcsv

    try:
        return pcsv.read_csv(path)
    except Exception as exc:  # pyarrow's ArrowInvalid: ragged rows, bad quoting, not UTF-8, empty
        raise DataError(f"rl.data.path: {path} is not a readable CSV file with a header row ({exc})") from None


def _read_arrow(path: str) -> Any:
    import pyarrow as pa

    try:
        # Not closed: the table's buffers point into the mapping (what datasets does with its cache files).
        source = pa.memory_map(path)
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).read_all()
    except Exception as exc:
        raise DataError(f"rl.data.path: {path} is not a readable Arrow (IPC) file ({exc})") from None


def _read_json_list(path: str) -> list[Any]:
    from posttrain.data.jsonl import decode_json_row

    try:
        with open(path, encoding="utf-8-sig") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"rl.data.path: cannot read JSON file {path} as UTF-8 text: {exc}") from None
    rows = decode_json_row(text, f"{path}")
    if not isinstance(rows, list):
        raise DataError(f"rl.data.path: {path} must hold a JSON list of row objects, got {type(rows).__name__}")
    return rows


def _disk_split(path: str, split: str, what: str) -> Any:
    datasets = _datasets(what, path)
    try:
        loaded = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DataError(
            f"{what}: {path!r} is not a dataset written by Dataset.save_to_disk or DatasetDict.save_to_disk ({exc})"
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"rl.data.split: {path!r} has no split {split!r}; it has {sorted(loaded)}")
        return loaded[split]
    return loaded


def _datasets(what: str, value: str) -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise DataError(f"{what}={value!r} needs the `datasets` package: pip install 'posttrain[datasets]'") from exc
    return datasets


def _from_dataset(ds: Any, label: str, uid_prefix: str) -> RowTable:
    arrow = ds.with_format("arrow")
    return RowTable(
        label,
        uid_prefix,
        list(ds.column_names),
        len(ds),
        lambda: (batch.to_pylist() for batch in arrow.iter(batch_size=_BATCH)),
    )


def open_path_table(path: str, split: str = "train") -> RowTable:
    """A non-JSONL ``rl.data.path`` as a ``RowTable`` (``path_format`` says which reader)."""
    if not os.path.exists(path):
        raise DataError(f"rl.data.path: {path} does not exist")
    fmt = path_format(path)
    base = os.path.basename(os.path.normpath(path))
    if fmt == "parquet":
        return _from_arrow(_read_parquet(path), path, base)
    if fmt == "csv":
        return _from_arrow(_read_csv(path), path, base)
    if fmt == "arrow":
        return _from_arrow(_read_arrow(path), path, base)
    if fmt == "disk":
        ds = _disk_split(path, split, "rl.data.path")
        return _from_dataset(ds, f"dataset {path} split {split}", f"{base}:{split}")
    if fmt == "json" and json_holds_list(path):
        rows = _read_json_list(path)
        columns = sorted({str(k) for row in rows if isinstance(row, dict) for k in row})
        return RowTable(path, base, columns, len(rows), lambda: iter([rows]))
    raise DataError(f"rl.data.path: {path} holds JSON lines; read it with posttrain.data.jsonl")  # jsonl: caller's


def has_data_files(directory: str) -> bool:
    """``directory`` holds a file ``datasets.load_dataset`` could read (by extension), at any depth."""
    return any(os.path.splitext(f)[1].lower() in EXTENSIONS for _, _, files in os.walk(directory) for f in files)


def looks_like_path(name: str) -> bool:
    """``rl.data.name`` meant as a local directory: it exists, or is written as a path (``/``, ``.``, ``~``)."""
    return os.path.exists(name) or name.startswith(("/", ".", "~"))


def hub_cache_dir() -> str:
    """The hub cache, read from the environment now (``HF_HUB_CACHE``, else ``$HF_HOME/hub``), not
    from the constants ``huggingface_hub`` froze when it was first imported."""
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` is set to a true value (read now)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cached_hub_snapshot(name: str) -> str | None:
    """The local snapshot directory of hub dataset ``name`` (its ``main`` ref) in the hub cache, or None."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        found = snapshot_download(name, repo_type="dataset", cache_dir=hub_cache_dir(), local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or not a valid repo id
        return None
    return str(found) if isinstance(found, str) and os.path.isdir(found) else None


class NotInHubCacheError(LookupError):
    """An offline run asked for a hub dataset that has no snapshot in the hub cache."""


def _load(datasets: Any, name: str, subset: str | None, split: str, data_files: Any) -> Any:
    """``load_dataset``; a hub id is read from its cached snapshot when offline (``datasets`` itself
    would look only at its own cache of prepared datasets) or when the hub cannot be reached."""
    home = os.environ.get("HF_HOME")
    cache_dir = os.environ.get("HF_DATASETS_CACHE") or (os.path.join(home, "datasets") if home else None)
    packaged = name in _packaged_builders(datasets)
    if not packaged and hub_offline() and not os.path.isdir(name):
        # Decided here, from the environment as it is now: `datasets` reads HF_HUB_OFFLINE once, at
        # import, and would otherwise try the network.
        snapshot = cached_hub_snapshot(name)
        if snapshot is None:
            raise NotInHubCacheError(name)
        return datasets.load_dataset(snapshot, subset, split=split, data_files=data_files, cache_dir=cache_dir)
    try:
        return datasets.load_dataset(name, subset, split=split, data_files=data_files, cache_dir=cache_dir)
    except ConnectionError:
        snapshot = None if packaged else cached_hub_snapshot(name)
        if snapshot is None:
            raise
        return datasets.load_dataset(snapshot, subset, split=split, data_files=data_files, cache_dir=cache_dir)


def _packaged_builders(datasets: Any) -> set[str]:
    try:
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
    except ImportError:
        return {"parquet", "json", "csv", "arrow", "text"}
    return set(_PACKAGED_DATASETS_MODULES)


def open_dataset_table(
    name: str, *, subset: str | None = None, split: str = "train", data_files: Any = None
) -> RowTable:
    """``rl.data.name`` as a ``RowTable``: a ``save_to_disk`` directory, else ``datasets.load_dataset``."""
    if looks_like_path(name) and data_files is None and (is_disk_dataset(name) or not os.path.isdir(name)):
        if not os.path.isdir(name):
            raise DataError(f"rl.data.name: {name!r} is not a directory; give a dataset saved with save_to_disk")
        ds = _disk_split(name, split, "rl.data.name")
        return _from_dataset(ds, f"dataset {name} split {split}", f"{os.path.basename(os.path.normpath(name))}:{split}")
    datasets = _datasets("rl.data.name", name)
    try:
        ds = _load(datasets, name, subset, split, data_files)
    except Exception as exc:  # hub/cache/builder errors of every kind: name what was asked and where
        if os.path.isdir(name) and data_files is None:
            raise DataError(
                f"rl.data.name: {name!r} is not a dataset written by Dataset.save_to_disk or DatasetDict.save_to_disk, "
                f"nor a directory of data files datasets.load_dataset reads ({type(exc).__name__}: {exc})"
            ) from None
        raise DataError(
            _load_problem(name, subset, split, data_files, exc, packaged=name in _packaged_builders(datasets))
        ) from None
    label = f"dataset {name}" + (f" subset {subset}" if subset else "") + f" split {split}"
    return _from_dataset(ds, label, f"{name}:{split}")


def _load_problem(name: str, subset: str | None, split: str, data_files: Any, exc: Exception, *, packaged: bool) -> str:
    asked = f"rl.data.name={name!r}" + (f" subset={subset!r}" if subset else "") + f" split={split!r}"
    if data_files is not None:
        asked += f" data_files={json.dumps(data_files)}"
    cache = hub_cache_dir()
    fetch = (
        f"fetch it once with a network (hf download {name} --repo-type dataset) or point rl.data.path at local files"
    )
    if isinstance(exc, NotInHubCacheError):
        return f"{asked}: not in the hub cache {cache} and HF_HUB_OFFLINE is set, so nothing is downloaded; {fetch}"
    failed = f"datasets.load_dataset failed: {type(exc).__name__}: {exc}"
    if isinstance(exc, ValueError) and str(exc).startswith("Unknown split"):
        return f"rl.data.split: {asked}: {failed}; set rl.data.split to one of them"
    if packaged:
        hint = f"check rl.data.data_files (the files the {name!r} builder reads)"
    elif hub_offline():
        hint = f"HF_HUB_OFFLINE is set, so only the hub cache {cache} is searched: {fetch}"
    else:
        hint = f"check the name, subset and split (the hub cache is {cache})"
    return f"{asked}: {failed}; {hint}"
