"""Metric sinks, the console line, timers and progress bars (posttrain.metrics)."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.metrics import (
    MetricsLogger,
    StepTimer,
    format_number,
    format_step_line,
    progress,
    to_json_number,
)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _warnings(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "posttrain.metrics" and needle in r.getMessage()
    ]


# -- metrics.jsonl ------------------------------------------------------------------------------


def test_jsonl_round_trip_keys_and_steps(tmp_path: Path) -> None:
    frames = {
        1: {"train/reward_mean": 0.25, "train/loss_avg": -0.5, "optim/zero_grad_skips_total": 0},
        2: {"train/reward_mean": 0.5, "train/loss_avg": -0.25, "optim/zero_grad_skips_total": 1},
        3: {"train/reward_mean": 0.75, "train/loss_avg": 0.125, "optim/zero_grad_skips_total": 1},
    }
    with MetricsLogger(tmp_path / "run", console=False) as logger:
        for step, metrics in frames.items():
            logger.log(step, metrics)
            # Flushed per line: readable while the run is still going.
            assert len(_read_jsonl(tmp_path / "run" / "metrics.jsonl")) == step
    records = _read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert records == [{"step": s, **m} for s, m in frames.items()]
    assert all(next(iter(r)) == "step" for r in records)  # step is the first key of each line
    assert isinstance(records[1]["optim/zero_grad_skips_total"], int)


def test_tensor_numpy_and_int_values_are_converted(tmp_path: Path, caplog) -> None:
    metrics = {
        "t_f32": torch.tensor(0.1, dtype=torch.float32),
        "t_f64_grad": torch.tensor(2.5, dtype=torch.float64, requires_grad=True),
        "t_int": torch.tensor(7),
        "t_one_elem": torch.tensor([3.0]),
        "np_f32": np.float32(0.406),
        "np_f64": np.float64(-1.25),
        "np_int": np.int64(12),
        "np_0d": np.array(4.5),
        "py_int": 3,
        "py_bool": True,
        "vector": torch.tensor([1.0, 2.0]),
        "text": "abc",
    }
    with (
        caplog.at_level(logging.WARNING, logger="posttrain.metrics"),
        MetricsLogger(tmp_path, console=False) as logger,
    ):
        logger.log(5, metrics)
    (record,) = _read_jsonl(tmp_path / "metrics.jsonl")
    assert record == {
        "step": 5,
        "t_f32": float(np.float32(0.1)),  # the exact float32 value, widened
        "t_f64_grad": 2.5,
        "t_int": 7,
        "t_one_elem": 3.0,
        "np_f32": float(np.float32(0.406)),
        "np_f64": -1.25,
        "np_int": 12,
        "np_0d": 4.5,
        "py_int": 3,
        "py_bool": 1,
    }
    for key in ("t_int", "np_int", "py_int", "py_bool"):
        assert type(record[key]) is int
    # Non-scalars are dropped, each with one warning naming the key.
    assert len(_warnings(caplog, "'vector'")) == 1
    assert len(_warnings(caplog, "'text'")) == 1


def test_to_json_number() -> None:
    assert to_json_number(None) is None
    assert to_json_number(float("nan")) is None
    assert to_json_number(np.float32("inf")) is None
    assert to_json_number(torch.tensor(-float("inf"))) is None
    assert to_json_number(np.int32(-4)) == -4
    with pytest.raises(TypeError, match="not a single number"):
        to_json_number(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="not a number: str"):
        to_json_number("0.5")


def test_nan_and_inf_written_as_null_warned_once_per_key(tmp_path: Path, caplog) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="posttrain.metrics"),
        MetricsLogger(tmp_path, console=False) as logger,
    ):
        for step in range(1, 4):
            logger.log(step, {"a": float("nan"), "b": torch.tensor(float("inf")), "c": 1.0})
    records = _read_jsonl(tmp_path / "metrics.jsonl")  # json.loads would reject NaN tokens
    assert [r["a"] for r in records] == [None, None, None]
    assert [r["b"] for r in records] == [None, None, None]
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()
    assert len(_warnings(caplog, "metric 'a' is nan at step 1")) == 1
    assert len(_warnings(caplog, "metric 'b'")) == 1
    assert len(_warnings(caplog, "null")) == 2


def test_resume_step_drops_later_records_and_repairs_truncated_tail(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    good = "".join(json.dumps({"step": s, "x": s * 1.0}) + "\n" for s in range(1, 6))
    path.write_text(good + '{"step": 6, "x": 6.')  # the killed attempt's half-written line
    with MetricsLogger(tmp_path, console=False, resume_step=3) as logger:
        logger.log(4, {"x": 40.0})
    assert _read_jsonl(path) == [
        {"step": 1, "x": 1.0},
        {"step": 2, "x": 2.0},
        {"step": 3, "x": 3.0},
        {"step": 4, "x": 40.0},
    ]


def test_append_after_truncated_line_starts_a_new_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(2, {"x": 2.0})
    lines = path.read_text().splitlines()
    assert lines == ['{"step": 1, "x": 1.0}', '{"step": 2, "x"', '{"step": 2, "x": 2.0}']


# -- failure policy -----------------------------------------------------------------------------


def test_unwritable_run_dir_warns_once_per_sink_and_never_raises(tmp_path: Path, caplog, capsys) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a regular file where a directory should be")
    run_dir = blocker / "run"  # its parent is a file: no user, root included, can create it
    with caplog.at_level(logging.WARNING, logger="posttrain.metrics"):
        logger = MetricsLogger(run_dir, tensorboard=True, max_steps=5)
        for step in range(1, 6):
            logger.log(step, {"train/reward_mean": 0.5})
            logger.info(f"message {step}")
        logger.close()
    jsonl = _warnings(caplog, "metrics sink metrics.jsonl failed")
    assert len(jsonl) == 1
    assert str(run_dir / "metrics.jsonl") in jsonl[0]
    assert "NotADirectoryError" in jsonl[0] or "FileExistsError" in jsonl[0]
    assert len(_warnings(caplog, "metrics sink train.log failed")) == 1
    assert len(_warnings(caplog, "metrics sink tensorboard failed")) == 1
    assert not run_dir.exists()
    # The console keeps working when the files cannot be written.
    out = capsys.readouterr().out
    assert "step 5/5 train/reward_mean 0.5" in out
    assert "message 5" in out


def test_jsonl_keeps_retrying_and_reports_recovery(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "later_a_dir"
    blocker.write_text("")
    run_dir = blocker / "run"
    with caplog.at_level(logging.WARNING, logger="posttrain.metrics"):
        logger = MetricsLogger(run_dir, console=False)
        logger.log(1, {"x": 1.0})
        logger.log(2, {"x": 2.0})
        blocker.unlink()  # the obstacle goes away (disk cleaned up, mount back)
        logger.log(3, {"x": 3.0})
        logger.close()
    assert _read_jsonl(run_dir / "metrics.jsonl") == [{"step": 3, "x": 3.0}]
    assert len(_warnings(caplog, "metrics sink metrics.jsonl failed")) == 1
    assert len(_warnings(caplog, "works again; 2 frame(s) were lost")) == 1


def test_missing_wandb_is_one_warning(tmp_path: Path, caplog, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails as if it were not installed
    with (
        caplog.at_level(logging.WARNING, logger="posttrain.metrics"),
        MetricsLogger(tmp_path, wandb=True, console=False) as logger,
    ):
        logger.log(1, {"x": 1.0})
        logger.log(2, {"x": 2.0})
    (msg,) = _warnings(caplog, "wandb")
    assert "metrics sink wandb failed" in msg and "pip install wandb" in msg
    assert len(_read_jsonl(tmp_path / "metrics.jsonl")) == 2


def test_log_after_close_is_dropped_with_a_warning(tmp_path: Path, caplog) -> None:
    logger = MetricsLogger(tmp_path, console=False)
    logger.log(1, {"x": 1.0})
    logger.close()
    logger.close()  # idempotent
    with caplog.at_level(logging.WARNING, logger="posttrain.metrics"):
        logger.log(2, {"x": 2.0})
    assert len(_read_jsonl(tmp_path / "metrics.jsonl")) == 1
    assert len(_warnings(caplog, "after close()")) == 1


# -- TensorBoard --------------------------------------------------------------------------------


def test_tensorboard_event_file_holds_the_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rewards = [0.125, 0.375, float("nan"), 0.75]
    with MetricsLogger(tmp_path, tensorboard=True, console=False) as logger:
        for step, r in enumerate(rewards, start=1):
            logger.log(step, {"train/reward_mean": r, "train/grpo_informative_group_count": step})
    event_files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/reward_mean", "train/grpo_informative_group_count"}
    # The null (NaN) frame is left out rather than written as a NaN point.
    got = [(e.step, e.value) for e in acc.Scalars("train/reward_mean")]
    assert got == [(1, 0.125), (2, 0.375), (4, 0.75)]
    counts = [(e.step, e.value) for e in acc.Scalars("train/grpo_informative_group_count")]
    assert counts == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]


# -- console ------------------------------------------------------------------------------------


def test_step_line_key_order_and_formatting() -> None:
    metrics = {  # deliberately scrambled, with keys that are not on the console line
        "timer/e2e_step_s": 8.1,
        "train/response_len_mean": 11.5,
        "train/rollout_truncated_frac": 0.25,
        "train/grpo_informative_group_count": 3,
        "train/clip_frac": 0.0,
        "train/kl_max": 0.0345678,
        "train/kl_mean": 1.23456e-5,
        "train/grad_norm": 1.23,
        "train/reward_std": 0.21249,
        "train/reward_mean": 0.40625,
        "train/loss_avg": -0.0123,
        "timer/rollout_s": 5.0,
    }
    assert format_step_line(3, 60, metrics) == (
        "step 3/60 train/loss_avg -0.0123 train/reward_mean 0.4062 train/reward_std 0.2125 "
        "train/grad_norm 1.23 train/kl_mean 1.235e-05 train/kl_max 0.03457 train/clip_frac 0 "
        "train/grpo_informative_group_count 3 train/response_len_mean 11.5 timer/e2e_step_s 8.1"
    )
    without_kl = {k: v for k, v in metrics.items() if "kl_" not in k}
    line = format_step_line(7, None, without_kl)
    assert line.startswith("step 7 train/loss_avg -0.0123 train/reward_mean 0.4062 ")
    assert "kl" not in line
    assert format_step_line(1, 2, {}) == "step 1/2"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.0, "0"),
        (3, "3"),
        (3.0, "3"),
        (-0.0123, "-0.0123"),
        (0.40625, "0.4062"),
        (1234.5678, "1235"),
        (123456.7, "123457"),
        (2.5e-7, "2.5e-07"),
        (None, "null"),
        (float("nan"), "nan"),
        (torch.tensor(0.5), "0.5"),
        (np.int64(42), "42"),
    ],
)
def test_format_number(value, text: str) -> None:
    assert format_number(value) == text


def test_console_every_and_final_step(tmp_path: Path, capsys) -> None:
    with MetricsLogger(tmp_path, console_every=2, max_steps=5) as logger:
        for step in range(1, 6):
            logger.log(step, {"train/loss_avg": step / 10})
        logger.info("saved checkpoint iter_5")
    out_lines = capsys.readouterr().out.splitlines()
    assert out_lines == [
        "step 2/5 train/loss_avg 0.2",
        "step 4/5 train/loss_avg 0.4",
        "step 5/5 train/loss_avg 0.5",  # the last step always prints
        "saved checkpoint iter_5",
    ]
    log_lines = (tmp_path / "train.log").read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in log_lines] == out_lines  # "<date> <time> <line>"


def test_console_off_still_writes_train_log(tmp_path: Path, capsys) -> None:
    with MetricsLogger(tmp_path, console=False, max_steps=9) as logger:
        logger.log(1, {"train/reward_mean": 0.5})
        logger.info("hello")
    assert capsys.readouterr().out == ""
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == ["step 1/9 train/reward_mean 0.5", "hello"]


# -- timers -------------------------------------------------------------------------------------


def test_step_timer_phases_sum_and_reset() -> None:
    timer = StepTimer()
    t0 = time.perf_counter()
    with timer.phase("rollout"):
        time.sleep(0.02)
    with timer.phase("update"):
        time.sleep(0.01)
    with timer.phase("rollout"):  # entered twice in one frame: the two add up
        time.sleep(0.02)
    with pytest.raises(RuntimeError), timer.phase("reward"):
        raise RuntimeError("a failing phase is still timed")
    frame = timer.frame()
    elapsed = time.perf_counter() - t0
    assert set(frame) == {"timer/rollout_s", "timer/update_s", "timer/reward_s", "timer/e2e_step_s"}
    assert frame["timer/rollout_s"] >= 0.04
    assert frame["timer/update_s"] >= 0.01
    assert frame["timer/reward_s"] >= 0.0
    phases = frame["timer/rollout_s"] + frame["timer/update_s"] + frame["timer/reward_s"]
    assert phases <= frame["timer/e2e_step_s"] <= elapsed + 0.05
    # frame() resets: the next frame has only its own phases and its own end-to-end time.
    time.sleep(0.01)
    second = timer.frame()
    assert set(second) == {"timer/e2e_step_s"}
    assert 0.01 <= second["timer/e2e_step_s"] < frame["timer/e2e_step_s"] + 0.05


def test_step_timer_rejects_empty_name() -> None:
    with pytest.raises(ValueError, match="non-empty phase name"), StepTimer().phase(""):
        pass


def test_step_timer_sync_on_cpu_only_machine() -> None:
    timer = StepTimer(sync=True)  # no CUDA here: sync is a no-op, never an error
    with timer.phase("update"):
        pass
    frame = timer.frame()
    assert frame["timer/update_s"] >= 0.0 and math.isfinite(frame["timer/e2e_step_s"])


# -- progress -----------------------------------------------------------------------------------


def test_progress_disabled_passes_items_through(capsys) -> None:
    items = ["a", "b", "c"]
    assert list(progress(items, "rollout", enabled=False)) == items
    with progress(10, "rollout", enabled=False) as bar:
        bar.update(3)
        bar.set_postfix_str("x")
    with pytest.raises(TypeError, match="from a total"):
        iter(progress(5, "x", enabled=False))
    assert capsys.readouterr().err == ""


def test_progress_auto_is_off_when_stderr_is_not_a_tty(capsys) -> None:
    assert list(progress(range(4), "scoring")) == [0, 1, 2, 3]
    assert capsys.readouterr().err == ""  # pytest's captured stderr is not a terminal


def test_progress_forced_draws_a_tqdm_bar(capsys) -> None:
    assert list(progress(range(3), "generating", enabled=True)) == [0, 1, 2]
    with progress(4, "saving", enabled=True) as bar:
        bar.update(4)
    err = capsys.readouterr().err
    # The bars are drawn (and cleared at the end, leave=False, so step lines stay readable).
    assert "generating:" in err and "/3 [" in err
    assert "saving:" in err and "/4 [" in err
