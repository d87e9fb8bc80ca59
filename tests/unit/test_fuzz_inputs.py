"""Fuzzing the command line: random override sets (keys of the real config trees, values from a pool of
YAML-ish strings holding every form that once escaped as a raw traceback) through ``build_config`` and
``--validate-manifest`` in process, for GRPO and OPD.

Every failure must be a posttrain error whose problems name the key they are about; nothing else may
escape, and the manifest check must answer 0 or 1. Seeded, and bounded to a few seconds in CI;
``POSTTRAIN_FUZZ_CASES=20000 pytest tests/unit/test_fuzz_inputs.py`` runs more by hand
(``POSTTRAIN_FUZZ_SEED`` picks another stream). A failure prints the case to replay.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
from pathlib import Path

import pytest

from posttrain.config.loading import build_config, known_keys
from posttrain.config.opd import OPDConfig
from posttrain.config.schema import GRPOConfig, RunConfig
from posttrain.entrypoints.grpo import GRPO_COMMAND, Command, validate_manifest
from posttrain.entrypoints.opd import OPD_COMMAND
from posttrain.errors import ConfigError, PosttrainError

CASES = int(os.environ.get("POSTTRAIN_FUZZ_CASES", "80"))
SEED = int(os.environ.get("POSTTRAIN_FUZZ_SEED", "15"))

# Values that broke something once (issue 15), and the YAML forms around them.
NASTY = [
    "2024-02-30",
    "2024-02-28 12:00:00",
    "1:30",
    "-1:30:00",
    "9" * 5000,
    "-" + "9" * 40,
    "[" * 1100,
    "{a: " * 40 + "1" + "}" * 40,
    "!!int x",
    "!!bool maybe",
    "!!float nope",
    "!!timestamp 2024-02-30",
    "!!python/name:os.system",
    "!!binary AAAA",
    "! x",
    "&a [1]",
    "*a",
    "[1, *a]",
    ".inf",
    "-.inf",
    ".nan",
    ".NaN",
    "1e-300",
    "1e300",
    "1e99999",
    str(2**63),
    str(2**63 - 1),
    str(2**64),
    "-1",
    "0",
    "010",
    "0x1F",
    "0o17",
    "0b101",
    "1_000",
    "yes",
    "no",
    "on",
    "~",
    "null",
    " ",
    '""',
    "''",
    '"a\\0b"',
    '"\\ud800"',
    '"\\x00"',
    "a" * 300,
    "/tmp/" + "a" * 300,
    "/tmp/" + "d/" * 2100 + "x",
    "{",
    "}",
    "[1, 2",
    "{a: 1}",
    "{lr: .inf}",
    "{policy: [1, 99999999999999999999]}",
    "[1, 2, 3]",
    "[.nan, 1]",
    "[[1]]",
    "[]",
    "{}",
    "'{op:d}'",
    "'{a:>100000000}'",
    "'{a:{b}}'",
    "'{'",
    "'{c}'",
    "a: b: c",
    "%TAG ! x",
    "@x",
    "`x`",
    "|",
    ">",
    "- a",
    "? a",
    "#comment",
    "a #c",
    "\t",
    "a\x07",
    "a\nb",
    "---",
    "...",
    "=",
    "a=b",
    "é",
    "\U0001f642",
    "\\",
    "true",
    "FALSE",
    "-0.0",
    "+5",
    "5.",
    ".5",
    "1e5",
    "x" * 70_000,
    "auto",
    "off",
    "embedded:smollm2-135m-instruct",
    "embedded:nope",
    "posttrain_fuzz_nowhere:fn",
    ":",
    "a:",
    ":b",
    "/",
    ".",
    "..",
]
ATOMS = ["1", "-2", "0.5", ".inf", "true", "null", "x", "'q'", '"w"', "1:30", "2024-02-30", str(2**70)]
TEXT = "abz019 _-.:/,[]{}'\"!&*#%@`|>?=\\~\t"
# Keys whose values the preflight looks up on disk or imports (OPD-only keys are unknown under GRPO).
FILE_KEYS = [
    "model.name_or_path",
    "rl.ref.model_dir",
    "rl.teacher.name_or_path",
    "rl.resume",
    "job.output_root",
    "job.project",
    "job.group",
    "job.name",
    "rl.data.path",
    "rl.data.name",
    "rl.data.factory",
    "rl.data.arithmetic_template",
    "rl.reward",
]
BAD_KEYS = ["", "rl.", ".rl", "rl..max_steps", "rl.max_steps.x", "nope", "rl.nope", " rl.seed", "RL.SEED", "k" * 5000]


def _paths(root: Path) -> list[str]:
    """Real files and directories: a file in the way, an empty directory, a model directory with a
    broken config.json, a run directory holding a checkpoint."""
    (root / "file").write_text("x")
    (root / "empty").mkdir()
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{not json")
    ckpt = root / "run" / "checkpoints" / "iter_000000002"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{}")
    (root / "rows.jsonl").write_text('{"prompt": "hi", "answer": "1"}\n{"prompt": ' + "[" * 3000 + "\n")
    return [str(root / n) for n in ("file", "file/sub", "empty", "model", "run", "run/checkpoints", "rows.jsonl")]


def _value(rng: random.Random, paths: list[str], depth: int = 0) -> str:
    roll = rng.random()
    if roll < 0.45:
        return rng.choice(NASTY)
    if roll < 0.55:
        return rng.choice(paths)
    if roll < 0.7:
        return "".join(rng.choice(TEXT) for _ in range(rng.randint(0, 12)))
    if roll < 0.85 and depth < 3:
        items = [_value(rng, paths, depth + 1) if rng.random() < 0.3 else rng.choice(ATOMS) for _ in range(3)]
        return "[" + ", ".join(items[: rng.randint(0, 3)]) + "]"
    if depth < 3:
        key = rng.choice(["lr", "policy", "path", "a", "max_steps", "[1]", "'k'"])
        return "{" + f"{key}: {_value(rng, paths, depth + 1)}" + "}"
    return rng.choice(ATOMS)


def _overrides(rng: random.Random, keys: list[str], paths: list[str]) -> list[str]:
    chosen = []
    for _ in range(rng.randint(1, 4)):
        roll = rng.random()
        key = rng.choice(BAD_KEYS) if roll < 0.08 else rng.choice(FILE_KEYS) if roll < 0.3 else rng.choice(keys)
        chosen.append(f"{key}={_value(rng, paths)}")
    return chosen


def _assert_named(problems: list[str], items: list[str], case: str) -> None:
    """Every problem names one of the overrides' keys (or, for a malformed item, shows it)."""
    keys = [item.partition("=")[0].strip() for item in items]
    for problem in problems:
        named = any(key and key[:40] in problem for key in keys) or any(repr(item)[:40] in problem for item in items)
        assert named, f"{case}: a problem names none of the keys {keys}: {problem[:300]}"


def _build(config_type: type[RunConfig], items: list[str], case: str) -> bool:
    """``build_config`` either builds (True), or raises a posttrain error naming the keys (False)."""
    try:
        build_config(None, items, config_type)
    except ConfigError as exc:
        _assert_named(exc.problems, items, case)
        return False
    except PosttrainError:
        return False  # another named posttrain error
    except Exception as exc:
        pytest.fail(f"{case}: build_config raised {exc!r}")
    return True


def _validate(command: Command, items: list[str], case: str) -> None:
    """``--validate-manifest`` (recipe, overrides, the best-effort rebuild, the preflight) answers 0 or 1."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = validate_manifest(None, items, command)
    except Exception as exc:
        pytest.fail(f"{case}: --validate-manifest raised {exc!r}")
    assert status in (0, 1), f"{case}: status {status}"
    if status == 0:
        assert "manifest OK" in out.getvalue(), case


@pytest.mark.parametrize(
    ("command", "config_type"), [(GRPO_COMMAND, GRPOConfig), (OPD_COMMAND, OPDConfig)], ids=["grpo", "opd"]
)
def test_random_overrides_fail_only_with_named_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: Command, config_type: type[RunConfig]
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)  # the default output root ./outputs is looked at, never written
    rng = random.Random(f"{SEED}:{config_type.__name__}")
    keys, paths = known_keys(config_type), _paths(tmp_path)
    for index in range(CASES):
        items = _overrides(rng, keys, paths)
        case = f"seed {SEED} case {index} {config_type.__name__} {items!r:.600}"
        _build(config_type, items, case)
        _validate(command, items, case)


def test_every_nasty_value_under_every_kind_of_key() -> None:
    """Each pool value under an int, a float, a string, a list and a section key: all named."""
    kinds = ("rl.max_steps", "rl.optimizer.lr", "job.name", "grid.shapes.policy", "rl.optimizer")
    for index, value in enumerate(NASTY):
        for key in kinds:
            case = f"{key}={value[:60]!r}"
            # the whole preflight where it sees the value, and the best-effort rebuild now and then
            if _build(GRPOConfig, [f"{key}={value}"], case) or (index + len(key)) % 8 == 0:
                _validate(GRPO_COMMAND, [f"{key}={value}"], case)
