"""Two GRPO steps from each kind of dataset a user already has: a hub id found offline in a
hand-built Hugging Face cache (with an ``items_fn`` mapping gsm8k-shaped rows), and ``.parquet``,
``.csv`` and ``.json`` files by ``rl.data.path``; a custom reward reads an extra column of every
row; malformed input is refused, naming the file and row, before the model loads."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from posttrain.config.loading import build_config
from posttrain.errors import DataError
from posttrain.loop.grpo import train

RunOverrides = Callable[..., list[str]]
COMMIT = "0123456789abcdef0123456789abcdef01234567"

REWARD_MODULE = '''
from posttrain.rewards.base import RewardInput

SEEN = []


def level_reward(sample: RewardInput) -> float:
    """Records the row's extra column and ground truth; scores the completion length."""
    SEEN.append((sample.metadata["level"], sample.ground_truth))
    return min(1.0, len(sample.completion) / 100.0)
'''


def rows(n: int = 6) -> list[dict[str, object]]:
    return [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "level": 10 + i} for i in range(n)]


def hub_rows(n: int = 6) -> list[dict[str, object]]:
    """gsm8k-shaped rows: the answer is worked text ending in ``#### N``."""
    return [
        {"question": f"Add {i} and 2.", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}", "level": 10 + i} for i in range(n)
    ]


def gsm8k_items(row: dict[str, object]) -> dict[str, object]:
    """The ``items_fn`` of the hub run: question -> prompt, the number after ``####`` -> answer."""
    return {"prompt": row["question"], "answer": str(row["answer"]).split("####")[-1].strip(), "level": row["level"]}


def build_hub_cache(home: Path, repo: str, table: pa.Table) -> Path:
    """``$HF_HOME/hub/datasets--org--name`` as huggingface_hub lays it out: ``refs/main`` naming a
    snapshot that holds ``data/train-00000-of-00001.parquet``."""
    root = home / "hub" / f"datasets--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / COMMIT / "data"
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    pq.write_table(table, snapshot / "train-00000-of-00001.parquet")
    return root


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """A fresh ``pt_level_reward`` module (importable from ``tmp_path``) whose ``SEEN`` lists what the
    reward saw."""
    (tmp_path / "pt_level_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pt_level_reward", raising=False)
    import pt_level_reward

    return pt_level_reward


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _overrides(model: str, out: Path, name: str, run_overrides: RunOverrides, *extra: str) -> list[str]:
    return run_overrides(
        model, out, name, "rl.max_steps=2", "rl.reward=pt_level_reward:level_reward", "rl.save_every=0", *extra
    )


def test_two_steps_from_a_hub_id_in_the_offline_cache_with_items_fn(
    tiny_model_dir: str,
    tmp_path: Path,
    run_overrides: RunOverrides,
    reward_module: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    home = tmp_path / "hf_home"
    build_hub_cache(home, "org/tiny-math", pa.Table.from_pylist(hub_rows()))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "pt_items.py").write_text(
        "def gsm8k_items(row):\n"
        "    answer = row['answer'].split('####')[-1].strip()\n"
        "    return {'prompt': row['question'], 'answer': answer, 'level': row['level']}\n"
    )
    cfg = build_config(
        None,
        _overrides(
            tiny_model_dir,
            tmp_path,
            "hub",
            run_overrides,
            "rl.data.name=org/tiny-math",
            "rl.data.items_fn=pt_items:gsm8k_items",
        ),
    )
    run_dir = train(cfg)
    assert _steps(run_dir) == [1, 2]
    seen = reward_module.SEEN  # type: ignore[attr-defined]
    # 2 steps x 2 prompts x 4 completions; each saw its own row's level and mapped ground truth
    assert len(seen) == 16
    expected = {(r["level"], gsm8k_items(r)["answer"]) for r in hub_rows()}
    assert set(seen) <= expected and len(set(seen)) == 4
    assert all(level - 10 + 2 == int(truth) for level, truth in seen)
    # the prepared dataset went to the datasets cache under this HF_HOME, nothing was fetched
    assert (home / "datasets").is_dir()


def _write(kind: str, path: Path, data: list[dict[str, object]]) -> None:
    table = pa.Table.from_pylist(data)
    if kind == "parquet":
        pq.write_table(table, path)
    elif kind == "csv":
        pcsv.write_csv(table, path)
    else:
        path.write_text(json.dumps(data, indent=1))


@pytest.mark.parametrize("kind", ["parquet", "csv", "json"])
def test_two_steps_from_a_file_and_the_reward_reads_an_extra_column(
    kind: str, tiny_model_dir: str, tmp_path: Path, run_overrides: RunOverrides, reward_module: object
) -> None:
    path = tmp_path / f"train.{kind}"
    _write(kind, path, rows())
    cfg = build_config(
        None, _overrides(tiny_model_dir, tmp_path, kind, run_overrides, f"rl.data.path={path}", "rl.data.shuffle=false")
    )
    assert _steps(train(cfg)) == [1, 2]
    seen = reward_module.SEEN  # type: ignore[attr-defined]
    # unshuffled: step 1 reads rows 0-1, step 2 rows 2-3, each prompt's 4 completions in turn; CSV
    # cells are typed by pyarrow's inference (as datasets' csv builder does): the answers read as ints
    typed = int if kind == "csv" else str
    want = [(r["level"], typed(r["answer"])) for r in rows()[:4] for _ in range(4)]
    assert seen == want


@pytest.mark.parametrize(
    ("kind", "make", "message"),
    [
        (
            "parquet",
            lambda p: p.write_bytes(b"PAR1 not really parquet"),
            r"train.parquet is not a readable Parquet file",
        ),
        (
            "parquet",
            lambda p: pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "1"}]), p),
            r"rl.data.prompt_column: \S+train.parquet has no column 'prompt'; its columns are \['question', 'answer'\]",
        ),
        (
            "json",
            lambda p: p.write_text(json.dumps([*rows(3), {"prompt": 7, "answer": "8"}])),
            r"train.json row 3: column 'prompt' must be a string or a list of chat messages, got int 7",
        ),
    ],
)
def test_malformed_input_is_named_before_the_model_loads(
    kind: str, make: Callable[[Path], object], message: str, tmp_path: Path, run_overrides: RunOverrides
) -> None:
    path = tmp_path / f"train.{kind}"
    make(path)
    # A model directory that does not exist: had the model loaded first, its error would come instead.
    missing_model = str(tmp_path / "no_model_here")
    cfg = build_config(None, run_overrides(missing_model, tmp_path, "bad", f"rl.data.path={path}", "rl.max_steps=1"))
    with pytest.raises(DataError, match=message):
        train(cfg)
