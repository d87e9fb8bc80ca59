"""The run report: reading metrics.jsonl, the summary numbers and the PNG (posttrain.metrics.report)."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest

from posttrain.metrics import MetricsLogger, ReportError, read_metrics, summarize, write_report
from posttrain.metrics.report import _rolling_mean

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _reward(step: int) -> float:
    # Deterministic, noisy-looking upward curve.
    return round(0.1 + 0.015 * step + 0.05 * ((step * 7) % 5 - 2) / 2, 4)


def _synthetic_run(run_dir: Path, steps: int = 40, kl: bool = True) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics.jsonl").open("w") as f:
        for s in range(1, steps + 1):
            rec = {
                "step": s,
                "train/reward_mean": _reward(s),
                "train/grpo_informative_group_count": s % 4,
                "train/clip_frac": 0.0,
                "train/response_len_mean": 10.0 + s / 4,
                "train/response_len_max": 16,
                "timer/e2e_step_s": 2.0 + (s % 3),
            }
            if kl:
                rec["train/kl_mean"] = 0.001 * s
                rec["train/kl_max"] = 0.01 * s
            f.write(json.dumps(rec) + "\n")
        f.write('{"step": 41, "train/reward_mean": 0.9')  # killed mid-write


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_report_png_and_summary_from_truncated_run(tmp_path: Path, caplog) -> None:
    run_dir = tmp_path / "posttrain" / "grpo" / "default" / "20250101-000000"
    _synthetic_run(run_dir)
    with caplog.at_level(logging.WARNING, logger="posttrain.metrics"):
        png, text = write_report(run_dir)
    assert png == run_dir / "report.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    assert png.stat().st_size > 10_000
    width, height = _png_size(png)
    assert width > 800 and height > 400
    # The truncated last line is skipped with a warning naming file and line.
    warned = [r.getMessage() for r in caplog.records if "truncated last line" in r.getMessage()]
    assert len(warned) == 1 and "metrics.jsonl:41" in warned[0]

    first = sum(_reward(s) for s in range(1, 11)) / 10
    last = sum(_reward(s) for s in range(31, 41)) / 10
    records, skipped = read_metrics(run_dir / "metrics.jsonl")
    assert skipped == 1
    summary = summarize(records)
    assert summary["steps"] == 40 and summary["quarter"] == 10
    assert (summary["first_step"], summary["last_step"]) == (1, 40)
    assert summary["reward_first_quarter_mean"] == pytest.approx(first)
    assert summary["reward_last_quarter_mean"] == pytest.approx(last)
    assert summary["reward_gain"] == pytest.approx(last - first)
    assert summary["mean_step_time_s"] == pytest.approx(sum(2.0 + (s % 3) for s in range(1, 41)) / 40)
    assert summary["metrics"]["train/reward_mean"]["final"] == _reward(40)
    assert summary["metrics"]["train/kl_max"]["final"] == pytest.approx(0.4)
    assert summary["metrics"]["train/grpo_informative_group_count"]["final"] == 0.0

    assert "steps: 40 (step 1..40; a quarter is 10 steps)" in text
    reward_row = next(line for line in text.splitlines() if line.startswith("train/reward_mean"))
    assert reward_row.split()[1:] == [f"{first:.4g}", f"{last:.4g}", f"{_reward(40):.4g}"]
    assert f"reward gain (last 1/4 mean - first 1/4 mean): {last - first:+.4g}" in text
    assert "skipped 1 malformed line(s)" in text


def test_report_without_kl_and_custom_output(tmp_path: Path) -> None:
    _synthetic_run(tmp_path / "run", steps=30, kl=False)
    out = tmp_path / "elsewhere" / "curves.png"
    png, text = write_report(tmp_path / "run", out)
    assert png == out and out.read_bytes()[:8] == PNG_SIGNATURE
    assert not (tmp_path / "run" / "report.png").exists()
    assert "train/kl_" not in text
    assert "a quarter is 7 steps" in text  # 30 // 4


def test_report_accepts_the_metrics_file_itself(tmp_path: Path) -> None:
    _synthetic_run(tmp_path, steps=8)
    png, _ = write_report(tmp_path / "metrics.jsonl")
    assert png == tmp_path / "report.png" and png.is_file()


def test_report_from_metrics_logger_output(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, console=False) as logger:
        for s in range(1, 9):
            logger.log(s, {"train/reward_mean": s / 8, "timer/e2e_step_s": 1.5, "train/clip_frac": None})
    png, text = write_report(tmp_path)
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    summary = summarize(read_metrics(tmp_path / "metrics.jsonl")[0])
    assert summary["reward_first_quarter_mean"] == pytest.approx((1 / 8 + 2 / 8) / 2)
    assert summary["reward_last_quarter_mean"] == pytest.approx((7 / 8 + 8 / 8) / 2)
    assert "train/clip_frac" not in summary["metrics"]  # only nulls: no row, no panel
    assert "mean step time: 1.5 s" in text


def test_missing_metrics_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=rf"no metrics file at {tmp_path / 'nope' / 'metrics.jsonl'}"):
        write_report(tmp_path / "nope")


def test_empty_metrics_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x"\n')
    with pytest.raises(ReportError, match="holds no metric records"):
        write_report(tmp_path)


def test_repeated_steps_keep_the_latest_record(tmp_path: Path, caplog) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "train/reward_mean": 0.1},
        {"step": 2, "train/reward_mean": 0.2},
        {"step": 3, "train/reward_mean": 0.3},  # logged by the killed attempt
        {"step": 3, "train/reward_mean": 0.35},  # the resumed attempt's step 3
        {"step": 4, "train/reward_mean": 0.4},
    ]
    text = "\n".join(json.dumps(r) for r in lines[:3]) + '\n{"step": 4, "tr\n'
    text += "\n".join(json.dumps(r) for r in lines[3:]) + "\n"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="posttrain.metrics"):
        records, skipped = read_metrics(path)
    assert [r["train/reward_mean"] for r in records] == [0.1, 0.2, 0.35, 0.4]
    assert skipped == 1
    assert any("metrics.jsonl:4: skipped malformed metrics line" in r.getMessage() for r in caplog.records)


def test_rolling_mean_matches_reference() -> None:
    ys = [1.0, 3.0, 2.0, 6.0, 4.0, 5.0]
    window = 3
    expected = [sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1]) for i in range(6)]
    assert _rolling_mean(ys, window) == pytest.approx(expected)
    assert _rolling_mean(ys, 1) == ys
