"""Fuzzing prompt rows and reward return values (issue 15).

Random JSONL files (valid rows mixed with every form that once escaped as a raw traceback: over-long
integers, deep nesting, bytes that are not UTF-8, lone surrogates, CR line ends, a BOM, wrong types,
content lists, NaN / Infinity ground truths, prompts near the context limit) go through the JSONL
source and the preflight's row pass (``check_rows``); random reward return values (floats, NaN, huge
ints, Fractions, None, strings, NumPy values, objects whose conversion raises, exceptions, batched
lists of the wrong length) go through ``score_completions``.

Every failure must be a posttrain error that names the file and line, or the reward and the sample;
nothing else may escape. And what the row pass accepts must work later: the source builds, every
prompt renders with the real tokenizer within the context budget, every ground truth scores.

Seeded and bounded to a few seconds in CI; ``POSTTRAIN_FUZZ_CASES=2000 pytest
tests/unit/test_fuzz_rows.py`` runs more by hand (``POSTTRAIN_FUZZ_SEED`` picks another stream).
A failure prints the case to replay.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from posttrain.config.loading import build_config
from posttrain.data.jsonl import JsonlSource
from posttrain.data.rows import check_rows
from posttrain.errors import PosttrainError, RewardError
from posttrain.rewards.base import RewardInput
from posttrain.rewards.registry import FunctionReward, get_reward, score_completions

CASES = int(os.environ.get("POSTTRAIN_FUZZ_CASES", "300"))
SEED = int(os.environ.get("POSTTRAIN_FUZZ_SEED", "15"))
CONTEXT = 8192
REWARDS = ["arithmetic", "arithmetic_first", "gsm8k", "exact_match", "countdown", "nonempty"]


# ---------------------------------------------------------------- random rows

TEXTS = ["What is 2 + 3?", "x", "", "   ", "caf\u00e9 \U0001f600", "a\u2028b", "tab\there", "\x00\x1f", "#### 12", "12"]


def _text(rng: random.Random) -> str:
    if rng.random() < 0.3:
        return "".join(
            chr(rng.choice([rng.randint(32, 126), rng.randint(0x80, 0x2FFF), 0xD800, 0xDFFF, 0x1F600]))
            for _ in range(rng.randint(0, 12))
        )
    if rng.random() < 0.1:
        return "word " * rng.randint(50, 400)  # around the context budget the test picks
    return rng.choice(TEXTS)


def _value(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value (ground truths, odd prompts): numbers, texts, containers, chat lists."""
    makers = [
        lambda: rng.randint(-(10**6), 10**6),
        lambda: rng.choice([0.5, -2.25, float("nan"), float("inf"), -float("inf"), 1e308, 12.0]),
        lambda: _text(rng),
        lambda: rng.choice([True, False, None]),
        lambda: str(rng.randint(-999, 999)),
        lambda: {"nums": [rng.randint(1, 9) for _ in range(rng.randint(0, 3))], "target": rng.choice([7, "7", 7.5])},
        lambda: rng.randint(0, 99),
        lambda: [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
        lambda: {_text(rng): _value(rng, depth + 1) for _ in range(rng.randint(0, 2))},
        lambda: _messages(rng),
    ]
    return makers[rng.randrange(len(makers) if depth < 3 else 7)]()


def _messages(rng: random.Random) -> Any:
    out = []
    for _ in range(rng.randint(0, 3)):
        msg: dict[str, Any] = {"role": rng.choice(["user", "system", "assistant", 5]), "content": _text(rng)}
        if rng.random() < 0.15:
            msg["content"] = rng.choice([[{"type": "text", "text": "hi"}], 3, None])
        if rng.random() < 0.05:
            del msg["role"]
        out.append(msg)
    return out


GOOD_ANSWERS: dict[str, list[Any]] = {
    "arithmetic": [5, "5", 2.5, " 1,234 ", "-3"],
    "arithmetic_first": [5, "0.5"],
    "gsm8k": [7, "so 3 + 4 = 7\n#### 7"],
    "exact_match": ["Paris", 5],
    "countdown": [{"nums": [2, 3], "target": 5}, '{"nums": [1], "target": 1}'],
    "nonempty": ["x", 3],
}


def _row_line(rng: random.Random, reward: str) -> bytes:
    """One line of a JSONL file (without its line end)."""
    special = rng.random()
    if special < 0.04:
        return b'{"prompt": "x", "answer": ' + b"9" * rng.choice([4301, 5000]) + b"}"
    if special < 0.07:
        depth = rng.choice([999, 3000])
        return b'{"prompt": "x", "answer": ' + b"[" * depth + b"]" * depth + b"}"
    if special < 0.10:
        return rng.choice([b'{"prompt": "caf\xe9"}', b"\xff\xfe", b'{"prompt": "\xc3"}'])
    if special < 0.13:
        return rng.choice([b"{oops", b"[1, 2]", b'"just a string"', b"null", b'{"prompt": "a", "answer": 1'])
    if special < 0.55:  # a well-formed row: most files must pass, to test that what passes works
        prompt: Any = rng.choice(["What is 2 + 3?", "caf\u00e9 \U0001f600", "a\u2028b", "word " * rng.randint(50, 400)])
        if rng.random() < 0.4:
            prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}][
                rng.randint(0, 1) :
            ]
        answer = rng.choice(GOOD_ANSWERS[reward] if rng.random() < 0.9 else GOOD_ANSWERS["nonempty"])
        return json.dumps({"prompt": prompt, "answer": answer}).encode()
    row: dict[str, Any] = {}
    if rng.random() < 0.95:
        row["prompt"] = _messages(rng) if rng.random() < 0.4 else (_text(rng) if rng.random() < 0.9 else _value(rng))
    if rng.random() < 0.9:
        row["answer"] = _value(rng)
    return json.dumps(row).encode()  # ensure_ascii: a lone surrogate becomes the "\ud800" escape


def _write_file(rng: random.Random, path: Path, reward: str) -> None:
    ends = [b"\n", b"\r\n", b"\r"] if rng.random() < 0.2 else [b"\n"]
    lines = [_row_line(rng, reward) for _ in range(rng.randint(1, 4))]
    raw = b"".join(line + rng.choice(ends) for line in lines)
    if rng.random() < 0.1:
        raw = b"\xef\xbb\xbf" + raw
    if rng.random() < 0.1:
        raw = raw.replace(b"\n", b"\n\n", 1)  # a blank line shifts every later line number
    path.write_bytes(raw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> Path:
    out = tmp_path_factory.mktemp("fuzz_model") / "model"
    shutil.copytree(smollm2_tokenizer_dir, out)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from posttrain.models.loading import load_tokenizer

    return load_tokenizer(str(model_dir))


def _named(message: str, path: Path) -> bool:
    """A row-pass problem names the file and a line (or is the config-level line that says why)."""
    return bool(
        re.match(rf"{re.escape(str(path))} line \d+", message)
        or message.startswith((f"rl.data.path={path}:", "rl.data.system_prompt ", "rollout.max_tokens="))
    )


def _check_accepted(path: Path, cfg: Any, tokenizer: Any, reward_name: str) -> None:
    """What the row pass accepted builds, renders within the budget and scores."""
    from posttrain.models.chat import render_prompt_ids

    source = JsonlSource(str(path), shuffle=False, system_prompt=cfg.rl.data.system_prompt)
    reward = get_reward(reward_name)
    limit = CONTEXT - cfg.rollout.max_tokens
    for sample in source.next_batch(len(source)):
        ids = render_prompt_ids(tokenizer, sample.prompt, use_chat_template=cfg.model.use_chat_template)
        assert len(ids) <= limit + 2, (sample.uid, len(ids), limit)
        inputs = [RewardInput(prompt=sample.prompt, completion="7", ground_truth=sample.ground_truth)]
        score_completions(reward, inputs, [sample.uid])


def test_random_jsonl_rows_fail_only_with_named_errors(tmp_path: Path, model_dir: Path, tokenizer: Any) -> None:
    rng = random.Random(SEED)
    accepted = refused = 0
    for case in range(CASES):
        path = tmp_path / f"case{case}.jsonl"
        reward_name = rng.choice(REWARDS)
        _write_file(rng, path, reward_name)
        overrides = [
            f"rl.data.path={path}",
            f"model.name_or_path={model_dir}",
            f"rl.reward={reward_name}",
            f"rollout.max_tokens={CONTEXT - rng.randint(60, 500)}",
            f"model.use_chat_template={rng.random() < 0.7}",
        ]
        if rng.random() < 0.1:
            overrides.append("rl.data.system_prompt=Be brief.")
        replay = f"case {case} (POSTTRAIN_FUZZ_SEED={SEED}): {path.read_bytes()[:300]!r} {overrides}"
        cfg = build_config(None, overrides)
        try:
            source_error: PosttrainError | None = None
            try:
                JsonlSource(str(path), system_prompt=cfg.rl.data.system_prompt)
            except PosttrainError as exc:
                source_error = exc
                assert re.match(rf"{re.escape(str(path))} line \d+", str(exc)), str(exc)
            problems = check_rows(cfg)
            assert all(_named(p, path) for p in problems), problems
            if source_error is not None:
                assert problems, f"the source refused what the row pass accepted: {source_error}"
            if not problems:
                accepted += 1
                _check_accepted(path, cfg, tokenizer, reward_name)
            else:
                refused += 1
        except AssertionError:
            print(replay)
            raise
        except Exception as exc:
            pytest.fail(f"{replay}: raw {type(exc).__name__}: {exc}")
    assert accepted and refused  # the stream exercises both sides


# ---------------------------------------------------------------- random reward return values


class BadFloat(float):
    """A float subclass whose conversion fails."""

    def __float__(self) -> float:
        raise ArithmeticError("no float for you")


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr exploded")


RETURNS: list[Any] = [
    0.0,
    1.0,
    -2.5,
    7,
    np.float32(0.25),
    np.int64(3),
    Fraction(1, 3),
    float("nan"),
    float("inf"),
    -float("inf"),
    np.float64("nan"),
    10**400,
    -(10**5000),
    Fraction(10**400, 7),
    None,
    True,
    "1",
    b"1",
    Decimal("1.5"),
    [1.0],
    BadFloat(1.0),
    BadRepr(),
    object(),
    1e308 * 10,
]


def _reward_value(rng: random.Random) -> Any:
    if rng.random() < 0.1:
        raise rng.choice([ValueError("bad"), KeyError("k"), ZeroDivisionError(), RecursionError(), MemoryError()])
    return rng.choice(RETURNS)


def _constant(value: Any) -> Callable[[Any], Any]:
    return lambda batch: value


def _drawing(draws: Iterator[random.Random]) -> Callable[[RewardInput], Any]:
    return lambda sample: _reward_value(next(draws))


def test_random_reward_returns_fail_only_with_named_errors() -> None:
    rng = random.Random(SEED)
    for case in range(CASES * 5):
        n = rng.randint(1, 4)
        uids = [f"f{case}.jsonl:{i}#{rng.randint(0, 7)}" for i in range(n)]
        inputs = [RewardInput(prompt="p", completion=rng.choice(["7", "", "x"])) for _ in range(n)]
        batched = rng.random() < 0.3
        name = f"fuzz-{case}"
        if batched:
            length = n if rng.random() < 0.7 else rng.randint(0, n + 2)
            fixed = [rng.choice(RETURNS) for _ in range(length)]
            returned: Any = fixed if rng.random() < 0.9 else rng.choice(RETURNS)
            scorer = FunctionReward(name, frozenset({"prompt"}), _constant(returned), batched=True)
        else:
            draws = iter([random.Random(rng.random()) for _ in range(n)])  # one stream per call, in order
            scorer = FunctionReward(name, frozenset({"prompt"}), _drawing(draws))
        try:
            scores = score_completions(scorer, inputs, uids, timeout_s=rng.choice([0, 5]))
        except RewardError as exc:
            message = str(exc)
            assert f"reward {name!r}" in message, message
            assert any(repr(u) in message for u in uids), message
        except Exception as exc:
            pytest.fail(f"case {case} (POSTTRAIN_FUZZ_SEED={SEED}): raw {type(exc).__name__}: {exc}")
        else:
            assert len(scores) == n and all(type(s) is float and math.isfinite(s) for s in scores), scores
