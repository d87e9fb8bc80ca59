"""Rewards that used to escape as raw tracebacks or block the run (issue 15): an overflowing score, a
batched call returning the wrong count or NaN, a scorer that never returns. Each is now a
``RewardError`` naming the reward and the sample; a hung scorer runs into ``rl.reward_timeout_s``
and a second SIGTERM still stops the run at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from posttrain.config.loading import build_config
from posttrain.errors import ConfigError, RewardError
from posttrain.rewards.base import RewardInput
from posttrain.rewards.registry import (
    FunctionReward,
    get_reward,
    ground_truth_problem,
    score_completions,
    with_timeout,
)

INPUTS = [RewardInput(prompt="p", completion=c, ground_truth=7) for c in ("7", "8", "9")]
UIDS = ["rows.jsonl:3#0", "rows.jsonl:3#1", "rows.jsonl:3#2"]


def reward(name: str, fn: Any, *, batched: bool = False) -> FunctionReward:
    return FunctionReward(name=name, requires=frozenset({"prompt"}), fn=fn, batched=batched)


# ---------------------------------------------------------------- item 4: scores that are not floats


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (
            10**400,
            r"returned an int of about 401 digits for sample 'rows.jsonl:3#1' \(index 1\): too large for a float",
        ),
        (-(10**5000), r"returned an int of about 5001 digits for sample 'rows.jsonl:3#1'"),
        (Fraction(10**400, 3), r"returned Fraction\(.*for sample 'rows.jsonl:3#1' \(index 1\): too large for a float"),
        (np.float64("nan"), r"returned nan for sample 'rows.jsonl:3#1'"),
    ],
    ids=["10**400", "-10**5000", "huge-fraction", "numpy-nan"],
)
def test_an_unrepresentable_score_names_reward_and_sample(value: Any, shown: str) -> None:
    scorer = reward("huge", lambda s: 1.0 if s.completion == "7" else value)
    with pytest.raises(RewardError, match=rf"^reward 'huge' {shown}"):
        score_completions(scorer, INPUTS, UIDS)


def test_a_batched_reward_must_return_one_finite_score_per_sample() -> None:
    ok = reward("lengths", lambda batch: [float(len(s.completion)) for s in batch], batched=True)
    assert score_completions(ok, INPUTS, UIDS) == [1.0, 1.0, 1.0]
    array = reward("array", lambda batch: np.arange(len(batch), dtype=np.float32), batched=True)
    assert score_completions(array, INPUTS, UIDS) == [0.0, 1.0, 2.0]
    short = reward("short", lambda batch: [1.0] * (len(batch) - 1), batched=True)
    with pytest.raises(
        RewardError,
        match=r"^reward 'short' is batched but returned 2 scores for the batch of 3 samples "
        r"\(sample 'rows.jsonl:3#0' \(index 0\) \.\. sample 'rows.jsonl:3#2' \(index 2\)\); a batched reward "
        r"returns exactly one score per sample",
    ):
        score_completions(short, INPUTS, UIDS)
    nan = reward("nan", lambda batch: [0.0, float("inf"), 1.0], batched=True)
    with pytest.raises(RewardError, match=r"^reward 'nan' returned inf for sample 'rows.jsonl:3#1' \(index 1\)"):
        score_completions(nan, INPUTS, UIDS)
    scalar = reward("scalar", lambda batch: 1.0, batched=True)
    with pytest.raises(RewardError, match=r"^reward 'scalar' is batched but returned 1.0 \(float\)"):
        score_completions(scalar, INPUTS, UIDS)
    raising = reward("raising", lambda batch: 1 / 0, batched=True)
    with pytest.raises(RewardError, match=r"^reward 'raising' failed on the batch of 3 samples .*ZeroDivisionError"):
        score_completions(raising, INPUTS, UIDS)


def test_a_batched_custom_reward_is_declared_by_attribute(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hard15_batched.py").write_text(
        "def scores(batch):\n    return [float(s.completion == '7') for s in batch]\nscores.batched = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = get_reward("hard15_batched:scores")
    assert getattr(scorer, "batched", False)
    assert score_completions(scorer, INPUTS, UIDS) == [1.0, 0.0, 0.0]


def test_the_first_bad_sample_is_the_one_reported() -> None:
    calls: list[str] = []

    def fn(sample: RewardInput) -> Any:
        calls.append(sample.completion)
        if sample.completion == "9":
            raise ValueError("boom")
        return None if sample.completion == "8" else 1.0

    with pytest.raises(RewardError, match=r"returned None \(NoneType\) for sample 'rows.jsonl:3#1'"):
        score_completions(reward("order", fn), INPUTS, UIDS)


# ---------------------------------------------------------------- item 5: a scorer that never returns


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown, so that a scorer blocked on it (and abandoned by the timeout) ends."""
    event = threading.Event()
    yield event
    event.set()


def test_a_hung_reward_becomes_a_named_timeout_error(release: threading.Event) -> None:
    # Without the timeout this call would block until the fixture releases it (20 s at most here).
    def stuck(sample: RewardInput) -> float:
        if sample.completion == "8":
            release.wait(20)
        return 1.0

    hung = reward("stuck", stuck)
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        score_completions(hung, INPUTS, UIDS, timeout_s=0.3)
    assert time.monotonic() - start < 5
    assert str(info.value).startswith(
        "reward 'stuck' did not return within rl.reward_timeout_s=0.3 s on sample 'rows.jsonl:3#1' (index 1); "
        "the run stops (the scorer is left running in an abandoned daemon thread"
    )
    assert "raise rl.reward_timeout_s (0 disables the timeout)" in str(info.value)
    abandoned = [t for t in threading.enumerate() if t.name == "posttrain-reward"]
    assert abandoned and all(t.daemon for t in abandoned)  # and cannot keep the process alive


def test_the_timeout_is_per_call_and_comes_from_the_reward_or_the_config(release: threading.Event) -> None:
    slow = reward("slow", lambda s: 0.0 if release.wait(0.15) else 1.0)
    assert score_completions(slow, INPUTS, UIDS, timeout_s=0.6) == [1.0, 1.0, 1.0]  # 0.45 s in all
    timed = with_timeout(slow, 0.05)
    assert slow.timeout_s is None and timed.timeout_s == 0.05  # type: ignore[attr-defined]
    with pytest.raises(RewardError, match=r"rl.reward_timeout_s=0.05 s on sample 'rows.jsonl:3#0'"):
        score_completions(timed, INPUTS, UIDS)
    builtin = get_reward("arithmetic", timeout_s=5.0)
    assert builtin.timeout_s == 5.0 and get_reward("arithmetic").timeout_s is None  # type: ignore[attr-defined]
    threads: list[str] = []

    def where(sample: RewardInput) -> float:
        threads.append(threading.current_thread().name)
        return 1.0

    inline = reward("inline", where)
    score_completions(inline, INPUTS[:1], timeout_s=0)
    score_completions(inline, INPUTS[:1], timeout_s=1)
    assert threads == [threading.current_thread().name, "posttrain-reward"]
    assert build_config(None, []).rl.reward_timeout_s == 60.0
    for bad in ("-1", ".inf", ".nan"):
        with pytest.raises(ConfigError, match=r"rl\.reward_timeout_s"):
            build_config(None, [f"rl.reward_timeout_s={bad}"])


SIGNAL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from posttrain.checkpoint.graceful_stop import GracefulStop
    from posttrain.errors import RewardError
    from posttrain.rewards.base import RewardInput
    from posttrain.rewards.registry import FunctionReward, score_completions

    timeout, signals = float(sys.argv[1]), int(sys.argv[2])

    def hang(sample):
        end = time.monotonic() + 20  # "never" returns (bounded so that no test can hang for ever)
        while time.monotonic() < end:
            time.sleep(0.01)
        return 1.0

    def send():
        for _ in range(signals):
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send, daemon=True).start()
    start = time.monotonic()
    with GracefulStop() as stop:
        try:
            score_completions(FunctionReward("hang", frozenset({"prompt"}), hang), [RewardInput("p", "c")], ["u:1"],
                              timeout_s=timeout)
            print("returned")
        except RewardError as exc:
            print("RewardError", "requested" if stop.requested else "-", str(exc)[:80])
        except KeyboardInterrupt as exc:
            print("KeyboardInterrupt", exc)
    print(f"elapsed {time.monotonic() - start:.1f}")
    """
)


def _signal_run(timeout_s: float, signals: int) -> tuple[list[str], float]:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", SIGNAL_SCRIPT, str(timeout_s), str(signals)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines(), time.monotonic() - start


def test_sigterm_still_stops_a_run_whose_reward_hangs() -> None:
    # One SIGTERM asks for a stop after the batch; the batch cannot finish, so the timeout ends it.
    lines, _ = _signal_run(timeout_s=1.0, signals=1)
    assert lines[0].startswith("RewardError requested reward 'hang' did not return within rl.reward_timeout_s=1 s")
    assert float(lines[1].split()[1]) < 5
    # A second SIGTERM stops at once, long before the timeout, and the abandoned thread does not
    # keep the process from exiting.
    lines, wall = _signal_run(timeout_s=60.0, signals=2)
    assert lines[0] == "KeyboardInterrupt second stop signal (SIGTERM)"
    assert float(lines[1].split()[1]) < 5 and wall < 15


# ---------------------------------------------------------------- ground-truth checks agree with scoring


@pytest.mark.parametrize("name", ["arithmetic", "arithmetic_first", "gsm8k", "exact_match", "countdown"])
def test_check_ground_truth_accepts_exactly_what_the_reward_can_score(name: str) -> None:
    values: list[Any] = [
        7,
        -3,
        2.5,
        "7",
        " 1,234 ",
        "1e3",
        "",
        "  ",
        "twelve",
        True,
        False,
        [7],
        {"a": 1},
        float("nan"),
        float("inf"),
        10**30,
        "#### 7",
        "x #### y",
        {"nums": [3, 4], "target": 7},
        {"nums": [], "target": 1},
        '{"nums": [1], "target": 1}',
        0.1,
    ]
    scorer = get_reward(name)
    for value in values:
        problem = ground_truth_problem(scorer, value)
        sample = RewardInput(prompt="p", completion="7", ground_truth=value)
        try:
            score_completions(scorer, [sample], ["u:1"])
        except RewardError as exc:
            assert problem is not None, (name, value, exc)
        else:
            assert problem is None, (name, value, problem)


def test_the_worker_thread_keeps_the_callers_grad_mode() -> None:
    import torch

    seen: list[bool] = []

    def grad_mode(sample: RewardInput) -> float:
        seen.append(torch.is_grad_enabled())
        return 0.0

    with torch.no_grad():
        score_completions(reward("grad", grad_mode), INPUTS[:1])
    score_completions(reward("grad", grad_mode), INPUTS[:1])
    assert seen == [False, True]
