"""Prompt rows that used to escape as raw tracebacks, or be refused only after the model loaded (issue 15):
each is now a ``DataError`` / preflight error naming the file, the line (and column where known) and
the field, found before any model loads.

The preflight's row pass (``posttrain.data.rows.check_rows``) reads the whole file; its prompt-length
check counts tokens from the model directory's tokenizer files alone (a copy of the SmolLM2 tokenizer
with a ``config.json`` declaring ``max_position_embeddings=8192``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from posttrain.config.loading import build_config
from posttrain.data.build import build_data_source
from posttrain.data.jsonl import JsonlSource
from posttrain.data.rows import MAX_LISTED, check_rows
from posttrain.errors import DataError
from posttrain.preflight.grpo import grpo_preflight

CONTEXT = 8192  # max_position_embeddings in the fixture's config.json


def write_lines(path: Path, lines: list[Any]) -> Path:
    """Objects are JSON-encoded, str written verbatim, bytes written raw; one per line."""
    raw = b"".join(
        (line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line)).encode()) + b"\n"
        for line in lines
    )
    path.write_bytes(raw)
    return path


def rows_problems(data: Path, model: Path | None = None, *overrides: str) -> list[str]:
    model_args = [f"model.name_or_path={model}"] if model is not None else []
    return check_rows(build_config(None, [f"rl.data.path={data}", *model_args, *overrides]))


# ---------------------------------------------------------------- item 1: rows the JSON decoder chokes on

GOOD = {"prompt": "What is 1 + 1?", "answer": 2}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            '{"prompt": "x", "answer": ' + "7" * 5000 + "}",
            r"line 2 column 27: a number with more than 4300 digits, over Python's integer-conversion limit",
        ),
        (
            '{"prompt": "x", "answer": ' + "[" * 5000 + "]" * 5000 + "}",
            r"line 2: nested too deeply for the JSON decoder",
        ),
        (b'{"prompt": "caf\xe9 au lait", "answer": 1}', r"line 2 column 16: not valid UTF-8 \(byte 0xe9"),
        (
            '{"prompt": "a\\ud800b", "answer": 1}',
            r"line 2: column 'prompt' holds a lone UTF-16 surrogate '\\ud800' at character 2",
        ),
        (
            '{"prompt": [{"role": "user", "content": "hi \\udfff"}], "answer": 1}',
            r"line 2: column 'prompt' message 0 content holds a lone UTF-16 surrogate",
        ),
        (
            '{"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "answer": 1}',
            r"line 2: column 'prompt' message 0 content must be a string, got a list of content parts",
        ),
    ],
    ids=["5000-digit-int", "deep-nesting", "latin1-byte", "lone-surrogate", "surrogate-in-message", "content-list"],
)
def test_undecodable_rows_are_data_errors_naming_file_line_and_column(tmp_path: Path, bad: Any, message: str) -> None:
    path = write_lines(tmp_path / "rows.jsonl", [GOOD, bad, GOOD])
    with pytest.raises(DataError, match=rf"{re.escape(str(path))} {message}"):
        JsonlSource(str(path))
    problems = rows_problems(path)
    assert len(problems) == 1 and re.search(rf"{re.escape(str(path))} {message}", problems[0]), problems


def test_non_utf8_bytes_are_reported_at_their_line_after_many_lines(tmp_path: Path) -> None:
    # A text-mode read reports the decoder's buffer offset (position 1e5-ish), never the line.
    lines: list[Any] = [GOOD] * 3000 + [b'{"prompt": "\xff", "answer": 1}'] + [GOOD]
    path = write_lines(tmp_path / "many.jsonl", lines)
    with pytest.raises(DataError, match=r"many\.jsonl line 3001 column 13: not valid UTF-8 \(byte 0xff"):
        JsonlSource(str(path))


def test_line_numbers_follow_cr_and_crlf_line_ends_and_a_bom(tmp_path: Path) -> None:
    path = tmp_path / "ends.jsonl"
    row = json.dumps(GOOD).encode()
    path.write_bytes(b"\xef\xbb\xbf" + row + b"\r\n" + row + b"\r" + row + b"\n{oops\n")
    with pytest.raises(DataError, match=r"ends\.jsonl line 4: not valid JSON"):
        JsonlSource(str(path))
    path.write_bytes(b"\xef\xbb\xbf" + row + b"\r\n" + row + b"\r" + row + b"\n")
    assert [s.uid for s in JsonlSource(str(path), shuffle=False).next_batch(3)] == [
        "ends.jsonl:1",
        "ends.jsonl:2",
        "ends.jsonl:3",
    ]


def test_the_row_pass_lists_every_bad_row_and_counts_the_rest(tmp_path: Path) -> None:
    bad = {"prompt": "x", "answer": "twelve"}
    path = write_lines(tmp_path / "r.jsonl", [GOOD, b"\xff", *[bad] * (MAX_LISTED + 5)])
    problems = rows_problems(path)
    assert len(problems) == MAX_LISTED + 1
    assert re.search(r"r\.jsonl line 2 column 1: not valid UTF-8", problems[0])
    assert problems[1].startswith(f"{path} line 3: column 'answer': reward 'arithmetic': ground truth 'twelve'")
    assert problems[-1] == f"rl.data.path={path}: 6 more problem(s) in {MAX_LISTED + 7} rows, not listed"


# ---------------------------------------------------------------- item 2: ground truths and renderability


@pytest.mark.parametrize("reward", ["arithmetic", "arithmetic_first", "gsm8k"])
@pytest.mark.parametrize(
    ("truth_json", "shown"),
    [
        ('"twelve"', r"'twelve' \(str\) is not a number"),
        ('""', r"'' \(str\) is not a number"),
        ("true", r"True \(bool\) is not a number"),
        ("[12]", r"\[12\] \(list\) is not a number"),
        ('{"n": 12}', r"\{'n': 12\} \(dict\) is not a number"),
        ("NaN", r"nan \(float\) is not a number"),
        ("Infinity", r"inf \(float\) is not a number"),
        ("-Infinity", r"-inf \(float\) is not a number"),
        ("1e999", r"inf \(float\) is not a number"),
    ],
)
def test_unusable_ground_truths_are_refused_by_the_preflight(
    tmp_path: Path, reward: str, truth_json: str, shown: str
) -> None:
    path = write_lines(tmp_path / "gt.jsonl", [GOOD, '{"prompt": "What is 6 + 6?", "answer": ' + truth_json + "}"])
    errors = grpo_preflight(build_config(None, [f"rl.data.path={path}", f"rl.reward={reward}"])).errors
    expected = rf"^{re.escape(str(path))} line 2: column 'answer': reward '{reward}': ground truth {shown}"
    assert [e for e in errors if re.search(expected, e)], errors


def test_usable_ground_truths_pass_and_match_what_the_reward_accepts(tmp_path: Path) -> None:
    truths = [12, 12.5, "12", " 1,234 ", "-3", "0.5", "1e3", 10**50]
    path = write_lines(tmp_path / "ok.jsonl", [{"prompt": "q", "answer": t} for t in truths])
    assert rows_problems(path) == []
    gsm = write_lines(
        tmp_path / "gsm.jsonl", [{"prompt": "q", "answer": "6 * 2 = 12\n#### 12"}, {"prompt": "q", "answer": 3}]
    )
    assert rows_problems(gsm, None, "rl.reward=gsm8k") == []
    no_number = write_lines(tmp_path / "gsm_bad.jsonl", [{"prompt": "q", "answer": "so #### twelve"}])
    assert re.search(
        r"line 1: column 'answer': reward 'gsm8k': ground truth has no number after '####'",
        rows_problems(no_number, None, "rl.reward=gsm8k")[0],
    )


def test_exact_match_and_countdown_declare_their_checks(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "em.jsonl", [{"prompt": "q", "answer": a} for a in ["Paris", 7, "   ", [1], True]])
    problems = rows_problems(path, None, "rl.reward=exact_match")
    assert [p.split(": ", 1)[0] for p in problems] == [f"{path} line {n}" for n in (3, 4, 5)]
    assert "blank string" in problems[0] and "(list) is not an answer text" in problems[1]
    cd = write_lines(
        tmp_path / "cd.jsonl",
        [
            {"prompt": "q", "answer": {"nums": [1, 2], "target": 3}},
            {"prompt": "q", "answer": {"nums": [], "target": 3}},
        ],
    )
    problems = rows_problems(cd, None, "rl.reward=countdown")
    assert len(problems) == 1 and problems[0].startswith(f"{cd} line 2: column 'answer': reward 'countdown'")


def test_a_custom_reward_declares_its_own_ground_truth_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hard15_rewards.py").write_text(
        "def yes_no(sample):\n"
        "    return float(sample.completion.strip() == sample.ground_truth)\n"
        "yes_no.requires = {'prompt', 'ground_truth'}\n"
        "yes_no.check_ground_truth = lambda v: None if v in ('yes', 'no') else f'{v!r} is neither yes nor no'\n"
        "def broken_check(sample):\n"
        "    return 0.0\n"
        "broken_check.check_ground_truth = lambda v: 1 / 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_lines(tmp_path / "yn.jsonl", [{"prompt": "q", "answer": "yes"}, {"prompt": "q", "answer": "maybe"}])
    assert rows_problems(path, None, "rl.reward=hard15_rewards:yes_no") == [
        f"{path} line 2: column 'answer': 'maybe' is neither yes nor no"
    ]
    problems = rows_problems(path, None, "rl.reward=hard15_rewards:broken_check")
    assert "check_ground_truth raised ZeroDivisionError" in problems[0] and len(problems) == 2


def test_chat_prompts_without_a_chat_template_are_refused_by_name(tmp_path: Path, model_dir: Path) -> None:
    path = write_lines(tmp_path / "chat.jsonl", [GOOD, {"prompt": [{"role": "user", "content": "hi"}], "answer": 1}])
    errors = grpo_preflight(
        build_config(None, [f"rl.data.path={path}", f"model.name_or_path={model_dir}", "model.use_chat_template=false"])
    ).errors
    assert any(
        e.startswith(f"{path} line 2: column 'prompt' is a chat-message list, but model.use_chat_template=false")
        for e in errors
    ), errors
    system = rows_problems(
        write_lines(tmp_path / "s.jsonl", [GOOD]),
        None,
        "model.use_chat_template=false",
        "rl.data.system_prompt=Be brief.",
    )
    assert len(system) == 1 and "rl.data.system_prompt turns every prompt into a chat-message list" in system[0]
    (model_dir / "chat_template.jinja").unlink()  # a tokenizer without a chat template
    problems = rows_problems(path, model_dir)
    assert problems == [
        f"{path} line 2: column 'prompt' is a chat-message list, but the tokenizer of "
        f"model.name_or_path={model_dir} has no chat template; give string prompts"
    ]


# ---------------------------------------------------------------- item 3: prompts longer than the context


def test_prompt_token_counts_match_the_loop_renderer(model_dir: Path) -> None:
    from posttrain.data.prompt_length import PromptCounter
    from posttrain.models.chat import render_prompt_ids
    from posttrain.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    prompts: list[Any] = [
        "What is 2 + 2?",
        "é ü 中文 😀 " * 30,
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "line\nbreaks\tand  spaces"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ]
    for use_template in (True, False):
        counter = PromptCounter(model_dir, use_chat_template=use_template)
        for prompt in prompts:
            if not use_template and not isinstance(prompt, str):
                continue
            expected = len(render_prompt_ids(tokenizer, prompt, use_chat_template=use_template))
            assert counter.count(prompt) == expected, prompt
            assert counter.upper_bound(prompt) >= expected, prompt


def test_prompts_longer_than_the_context_are_refused_by_line(tmp_path: Path, model_dir: Path) -> None:
    fits, long = "word " * 150, "word " * 400  # 156 and 406 tokens with the chat template
    path = write_lines(tmp_path / "len.jsonl", [{"prompt": fits, "answer": 1}, {"prompt": long, "answer": 1}])
    max_tokens = CONTEXT - 200
    errors = grpo_preflight(
        build_config(
            None, [f"rl.data.path={path}", f"model.name_or_path={model_dir}", f"rollout.max_tokens={max_tokens}"]
        )
    ).errors
    expected = (
        f"{path} line 2 (sample len.jsonl:2): the prompt is 431 tokens, but the model's context "
        f"(max_position_embeddings={CONTEXT}) minus rollout.max_tokens={max_tokens} leaves 200 for it"
    )
    assert [e for e in errors if e.startswith(expected)], errors
    assert not [e for e in errors if "line 1" in e]
    # With room for both, nothing is refused; a max_tokens that fills the context is refused outright.
    assert rows_problems(path, model_dir, "rollout.max_tokens=16") == []
    full = rows_problems(path, model_dir, f"rollout.max_tokens={CONTEXT}")
    assert full == [
        f"rollout.max_tokens={CONTEXT} leaves no room for a prompt: model.name_or_path={model_dir} has "
        f"max_position_embeddings={CONTEXT}; lower rollout.max_tokens"
    ]


def test_the_row_pass_reads_dataset_splits_on_disk(tmp_path: Path, model_dir: Path) -> None:
    import datasets

    rows = [{"prompt": "fine", "answer": "3"}, {"prompt": "x " * 300, "answer": "three"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    problems = rows_problems(tmp_path / "missing.jsonl", None)  # a missing file: check_data_config's to report
    assert problems and "cannot read JSONL file" in problems[0]
    cfg = build_config(
        None, [f"rl.data.name={tmp_path / 'ds'}", f"model.name_or_path={model_dir}", "rollout.max_tokens=8000"]
    )
    problems = check_rows(cfg)
    where = f"dataset {tmp_path / 'ds'} split train row 1"
    assert problems == [
        f"{where}: column 'answer': reward 'arithmetic': ground truth 'three' (str) is not a number; "
        'give an int, a finite float or a numeric string such as "12"'
    ]


def test_the_row_pass_imports_no_torch(tmp_path: Path, model_dir: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [GOOD, {"prompt": [{"role": "user", "content": "hi"}], "answer": 3}])
    code = (
        "import sys\n"
        "from posttrain.config.loading import build_config\n"
        "from posttrain.data.rows import check_rows\n"
        f"overrides = ['rl.data.path={path}', 'model.name_or_path={model_dir}', 'rollout.max_tokens=8191']\n"
        "cfg = build_config(None, overrides)\n"
        "print(len(check_rows(cfg)), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2", "False"]  # both rows are over the 1-token budget, and no torch


def test_a_source_built_from_checked_rows_renders_every_prompt(tmp_path: Path, model_dir: Path) -> None:
    # What the preflight accepted, the loop can render: no TypeError from the tokenizer.
    from posttrain.models.chat import render_prompt_ids
    from posttrain.models.loading import load_tokenizer

    rows = [
        {"prompt": "caf\u00e9 \U0001f600", "answer": 1},
        {"prompt": [{"role": "user", "content": "\u2028x"}], "answer": 2},
    ]
    path = write_lines(tmp_path / "ok.jsonl", rows)
    cfg = build_config(None, [f"rl.data.path={path}", f"model.name_or_path={model_dir}"])
    assert check_rows(cfg) == []
    tokenizer = load_tokenizer(str(model_dir))
    for sample in build_data_source(cfg.rl.data, 0).next_batch(2):
        assert render_prompt_ids(tokenizer, sample.prompt, use_chat_template=True)


def test_a_factory_row_that_cannot_be_printed_is_still_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from posttrain.data.factory import FactorySource

    (tmp_path / "hard15_factory.py").write_text(
        "def rows():\n    return [{'prompt': 'ok', 'answer': 1}, {'prompt': 10**5000}]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        DataError, match=r"^factory hard15_factory:rows row 1: column 'prompt' must be a string .*got int"
    ):
        FactorySource("hard15_factory:rows")
