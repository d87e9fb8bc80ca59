"""Datasets by what they are: ``rl.data.path`` files (.jsonl, .json list or lines, .parquet, .csv,
.arrow, save_to_disk directories), ``rl.data.name`` through ``datasets.load_dataset`` (builders with
``data_files``, hub ids from an offline cache), ``rl.data.items_fn``, every column in the sample's
metadata, named errors for bad files and rows (at any index) and exact resume for each kind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from posttrain.config.loading import build_config
from posttrain.config.schema import DataConfig
from posttrain.data.build import build_data_source, check_data_config, provided_fields
from posttrain.data.rows import check_rows
from posttrain.data.tables import path_format
from posttrain.errors import DataError

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
ITEMS = "pt_dataset_items"


def rows(n: int = 5) -> list[dict[str, Any]]:
    return [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "level": i % 3} for i in range(n)]


def write(kind: str, path: Path, data: list[dict[str, Any]]) -> str:
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
    elif kind == "json":
        path.write_text(json.dumps(data))
    elif kind == "json-lines":
        path.write_text("\n".join(json.dumps(r) for r in data))
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(data), path)
    elif kind == "csv":
        pcsv.write_csv(pa.Table.from_pylist(data), path)
    elif kind == "arrow":
        table = pa.Table.from_pylist(data)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    elif kind == "disk":
        import datasets

        datasets.DatasetDict({"train": datasets.Dataset.from_list(data)}).save_to_disk(str(path))
    return str(path)


SUFFIX = {"json-lines": "json", "disk": "ds"}


@pytest.fixture
def items_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / f"{ITEMS}.py").write_text(
        "def to_prompt(row):\n"
        "    return {'prompt': 'Q: ' + row['question'], 'answer': row['solution'].split('####')[-1].strip(),\n"
        "            'source': row['source']}\n"
        "def broken(row):\n"
        "    raise KeyError('question')\n"
        "def not_a_row(row):\n"
        "    return [row]\n"
        "def edits(row):\n"
        "    row['prompt'] = row['prompt'].upper()\n"
        "    return row\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, ITEMS, raising=False)
    return ITEMS


# ---------------------------------------------------------------- kinds


@pytest.mark.parametrize("kind", ["jsonl", "json", "json-lines", "parquet", "csv", "arrow", "disk"])
def test_every_path_kind_gives_the_same_samples_with_every_column(kind: str, tmp_path: Path) -> None:
    path = write(kind, tmp_path / f"train.{SUFFIX.get(kind, kind)}", rows())
    source = build_data_source(DataConfig(path=path, shuffle=False), data_seed=0)
    batch = source.next_batch(5)
    answer = int if kind == "csv" else str  # CSV cells are typed by pyarrow's inference
    assert [s.prompt for s in batch] == [r["prompt"] for r in rows()]
    assert [s.ground_truth for s in batch] == [answer(r["answer"]) for r in rows()]
    # every column but the prompt reaches the reward, the ground-truth column under its own name
    assert [s.metadata for s in batch] == [{"answer": answer(r["answer"]), "level": r["level"]} for r in rows()]
    first_uid = {"jsonl": "train.jsonl:1", "json-lines": "train.json:1", "disk": "train.ds:train:0"}
    assert batch[0].uid == first_uid.get(kind, f"train.{kind}:0")
    assert source.provides == frozenset({"prompt", "ground_truth"})


def test_path_format_by_extension_and_layout(tmp_path: Path) -> None:
    assert [path_format(p) for p in ("a.JSONL", "b.json", "c.parquet", "d.csv", "e.arrow")] == [
        "jsonl",
        "json",
        "parquet",
        "csv",
        "arrow",
    ]
    assert path_format(write("disk", tmp_path / "ds", rows(1))) == "disk"
    with pytest.raises(DataError, match=r"rl.data.path: \S+x.txt has extension '.txt'; give one of .arrow, .csv"):
        path_format(str(tmp_path / "x.txt"))
    with pytest.raises(DataError, match=r"is not a file, nor a directory written by Dataset.save_to_disk"):
        path_format(str(tmp_path))


@pytest.mark.parametrize("kind", ["parquet", "disk"])
def test_table_sources_resume_exactly(kind: str, tmp_path: Path) -> None:
    path = write(kind, tmp_path / f"t.{SUFFIX.get(kind, kind)}", rows(7))
    cfg = DataConfig(path=path)
    source = build_data_source(cfg, data_seed=3)
    source.next_batch(9)  # into the second (reshuffled) epoch
    state = source.state_dict()
    expected = source.next_batch(6)
    resumed = build_data_source(cfg, data_seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_batch(6) == expected
    assert state == {"epoch": 1, "position": 2, "seed": 3, "num_rows": 7}
    with pytest.raises(DataError, match="saved with data seed 3 but this run uses 4"):
        build_data_source(cfg, data_seed=4).load_state_dict(state)


def test_builder_name_with_data_files_and_per_split_files(tmp_path: Path) -> None:
    train = write("parquet", tmp_path / "train.parquet", rows(4))
    test = write("parquet", tmp_path / "test.parquet", rows(2))
    cfg = DataConfig(name="parquet", data_files={"train": train, "test": test}, split="test", shuffle=False)
    batch = build_data_source(cfg, data_seed=0).next_batch(2)
    assert [s.ground_truth for s in batch] == ["1", "2"]
    assert batch[0].uid == "parquet:test:0" and batch[1].metadata["level"] == 1
    folder = tmp_path / "folder" / "data"
    folder.mkdir(parents=True)
    write("parquet", folder / "train-00000-of-00001.parquet", rows(2))
    by_dir = DataConfig(name=str(tmp_path / "folder"), shuffle=False)
    assert check_data_config(by_dir) == []
    assert [s.ground_truth for s in build_data_source(by_dir, data_seed=0).next_batch(2)] == ["1", "2"]
    jsonl = write("jsonl", tmp_path / "d.jsonl", rows(3))
    single = build_data_source(DataConfig(name="json", data_files=jsonl, shuffle=False), data_seed=0)
    assert [s.prompt for s in single.next_batch(3)] == [r["prompt"] for r in rows(3)]


def _hub_cache(home: Path, repo: str, data: list[dict[str, Any]]) -> None:
    root = home / "hub" / f"datasets--{repo.replace('/', '--')}"
    (root / "snapshots" / COMMIT / "data").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    pq.write_table(pa.Table.from_pylist(data), root / "snapshots" / COMMIT / "data" / "train-00000-of-00001.parquet")


def test_hub_id_from_the_offline_cache_and_a_missing_one_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "hf"
    _hub_cache(home, "org/tiny", rows(3))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    source = build_data_source(DataConfig(name="org/tiny", shuffle=False), data_seed=0)
    assert [s.uid for s in source.next_batch(3)] == ["org/tiny:train:0", "org/tiny:train:1", "org/tiny:train:2"]
    with pytest.raises(DataError) as info:
        build_data_source(DataConfig(name="org/absent"), data_seed=0)
    message = str(info.value)
    assert message == (
        f"rl.data.name='org/absent' split='train': not in the hub cache {home / 'hub'} and HF_HUB_OFFLINE is set, "
        "so nothing is downloaded; fetch it once with a network (hf download org/absent --repo-type dataset) or "
        "point rl.data.path at local files"
    )
    with pytest.raises(DataError, match=r"rl.data.split: rl.data.name='org/tiny' split='test': .*Unknown split"):
        build_data_source(DataConfig(name="org/tiny", split="test"), data_seed=0)


def test_hub_subsets_come_from_the_dataset_card(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gsm8k-like repo: two subsets (configs) declared in README.md, each with its own files."""
    home = tmp_path / "hf"
    _hub_cache(home, "org/two", rows(2))
    snapshot = home / "hub" / "datasets--org--two" / "snapshots" / COMMIT
    (snapshot / "data" / "train-00000-of-00001.parquet").unlink()
    for subset, n in (("main", 2), ("socratic", 3)):
        (snapshot / subset).mkdir()
        pq.write_table(pa.Table.from_pylist(rows(n)), snapshot / subset / "train-00000-of-00001.parquet")
    (snapshot / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "- config_name: socratic\n  data_files:\n  - split: train\n    path: socratic/train-*\n---\n"
    )
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    for subset, n in (("main", 2), ("socratic", 3)):
        source = build_data_source(DataConfig(name="org/two", subset=subset), data_seed=0)
        assert source.state_dict()["num_rows"] == n


# ---------------------------------------------------------------- items_fn


def test_items_fn_maps_raw_rows(tmp_path: Path, items_module: str) -> None:
    raw = [{"question": f"q{i}", "solution": f"work\n#### {i}", "source": "s"} for i in range(3)]
    path = write("parquet", tmp_path / "raw.parquet", raw)
    cfg = DataConfig(path=path, items_fn=f"{items_module}:to_prompt", shuffle=False)
    assert check_data_config(cfg) == []
    batch = build_data_source(cfg, data_seed=0).next_batch(3)
    assert [(s.prompt, s.ground_truth, s.metadata) for s in batch] == [
        (f"Q: q{i}", str(i), {"answer": str(i), "source": "s"}) for i in range(3)
    ]
    # what a reward may require: the mapped row's columns
    assert provided_fields(cfg) == frozenset({"prompt", "ground_truth", "answer", "source"})
    jsonl = build_data_source(DataConfig(path=write("jsonl", tmp_path / "raw.jsonl", raw), items_fn=cfg.items_fn), 0)
    assert sorted(s.prompt for s in jsonl.next_batch(3)) == ["Q: q0", "Q: q1", "Q: q2"]


def test_items_fn_is_pure_per_row_and_its_failures_name_the_row(tmp_path: Path, items_module: str) -> None:
    path = write("json", tmp_path / "r.json", rows(3))
    source = build_data_source(DataConfig(path=path, items_fn=f"{items_module}:edits", shuffle=False), 0)
    assert [s.prompt for s in source.next_batch(1)] == ["WHAT IS 0 + 1?"]
    with pytest.raises(DataError, match=rf"r.json row 0: rl.data.items_fn {items_module}:broken raised KeyError"):
        build_data_source(DataConfig(path=path, items_fn=f"{items_module}:broken"), 0)
    with pytest.raises(DataError, match=r"r.json row 0: rl.data.items_fn \S+:not_a_row returned list"):
        build_data_source(DataConfig(path=path, items_fn=f"{items_module}:not_a_row"), 0)
    [problem] = check_data_config(DataConfig(path=path, items_fn=f"{items_module}:nope"))
    assert problem.startswith(f"rl.data.items_fn: module '{items_module}' has no attribute 'nope'")


def test_knobs_that_contradict_are_refused() -> None:
    assert check_data_config(DataConfig(items_fn="m:f")) == [
        "rl.data.items_fn maps the rows of rl.data.path, rl.data.name or rl.data.factory; the built-in "
        "arithmetic generator has none: set a data source or drop rl.data.items_fn"
    ]
    problems = check_data_config(DataConfig(path="x.parquet", subset="main", data_files="a.parquet"))
    assert [p.split(" is read")[0] for p in problems] == ["rl.data.subset", "rl.data.data_files"]
    with pytest.raises(DataError, match=r"rl\.data\.subset is read only with rl\.data\.name"):
        build_data_source(DataConfig(path="x.parquet", subset="main"), 0)


# ---------------------------------------------------------------- malformed input


def test_bad_files_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    for cfg in (DataConfig(path=str(bad)), DataConfig(name="parquet", data_files=str(bad))):
        with pytest.raises(DataError, match=r"bad.parquet"):
            build_data_source(cfg, 0)
    [problem] = check_data_config(DataConfig(path=str(bad)))
    assert problem.startswith(f"rl.data.path: {bad} is not a readable Parquet file (")
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("prompt,answer\nhi,1\nthere,2,3\n")
    [problem] = check_data_config(DataConfig(path=str(ragged)))
    assert problem.startswith(f"rl.data.path: {ragged} is not a readable CSV file with a header row (")
    not_list = tmp_path / "obj.json"
    not_list.write_text("[1, 2")
    assert check_data_config(DataConfig(path=str(not_list))) == [
        f"rl.data.path: {not_list}: not valid JSON (Expecting ',' delimiter at column 6)"
    ]
    assert check_data_config(DataConfig(path=str(tmp_path / "gone.parquet"))) == [
        f"rl.data.path: {tmp_path / 'gone.parquet'} does not exist"
    ]


def test_missing_columns_are_named_with_the_columns_there(tmp_path: Path) -> None:
    path = write("parquet", tmp_path / "q.parquet", [{"question": "x", "answer": "1"}])
    message = f"rl.data.prompt_column: {path} has no column 'prompt'; its columns are ['question', 'answer']"
    assert check_data_config(DataConfig(path=path)) == [message]
    with pytest.raises(DataError) as info:
        build_data_source(DataConfig(path=path), 0)
    assert str(info.value) == message
    assert check_data_config(DataConfig(path=path, prompt_column="question", response_column="solution")) == [
        f"rl.data.response_column: {path} has no column 'solution'; its columns are ['question', 'answer']"
    ]


def _rows_problems(tmp_path: Path, *overrides: str) -> list[str]:
    cfg = build_config(None, [f"model.name_or_path={tmp_path / 'no_model'}", "rl.reward=exact_match", *overrides])
    return check_rows(cfg)


def test_every_bad_row_is_named_by_file_and_index(tmp_path: Path) -> None:
    data = rows(6)
    data[2]["prompt"] = None  # a null in a string column
    data[4]["prompt"] = ""
    path = write("parquet", tmp_path / "typed.parquet", data)
    assert _rows_problems(tmp_path, f"rl.data.path={path}") == [
        f"{path} row 2: column 'prompt' must be a string or a list of chat messages, got NoneType None",
        f"{path} row 4: column 'prompt' is an empty string; give the prompt text",
    ]
    # the run's build names the first of them, before any model loads
    with pytest.raises(DataError, match=r"typed.parquet row 2: column 'prompt' must be a string"):
        build_data_source(DataConfig(path=path), 0)
    ints = write("parquet", tmp_path / "ints.parquet", [{"prompt": i, "answer": "1"} for i in range(3)])
    assert _rows_problems(tmp_path, f"rl.data.path={ints}")[1] == (
        f"{ints} row 1: column 'prompt' must be a string or a list of chat messages, got int 1"
    )
    listed = write("json", tmp_path / "mixed.json", [*rows(3), [1, 2], {"prompt": "ok", "answer": None}])
    assert _rows_problems(tmp_path, f"rl.data.path={listed}") == [
        f"{listed} row 3: expected an object (JSON object / dict) per row, got list [1, 2]",
        f"{listed} row 4: response column 'answer' is null (row has ['answer', 'prompt']); set "
        "rl.data.response_column to the ground-truth column, or to null when the reward needs none",
    ]


def test_the_row_pass_covers_datasets_by_name(tmp_path: Path) -> None:
    data = rows(4)
    data[3]["answer"] = None
    path = write("parquet", tmp_path / "n.parquet", data)
    problems = _rows_problems(tmp_path, "rl.data.name=parquet", f"rl.data.data_files={path}")
    assert len(problems) == 1
    assert problems[0].startswith("dataset parquet split train row 3: response column 'answer' is null")
    [problem] = _rows_problems(tmp_path, "rl.data.name=parquet", f"rl.data.data_files={path}", "rl.data.split=dev")
    assert problem.startswith("rl.data.split: rl.data.name='parquet' split='dev' data_files=")
    assert problem.endswith("Should be one of ['train'].; set rl.data.split to one of them")


def test_provided_fields_name_the_columns_of_local_files(tmp_path: Path) -> None:
    path = write("parquet", tmp_path / "p.parquet", rows(1))
    assert provided_fields(DataConfig(path=path)) == frozenset({"prompt", "ground_truth", "answer", "level"})
    jsonl = write("jsonl", tmp_path / "p.jsonl", rows(1))
    assert provided_fields(DataConfig(path=jsonl, response_column=None)) == frozenset({"prompt", "answer", "level"})


def test_check_data_config_of_tables_imports_neither_torch_nor_datasets(tmp_path: Path) -> None:
    paths = [write(kind, tmp_path / f"d.{kind}", rows(2)) for kind in ("parquet", "csv", "json")]
    code = (
        "import sys\n"
        "from posttrain.config.schema import DataConfig\n"
        "from posttrain.data.build import check_data_config, provided_fields\n"
        f"for path in {paths!r}:\n"
        "    assert check_data_config(DataConfig(path=path)) == [], path\n"
        "    assert 'level' in provided_fields(DataConfig(path=path))\n"
        "print(sorted(m for m in ('torch', 'datasets') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
