"""W&B in offline mode (``WANDB_MODE=offline``, the ``wandb`` extra): every attempt of one job logs to
one W&B run id, kept in the job directory's ``wandb_id``; an attempt that resumes (``rl.resume``)
reuses it, a fresh one (``rl.resume=off``) starts a new run."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from posttrain.config.loading import build_config
from posttrain.metrics.sinks import WANDB_ID_FILE, MetricsLogger

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason="wandb is not installed (`pip install posttrain[wandb]`)"
)


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def offline_run_ids(run_dir: Path) -> list[str]:
    """The W&B run ids an attempt logged offline (``wandb/offline-run-<time>-<id>``)."""
    return [p.name.rsplit("-", 1)[-1] for p in sorted((run_dir / "wandb").glob("offline-run-*"))]


def test_a_resumed_attempt_logs_to_the_same_wandb_run(
    tiny_model_dir: str, tmp_path: Path, run_overrides: Callable[..., list[str]]
) -> None:
    from posttrain.loop.grpo import train

    base = run_overrides(tiny_model_dir, tmp_path, "tracked", "job.wandb=true", "rl.save_every=1")
    first = train(build_config(None, [*base, "rl.max_steps=1"]))
    second = train(build_config(None, [*base, "rl.max_steps=2", "rl.resume=auto"]))
    stored = (first.parent / WANDB_ID_FILE).read_text().strip()
    assert offline_run_ids(first) == [stored]
    assert offline_run_ids(second) == [stored]
    steps = [json.loads(line)["step"] for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the second attempt resumed after step 1 and trained step 2


def test_a_fresh_attempt_starts_a_new_wandb_run_and_a_bad_id_file_is_replaced(tmp_path: Path) -> None:
    job = tmp_path / "job"
    ids = []
    for attempt, resume in [("a", False), ("b", True), ("c", False)]:
        with MetricsLogger(job / attempt, wandb=True, console=False, wandb_resume=resume) as logger:
            logger.log(1, {"train/reward_mean": 0.5})
        ids.append(offline_run_ids(job / attempt)[0])
    assert ids[0] == ids[1] != ids[2]
    assert (job / WANDB_ID_FILE).read_text().strip() == ids[2]
    (job / WANDB_ID_FILE).write_text("not/an id\n")
    with MetricsLogger(job / "d", wandb=True, console=False, wandb_resume=True) as logger:
        logger.log(1, {"x": 1.0})
    fresh = offline_run_ids(job / "d")[0]
    assert fresh not in ids and (job / WANDB_ID_FILE).read_text().strip() == fresh
