"""Checkpoint uploads (``rl.upload``, ``checkpoint/upload.py``) to a local directory and to an
S3-compatible server this test starts (moto's server mode, a real HTTP server in a subprocess, reached
through s3fs): the copy is complete and manifest-last, ``.uploaded`` marks it locally, retention waits
for it, a failed upload is loud and keeps its checkpoint (and stops the run with
``rl.upload.required=true``), and ``rl.resume=auto`` resumes from the destination once the local
checkpoints are gone, bit for bit like the run that was never interrupted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from posttrain.checkpoint import CheckpointWriter, TrainingState, capture_rng, verify_checkpoint
from posttrain.checkpoint.manifest import read_manifest
from posttrain.checkpoint.upload import UPLOADED_NAME, UploadError, start_uploads
from posttrain.config.loading import build_config
from posttrain.config.schema import RunConfig

pytest.importorskip("s3fs", reason="the upload tests need s3fs (pip install 'posttrain[upload]')")
# moto's server is only looked up, never imported here: importing it brings Flask's context proxies
# into sys.modules, and vLLM's CPU kernel registration (which walks module globals) trips over them
# in the vLLM tests collected into the same pytest process
if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
    pytest.skip("the S3 tests need moto's server mode (pip install 'moto[server]')", allow_module_level=True)

BUCKET = "archive"
JOB = ("posttrain", "grpo")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class S3Server:
    """moto's S3-compatible server in a subprocess on a free port; ``stop()`` makes it unreachable."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("moto's server did not start") from None
                time.sleep(0.05)

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """A fresh server with one bucket; dummy AWS credentials for this test process only."""
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    server = S3Server()
    try:
        server.fs().mkdir(BUCKET)
        yield server
    finally:
        server.stop()


def _s3_overrides(server: S3Server, *extra: str) -> list[str]:
    # s3fs's own retries off: a stopped server fails at once, the test's rl.upload.retries decide
    options = f"{{endpoint_url: '{server.endpoint}', config_kwargs: {{retries: {{max_attempts: 1}}}}}}"
    return [
        "rl.upload.enabled=true",
        f"rl.upload.destination=s3://{BUCKET}/runs",
        f"rl.upload.storage_options={options}",
    ]


# -- the library, with a small model ---------------------------------------------------------------


def _trio(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _state(step: int) -> TrainingState:
    identity = {"data_seed": 0, "objective": {}, "ref_anchor": None, "n_mini": 1}
    return TrainingState(step, step, 0, {"index": step}, {"generate_calls": step}, capture_rng(), identity)


def _save_steps(
    cfg: RunConfig, run_dir: Path, steps: list[int], lines: list[str], *, keep: int | None = None, finish: bool = True
) -> Any:
    """Save ``steps`` with uploads on (retention ``keep`` for weights and optimizer); returns the uploads."""
    uploads = start_uploads(cfg, run_dir, lines.append, keep_model_last=keep, keep_optim_last=keep)
    assert uploads is not None
    writer = CheckpointWriter(
        run_dir / "checkpoints", keep_model_last=keep, keep_optim_last=keep, on_published=uploads.on_published
    )
    model, opt, sched = _trio()
    for step in steps:
        with torch.no_grad():
            next(model.parameters()).add_(0.1)  # every checkpoint holds other bytes
        writer.save(step, model, opt, sched, _state(step))
    writer.wait()
    if finish:
        uploads.finish()
        uploads.close()
    return uploads


def _digests(files: dict[str, bytes]) -> dict[str, str]:
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}


def _local_files(ckpt: Path) -> dict[str, bytes]:
    return {p.relative_to(ckpt).as_posix(): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}


def test_upload_to_a_local_directory(tmp_path: Path) -> None:
    dest = tmp_path / "mounted_archive"
    cfg = build_config(
        None,
        [
            "job.name=local",
            f"job.output_root={tmp_path / 'out'}",
            "rl.upload.enabled=true",
            f"rl.upload.destination={dest}",
        ],
    )
    run_dir = tmp_path / "out" / "posttrain" / "grpo" / "local" / "20260101-000000"
    lines: list[str] = []
    _save_steps(cfg, run_dir, [1, 2], lines)
    for step in (1, 2):
        ckpt = run_dir / "checkpoints" / f"iter_{step:09d}"
        remote = dest / "posttrain" / "grpo" / "local" / run_dir.name / "checkpoints" / ckpt.name
        marker = json.loads((ckpt / UPLOADED_NAME).read_text())
        assert marker["destination"] == f"{dest}/posttrain/grpo/local/{run_dir.name}/checkpoints/{ckpt.name}"
        assert marker["bytes"] == sum(e["size"] for e in read_manifest(ckpt)["files"].values())
        local = _local_files(ckpt)
        del local[UPLOADED_NAME]  # the marker stays local
        assert _digests(_local_files(remote)) == _digests(local)
        assert verify_checkpoint(remote) == []  # the copy is itself a complete checkpoint
    assert (dest / "posttrain" / "grpo" / "local" / run_dir.name / "metrics.jsonl").exists() is False  # none written
    assert any(line.startswith("upload: iter_000000002 -> ") for line in lines)


def test_upload_to_an_s3_server_manifest_last_and_retention_after_it(tmp_path: Path, s3: S3Server) -> None:
    cfg = build_config(None, ["job.name=s3", f"job.output_root={tmp_path / 'out'}", *_s3_overrides(s3)])
    run_dir = tmp_path / "out" / "posttrain" / "grpo" / "s3" / "20260101-000000"
    (run_dir).mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    lines: list[str] = []
    _save_steps(cfg, run_dir, [1, 2, 3], lines, keep=1)
    fs = s3.fs()
    prefix = f"{BUCKET}/runs/posttrain/grpo/s3/{run_dir.name}"
    for step in (1, 2, 3):
        name = f"iter_{step:09d}"
        files = read_manifest(run_dir / "checkpoints" / "iter_000000003")["files"] if step == 3 else None
        remote = {p.removeprefix(f"{prefix}/checkpoints/{name}/"): p for p in fs.find(f"{prefix}/checkpoints/{name}")}
        assert "manifest.json" in remote and "training_state.json" in remote and UPLOADED_NAME not in remote
        if files is not None:
            local = run_dir / "checkpoints" / name
            for rel in files:
                assert hashlib.sha256(fs.cat_file(remote[rel])).hexdigest() == files[rel]["sha256"]
            assert json.loads(fs.cat_file(remote["manifest.json"])) == read_manifest(local)
    assert fs.cat_file(f"{prefix}/metrics.jsonl") == b'{"step": 1}\n'
    # retention (keep 1) ran once the uploads were done: only the newest checkpoint is left locally;
    # the destination is an archive and keeps every copy
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["iter_000000003", "latest_checkpoint.txt"]


def test_a_failed_upload_is_loud_keeps_its_checkpoint_and_required_stops(tmp_path: Path, s3: S3Server) -> None:
    out = tmp_path / "out"
    cfg = build_config(
        None,
        [
            "job.name=down",
            f"job.output_root={out}",
            "rl.upload.retries=1",
            "rl.upload.retry_backoff_s=0",
            *_s3_overrides(s3),
        ],
    )
    run_dir = out / "posttrain" / "grpo" / "down" / "20260101-000000"
    lines: list[str] = []
    _save_steps(cfg, run_dir, [1], lines, keep=1)  # uploaded while the server runs
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "iter_000000001" / UPLOADED_NAME).is_file()
    s3.stop()
    lines.clear()
    uploads = _save_steps(cfg, run_dir, [2, 3], lines, keep=1, finish=False)
    uploads.finish()  # not required: reports, does not raise
    uploads.close()
    for step in (2, 3):
        ckpt = ckpts / f"iter_{step:09d}"
        assert not (ckpt / UPLOADED_NAME).exists()
        assert verify_checkpoint(ckpt) == [] and not read_manifest(ckpt)["pruned"]  # kept whole by retention
    assert not (ckpts / "iter_000000001").exists()  # uploaded, so retention could delete it
    failed = [line for line in lines if line.startswith("error: upload of ") and " FAILED after 2 attempt(s): " in line]
    assert len(failed) >= 2, lines  # each of 2 and 3 (and 2 again when 3 was queued)
    assert any(line.startswith("warning: upload of ") and "(attempt 1 of 2)" in line for line in lines)
    assert any(line.startswith("error: 2 checkpoint(s) NOT uploaded to s3://archive/runs: ") for line in lines)

    required = cfg.model_copy(deep=True)
    required.rl.upload.required = True
    uploads = _save_steps(required, run_dir, [4], [], keep=1, finish=False)
    with pytest.raises(UploadError) as info:
        uploads.finish()
    uploads.close()
    text = str(info.value)
    assert "checkpoint upload to rl.upload.destination='s3://archive/runs' failed after 2 attempt(s)" in text
    assert "iter_000000004" in text and "rl.upload.required=true stops the run" in text
    assert "set rl.upload.required=false to train on without the copies" in text


def test_resume_picks_the_newest_of_here_and_the_archive_and_skips_a_bad_copy(tmp_path: Path) -> None:
    from posttrain.checkpoint.upload import fetch_from_destination

    dest, out = tmp_path / "archive", tmp_path / "out"
    cfg = build_config(
        None, ["job.name=pick", f"job.output_root={out}", "rl.upload.enabled=true", f"rl.upload.destination={dest}"]
    )
    job = out / "posttrain" / "grpo" / "pick"
    run_dir = job / "20260101-000000"
    _save_steps(cfg, run_dir, [1, 2, 3], [])
    ckpts = run_dir / "checkpoints"
    lines: list[str] = []
    # the newest local checkpoint is as new as the archive's: nothing is downloaded
    assert fetch_from_destination(cfg, job, ckpts / "iter_000000003", lines.append) == ckpts / "iter_000000003"
    assert lines == []
    # steps 2 and 3 are gone here, and the archive's step-3 copy is truncated: it is skipped with a
    # warning, and the archive's step 2 (newer than the local step 1) is downloaded instead
    shutil.rmtree(ckpts / "iter_000000003")
    shutil.rmtree(ckpts / "iter_000000002")
    remote3 = dest / "posttrain" / "grpo" / "pick" / run_dir.name / "checkpoints" / "iter_000000003"
    with open(remote3 / "model.safetensors", "r+b") as fh:
        fh.truncate(10)
    got = fetch_from_destination(cfg, job, ckpts / "iter_000000001", lines.append)
    assert got == ckpts / "iter_000000002" and verify_checkpoint(got) == [] and (got / UPLOADED_NAME).is_file()
    assert lines[0].startswith(f"warning: skipping the archived checkpoint {remote3}: ")
    assert "model.safetensors: 10 bytes, the manifest says " in lines[0]
    assert lines[1] == f"rl.resume=auto: downloaded iter_000000002 of attempt {run_dir.name} from {dest} to {got}"
    assert not list(ckpts.glob("*.tmp-*"))  # the skipped download left nothing behind


# -- the loop: a failing destination with required=true, and a resume from the archive -------------


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every metric but wall-clock ones (timers, rollout throughput), as tests/integration/test_grpo_e2e.py."""
    return [{k: v for k, v in r.items() if not k.startswith(("timer/", "rollout/"))} for r in records]


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def test_required_upload_failure_stops_the_run_by_name(
    tiny_model_dir: str, tmp_path: Path, run_overrides: Callable[..., list[str]]
) -> None:
    from posttrain.loop.grpo import train

    dest = tmp_path / "archive"
    dest.mkdir()
    (dest / "posttrain").write_text("a file where the job's directory must go")  # every upload fails
    args = ["rl.max_steps=4", "rl.save_every=1", "rl.upload.enabled=true", f"rl.upload.destination={dest}"]
    args += ["rl.upload.required=true", "rl.upload.retries=0"]
    cfg = build_config(None, run_overrides(tiny_model_dir, tmp_path / "out", "req", *args))
    with pytest.raises(UploadError, match=r"rl\.upload\.required=true stops the run") as info:
        train(cfg)
    assert "iter_000000001" in str(info.value)
    run_dir = next((tmp_path / "out" / "posttrain" / "grpo" / "req").iterdir())
    log = (run_dir / "train.log").read_text()
    assert "error: upload of " in log and " FAILED after 1 attempt(s): " in log
    assert verify_checkpoint(run_dir / "checkpoints" / "iter_000000001") == []  # intact locally
    assert len(_records(run_dir)) < 4  # stopped before the last step


def test_resume_from_the_s3_destination_after_the_local_copy_is_gone(
    tiny_model_dir: str, tmp_path: Path, run_overrides: Callable[..., list[str]], s3: S3Server
) -> None:
    """A 2-step run uploads both checkpoints; then the job is "killed after step 2's save, before its
    upload" (the archive's step-2 copy goes) and the machine is lost (the local job directory goes).
    ``rl.resume=auto`` downloads step 1 and repeats step 2 bit for bit."""
    from posttrain.loop.grpo import train

    out = tmp_path / "out"
    steps = ["rl.max_steps=2", "rl.save_every=1", *_s3_overrides(s3)]
    first = train(build_config(None, run_overrides(tiny_model_dir, out, "cut", *steps)))
    assert all((first / "checkpoints" / f"iter_{n:09d}" / UPLOADED_NAME).is_file() for n in (1, 2))
    whole_records = _records(first)
    whole_weights = _weights(first / "checkpoints" / "iter_000000002")
    s3.fs().rm(f"{BUCKET}/runs/posttrain/grpo/cut/{first.name}/checkpoints/iter_000000002", recursive=True)
    shutil.rmtree(out / "posttrain" / "grpo" / "cut")
    time.sleep(1.1)  # the next attempt's directory gets a later timestamp
    resumed = train(build_config(None, run_overrides(tiny_model_dir, out, "cut", *steps, "rl.resume=auto")))
    log = (resumed / "train.log").read_text()
    fetched = out / "posttrain" / "grpo" / "cut" / first.name / "checkpoints" / "iter_000000001"
    assert f"rl.resume=auto: downloaded iter_000000001 of attempt {first.name} from s3://archive/runs" in log
    assert f"resumed from {fetched}: 1 collected batches done" in log
    assert (fetched / UPLOADED_NAME).is_file() and verify_checkpoint(fetched) == []
    # the resumed attempt's metrics (its history downloaded beside the checkpoint) and final weights
    # equal those of the run that was never interrupted, bit for bit
    assert [r["step"] for r in _records(resumed)] == [1, 2]
    assert _comparable(_records(resumed)) == _comparable(whole_records)
    final = _weights(resumed / "checkpoints" / "iter_000000002")
    assert final.keys() == whole_weights.keys() and all(torch.equal(final[k], whole_weights[k]) for k in final)
