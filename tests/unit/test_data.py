"""Prompt sources: arithmetic, JSONL, datasets on disk and factories; their cursors and the preflight."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from posttrain.config.schema import DataConfig
from posttrain.data.arithmetic import ArithmeticSource
from posttrain.data.base import DataSource, PromptSample
from posttrain.data.build import build_data_source, check_data_config, provided_fields
from posttrain.data.factory import FactorySource
from posttrain.data.hf_disk import HFDiskSource
from posttrain.data.jsonl import JsonlSource
from posttrain.errors import DataError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

SYSTEM = "You are terse."


def write_jsonl(path: Path, lines: list[Any]) -> str:
    """Write ``lines`` (objects are JSON-encoded, strings written verbatim) and return the path."""
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    path.write_text(text + "\n", encoding="utf-8")
    return str(path)


def rows(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"question {i}", "answer": i} for i in range(n)]


def truths(batch: list[PromptSample]) -> list[Any]:
    return [s.ground_truth for s in batch]


# ---------------------------------------------------------------- arithmetic

QUESTION_RE = re.compile(r"What is (\d+) ([-+*]) (\d+)\? Reply with only the number\.")


def test_arithmetic_answers_are_right_and_in_range() -> None:
    src = ArithmeticSource(3, min_operand=2, max_operand=9, ops=["+", "-", "*"])
    batch = src.next_batch(300)
    seen_ops = set()
    for i, sample in enumerate(batch):
        assert isinstance(sample.prompt, str)
        match = QUESTION_RE.fullmatch(sample.prompt)
        assert match, sample.prompt
        a, op, b = int(match[1]), match[2], int(match[3])
        assert 2 <= a <= 9 and 2 <= b <= 9
        assert sample.ground_truth == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert isinstance(sample.ground_truth, int)
        assert sample.uid == f"arith:{i}"
        seen_ops.add(op)
    assert seen_ops == {"+", "-", "*"}
    assert src.provides == frozenset({"prompt", "ground_truth"})
    assert isinstance(src, DataSource)


def test_arithmetic_is_a_function_of_seed_and_index() -> None:
    one = ArithmeticSource(7).next_batch(20)
    chunked = ArithmeticSource(7)
    assert chunked.next_batch(5) + chunked.next_batch(0) + chunked.next_batch(15) == one
    assert ArithmeticSource(7).sample(13) == one[13]
    assert ArithmeticSource(8).next_batch(20) != one


def test_arithmetic_resume_and_system_prompt() -> None:
    src = ArithmeticSource(1, system_prompt=SYSTEM)
    src.next_batch(6)
    state = json.loads(json.dumps(src.state_dict()))  # survives a JSON checkpoint
    expected = src.next_batch(4)
    resumed = ArithmeticSource(1, system_prompt=SYSTEM)
    resumed.load_state_dict(state)
    assert resumed.next_batch(4) == expected
    assert isinstance(expected[0].prompt, list)
    system, user = expected[0].prompt
    assert isinstance(system, dict) and isinstance(user, dict)
    assert system == {"role": "system", "content": SYSTEM}
    assert user["role"] == "user" and QUESTION_RE.fullmatch(user["content"])
    with pytest.raises(DataError, match="data seed 1 but this run uses 2"):
        ArithmeticSource(2).load_state_dict(state)


def test_arithmetic_rejects_bad_settings() -> None:
    with pytest.raises(DataError, match=r"arithmetic_min \(9\) is larger than rl.data.arithmetic_max \(3\)"):
        ArithmeticSource(0, min_operand=9, max_operand=3)
    with pytest.raises(DataError, match="unknown fields \\['c'\\]"):
        ArithmeticSource(0, template="{a} {op} {c}")
    with pytest.raises(DataError, match="arithmetic_ops is empty"):
        ArithmeticSource(0, ops=[])


# ---------------------------------------------------------------- JSONL


def test_jsonl_string_and_chat_prompts(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "hi"}]
    chat_with_system = [{"role": "system", "content": "own"}, {"role": "user", "content": "yo"}]
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"prompt": "plain", "answer": "1", "extra": [1, 2]},
            "",
            {"prompt": chat, "answer": {"nums": [1], "target": 1}},
            {"prompt": chat_with_system, "answer": 3},
        ],
    )
    batch = JsonlSource(path, shuffle=False).next_batch(3)
    assert [s.prompt for s in batch] == ["plain", chat, chat_with_system]
    assert truths(batch) == ["1", {"nums": [1], "target": 1}, 3]
    assert [s.uid for s in batch] == ["mixed.jsonl:1", "mixed.jsonl:3", "mixed.jsonl:4"]

    sys_batch = JsonlSource(path, shuffle=False, system_prompt=SYSTEM).next_batch(3)
    system = {"role": "system", "content": SYSTEM}
    assert sys_batch[0].prompt == [system, {"role": "user", "content": "plain"}]
    assert sys_batch[1].prompt == [system, *chat]
    assert sys_batch[2].prompt == chat_with_system  # the row's own system message is kept


def test_jsonl_without_response_column(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    src = JsonlSource(path, prompt_column="messages", response_column=None)
    assert src.provides == frozenset({"prompt"})
    assert src.next_batch(2)[1].ground_truth is None
    with_answer = JsonlSource(write_jsonl(tmp_path / "q.jsonl", rows(2)))
    assert with_answer.provides == frozenset({"prompt", "ground_truth"})


def test_jsonl_in_file_order_wraps_around(tmp_path: Path) -> None:
    src = JsonlSource(write_jsonl(tmp_path / "d.jsonl", rows(5)), shuffle=False)
    assert truths(src.next_batch(3)) == [0, 1, 2]
    assert truths(src.next_batch(4)) == [3, 4, 0, 1]
    assert truths(src.next_batch(11)) == [2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]
    assert src.state_dict()["epoch"] == 3 and src.state_dict()["position"] == 3


def test_jsonl_shuffle_is_a_fresh_permutation_per_seed_and_epoch(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", rows(20))

    def epochs(seed: int, count: int) -> list[list[int]]:
        src = JsonlSource(path, seed=seed)
        return [truths(src.next_batch(20)) for _ in range(count)]

    a = epochs(5, 3)
    assert a == epochs(5, 3)  # deterministic
    assert all(sorted(e) == list(range(20)) for e in a)  # every epoch visits every row once
    assert a[0] != a[1] != a[2] and a[0] != list(range(20))
    assert epochs(6, 1)[0] != a[0]
    # Epoch e is seeded with seed + e: seed 6's first epoch is seed 5's second.
    assert epochs(6, 2) == a[1:3]


def test_jsonl_state_dict_continues_exactly(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", rows(7))
    original = JsonlSource(path, seed=3)
    original.next_batch(10)  # into the second epoch
    state = json.loads(json.dumps(original.state_dict()))
    assert state["epoch"] == 1 and state["position"] == 3
    expected = original.next_batch(12)

    resumed = JsonlSource(path, seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_batch(12) == expected

    with pytest.raises(DataError, match="data seed 3 but this run uses 4"):
        JsonlSource(path, seed=4).load_state_dict(state)
    with pytest.raises(DataError, match="saved for 7 rows but the source now has 6"):
        JsonlSource(write_jsonl(tmp_path / "e.jsonl", rows(6)), seed=3).load_state_dict(state)


@pytest.mark.parametrize(
    ("bad_line", "kwargs", "message"),
    [
        ('{"prompt": "x", "answer": ', {}, "not valid JSON"),
        ("[1, 2]", {}, "expected an object .* got list"),
        (
            '{"question": "x", "answer": 1}',
            {},
            r"missing prompt column 'prompt' \(row has \['answer', 'question'\]\)",
        ),
        ('{"prompt": "x"}', {}, "response column 'answer' is missing"),
        ('{"prompt": "x", "answer": null}', {}, "response column 'answer' is null"),
        ('{"prompt": "   ", "answer": 1}', {}, "column 'prompt' is an empty string"),
        ('{"prompt": 17, "answer": 1}', {}, "must be a string or a list of chat messages, got int"),
        ('{"prompt": [], "answer": 1}', {}, "empty message list"),
        (
            '{"prompt": [{"content": "x"}], "answer": 1}',
            {},
            "message 0 must be an object with 'role' and 'content'",
        ),
        ('{"prompt": ["hello"], "answer": 1}', {}, "message 0 must be an object"),
        (
            '{"prompt": [{"role": "user", "content": 5}], "answer": 1}',
            {},
            "message 0 content must be a string, got int 5",
        ),
        (
            '{"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "answer": 1}',
            {},
            r"message 0 content must be a string, got a list of content parts \(multimodal",
        ),
        (
            '{"q": "x", "a": 1}',
            {"prompt_column": "q", "response_column": "b"},
            "response column 'b' is missing",
        ),
    ],
)
def test_jsonl_malformed_line_names_file_and_line(
    tmp_path: Path, bad_line: str, kwargs: dict[str, Any], message: str
) -> None:
    good = json.dumps({kwargs.get("prompt_column", "prompt"): "ok", kwargs.get("response_column", "answer"): 1})
    # Line 1 good, line 2 blank, line 3 bad: the blank line still counts.
    path = write_jsonl(tmp_path / "bad.jsonl", [good, "", bad_line, good])
    with pytest.raises(DataError, match=rf"{re.escape(path)} line 3: .*{message}"):
        JsonlSource(path, **kwargs)


def test_jsonl_empty_or_missing_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="has no rows"):
        JsonlSource(str(empty))
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\n")
    with pytest.raises(DataError, match="has no rows"):
        JsonlSource(str(blank))
    with pytest.raises(DataError, match=r"cannot read JSONL file .*nope\.jsonl"):
        JsonlSource(str(tmp_path / "nope.jsonl"))


def test_jsonl_line_numbers_ignore_unicode_line_separators(tmp_path: Path) -> None:
    # U+2028 inside a JSON string is legal; it must not be taken as a line break.
    path = tmp_path / "u.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b", "answer": 1}, ensure_ascii=False) + "\n{bad\n", encoding="utf-8")
    with pytest.raises(DataError, match="line 2: not valid JSON"):
        JsonlSource(str(path))


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
def test_a_row_cut_short_is_reported_at_its_own_end(tmp_path: Path, end: str) -> None:
    # the decoder must not see the line end: past it, the error would read "column 1" of a next line
    path = tmp_path / "cut.jsonl"
    path.write_bytes(('{"prompt": "x", "answer": 1}' + end + '{"prompt": "oops", "answer": ' + end).encode())
    with pytest.raises(DataError, match=r"cut\.jsonl line 2: not valid JSON \(Expecting value at column 30\)"):
        JsonlSource(str(path))


def test_a_string_cut_short_reads_as_one_phrase(tmp_path: Path) -> None:
    # json's own message for it ends on "at": the column follows it once, not "starting at at column"
    path = tmp_path / "cut.jsonl"
    path.write_text('{"prompt": "x", "answer": 1}\n{"prompt": "2+2", "ans\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"line 2: not valid JSON \(Unterminated string starting at column 19\)$"):
        JsonlSource(str(path))


# ---------------------------------------------------------------- datasets on disk


def save_dataset(directory: Path, data: list[dict[str, Any]], split: str | None = None) -> str:
    import datasets

    ds = datasets.Dataset.from_list(data)
    if split is None:
        ds.save_to_disk(str(directory))
    else:
        datasets.DatasetDict({split: ds}).save_to_disk(str(directory))
    return str(directory)


def test_hf_disk_matches_jsonl_order_and_resumes(tmp_path: Path) -> None:
    data = rows(9)
    name = save_dataset(tmp_path / "ds", data)
    jsonl = JsonlSource(write_jsonl(tmp_path / "same.jsonl", data), seed=2)
    hf = HFDiskSource(name, seed=2)
    assert hf.provides == frozenset({"prompt", "ground_truth"})
    # One cursor implementation: the same rows and seed give the same order.
    first = hf.next_batch(13)
    assert [s.prompt for s in first] == [s.prompt for s in jsonl.next_batch(13)]
    assert first[0].uid.startswith("ds:train:")
    state = hf.state_dict()
    expected = hf.next_batch(8)
    resumed = HFDiskSource(name, seed=2)
    resumed.load_state_dict(state)
    assert resumed.next_batch(8) == expected


def test_hf_disk_dataset_dict_with_chat_prompts(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "Use 2, 3 and 4 to make 14."}]
    data = [{"messages": chat, "reference": json.dumps({"nums": [2, 3, 4], "target": 14}), "id": 1}]
    name = save_dataset(tmp_path / "dd", data, split="test")
    src = HFDiskSource(name, split="test", prompt_column="messages", response_column="reference", system_prompt=SYSTEM)
    sample = src.next_batch(1)[0]
    assert sample.prompt == [{"role": "system", "content": SYSTEM}, *chat]
    assert json.loads(str(sample.ground_truth)) == {"nums": [2, 3, 4], "target": 14}
    with pytest.raises(DataError, match=r"has no split 'train'; it has \['test'\]"):
        HFDiskSource(name, prompt_column="messages", response_column="reference")
    with pytest.raises(DataError, match=r"rl.data.response_column: .* has no column 'answer'"):
        HFDiskSource(name, split="test", prompt_column="messages")
    nothing = HFDiskSource(name, split="test", prompt_column="messages", response_column=None)
    assert nothing.provides == frozenset({"prompt"})


def test_hf_disk_bad_directory_and_bad_rows(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="is not a directory"):
        HFDiskSource(str(tmp_path / "missing"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="is not a dataset written by"):
        HFDiskSource(str(tmp_path / "plain"))
    name = save_dataset(tmp_path / "bad", [{"prompt": "ok", "answer": 1}, {"prompt": "", "answer": 2}])
    with pytest.raises(DataError, match=r"split train row 1: column 'prompt' is an empty string"):
        HFDiskSource(name)


# ---------------------------------------------------------------- factories


def test_factory_rows_samples_and_generators() -> None:
    src = FactorySource("pt_fixture_factories:make_rows", prompt_column="question", shuffle=False)
    batch = src.next_batch(6)
    assert [s.prompt for s in batch][:2] == ["What is 0 + 0?", "What is 1 + 1?"]
    assert truths(batch) == [0, 2, 4, 6, 8, 0]
    assert batch[1].uid == "pt_fixture_factories:make_rows:1"

    seeded = FactorySource("pt_fixture_factories:make_seeded_rows", prompt_column="question", seed=11)
    assert set(truths(seeded.next_batch(3))) == {11}

    gen = FactorySource("pt_fixture_factories:make_row_generator", prompt_column="question", shuffle=False)
    assert truths(gen.next_batch(4)) == ["0", "1", "2", "3"]

    samples = FactorySource("pt_fixture_factories:make_samples", shuffle=False, system_prompt=SYSTEM)
    first = samples.next_batch(1)[0]
    assert first.uid == "custom-0" and first.ground_truth == 0
    assert first.prompt == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "sample 0"}]

    free = FactorySource("pt_fixture_factories:make_samples_without_truth", response_column=None)
    assert free.provides == frozenset({"prompt"})


@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        ("no_such_module_abc:f", {}, r"cannot import module 'no_such_module_abc' .*ModuleNotFoundError"),
        ("pt_fixture_factories:nope", {}, "has no attribute 'nope'"),
        ("pt_fixture_factories:NOT_A_FUNCTION", {}, "is a list, not a function"),
        ("pt_fixture_factories", {}, "not of the form 'module:function'"),
        ("pt_fixture_factories:make_broken", {}, "raised RuntimeError\\('factory exploded'\\)"),
        ("pt_fixture_factories:make_not_iterable", {}, "returned int, not an iterable"),
        ("pt_fixture_factories:make_nothing", {}, "returned no rows"),
        (
            "pt_fixture_factories:make_bad_rows",
            {"prompt_column": "question"},
            "factory pt_fixture_factories:make_bad_rows row 2: missing prompt column 'question'",
        ),
        ("pt_fixture_factories:make_samples_without_truth", {}, "row 0: PromptSample has ground_truth=None"),
    ],
)
def test_factory_errors(factory: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(DataError, match=message):
        FactorySource(factory, **kwargs)


# ---------------------------------------------------------------- build, preflight


def test_build_picks_the_configured_source(tmp_path: Path) -> None:
    default = build_data_source(DataConfig(), data_seed=4)
    assert isinstance(default, ArithmeticSource) and default.seed == 4
    assert default.next_batch(3) == ArithmeticSource(4).next_batch(3)

    ops = DataConfig(arithmetic_min=5, arithmetic_max=5, arithmetic_ops=["*"], system_prompt=SYSTEM)
    only = build_data_source(ops, data_seed=0).next_batch(1)[0]
    assert only.ground_truth == 25
    assert only.prompt == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 5 * 5? Reply with only the number."},
    ]

    path = write_jsonl(tmp_path / "d.jsonl", rows(4))
    jsonl = build_data_source(DataConfig(path=path, shuffle=False), data_seed=0)
    assert isinstance(jsonl, JsonlSource) and truths(jsonl.next_batch(2)) == [0, 1]

    name = save_dataset(tmp_path / "ds", rows(3))
    assert isinstance(build_data_source(DataConfig(name=name), data_seed=0), HFDiskSource)
    cfg = DataConfig(factory="pt_fixture_factories:make_seeded_rows", prompt_column="question")
    factory = build_data_source(cfg, data_seed=9)
    assert isinstance(factory, FactorySource) and factory.next_batch(1)[0].ground_truth == 9

    with pytest.raises(DataError, match="set only one of path, name and factory"):
        build_data_source(DataConfig(path=path, name=name), data_seed=0)


def test_provided_fields() -> None:
    both = frozenset({"prompt", "ground_truth"})
    assert provided_fields(DataConfig()) == both
    assert provided_fields(DataConfig(response_column=None)) == both  # arithmetic always has answers
    assert provided_fields(DataConfig(path="x.jsonl")) == both
    assert provided_fields(DataConfig(path="x.jsonl", response_column=None)) == frozenset({"prompt"})
    assert provided_fields(DataConfig(name="d", response_column=None)) == frozenset({"prompt"})
    assert provided_fields(DataConfig(factory="m:f", response_column="r")) == both


def test_check_data_config_accepts_good_configs(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["", *rows(2)])
    name = save_dataset(tmp_path / "ds", rows(2))
    dict_name = save_dataset(tmp_path / "dd", rows(2), split="train")
    for cfg in [
        DataConfig(),
        DataConfig(path=path),
        DataConfig(name=name),
        DataConfig(name=dict_name),
        DataConfig(factory="pt_fixture_factories:make_rows", prompt_column="question"),
    ]:
        assert check_data_config(cfg) == []


def test_check_data_config_reports_problems(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", rows(1))
    bad_json = write_jsonl(tmp_path / "bad.jsonl", ["", "{oops"])
    no_answer = write_jsonl(tmp_path / "na.jsonl", [{"prompt": "x"}])
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    dict_name = save_dataset(tmp_path / "dd", rows(2), split="test")
    (tmp_path / "notds").mkdir()
    cases = [
        (DataConfig(path=good, name=dict_name), "set only one of path, name and factory"),
        (DataConfig(path=str(tmp_path / "missing.jsonl")), "missing.jsonl does not exist"),
        (DataConfig(path=str(tmp_path)), "is not a file"),
        (DataConfig(path=bad_json), rf"{re.escape(bad_json)} line 2: not valid JSON"),
        (DataConfig(path=no_answer), r"na.jsonl line 1: response column 'answer' is missing"),
        (DataConfig(path=good, prompt_column="q"), r"good.jsonl line 1: missing prompt column 'q'"),
        (DataConfig(path=str(tmp_path / "empty.jsonl")), "has no rows"),
        (DataConfig(path=str(tmp_path / "latin.jsonl")), r"latin.jsonl line 1 column 16: not valid UTF-8 \(byte 0xe9"),
        (DataConfig(name=str(tmp_path / "nods")), "is not a directory"),
        (DataConfig(name=str(tmp_path / "notds")), "is not a dataset written by"),
        (DataConfig(name=dict_name), r"has no split 'train'; it has \['test'\]"),
        (
            DataConfig(name=dict_name, split="test", prompt_column="q"),
            "rl.data.prompt_column: .* has no column 'q'",
        ),
        (DataConfig(factory="no_colon"), "not of the form 'module:function'"),
        (DataConfig(factory="no_such_module_abc:f"), "cannot import module 'no_such_module_abc'"),
        (DataConfig(factory="pt_fixture_factories:nope"), "has no attribute 'nope'"),
        (DataConfig(arithmetic_min=5, arithmetic_max=1), "arithmetic_min \\(5\\) is larger"),
        (DataConfig(arithmetic_template="{x} plus {b}"), "unknown fields \\['x'\\]"),
    ]
    for cfg, message in cases:
        problems = check_data_config(cfg)
        assert len(problems) == 1, (cfg, problems)
        assert re.search(message, problems[0]), (message, problems)
    two = check_data_config(DataConfig(arithmetic_min=5, arithmetic_max=1, arithmetic_ops=[]))
    assert len(two) == 2


def test_check_data_config_imports_neither_torch_nor_datasets(tmp_path: Path) -> None:
    name = save_dataset(tmp_path / "ds", rows(2))
    path = write_jsonl(tmp_path / "d.jsonl", rows(2))
    code = (
        "import sys\n"
        "from posttrain.config.schema import DataConfig\n"
        "from posttrain.data.build import check_data_config, provided_fields\n"
        f"assert check_data_config(DataConfig(name={name!r})) == []\n"
        f"assert check_data_config(DataConfig(path={path!r})) == []\n"
        "provided_fields(DataConfig())\n"
        "print(sorted(m for m in ('torch', 'datasets') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
