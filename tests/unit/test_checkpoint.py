"""Checkpoints: exact round trips in both formats, integrity checks, retention, async saves, signals.

The resume-identity rules (what a resume must keep unchanged) are the loop's: tests/unit/test_resume.py.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tiny_models
from posttrain.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    GracefulStop,
    TrainingState,
    capture_rng,
    find_latest_complete,
    load_checkpoint,
    read_training_state,
    resolve_resume,
    restore_rng,
    verify_checkpoint,
)
from posttrain.checkpoint.layout import LATEST_NAME, iter_name, read_latest_pointer
from posttrain.checkpoint.manifest import read_manifest
from posttrain.config.loading import build_config
from posttrain.errors import ConfigError

VOCAB = 11


class TiedNet(nn.Module):
    """Small model with a tied weight and a persistent buffer (both must survive a round trip)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.lin = nn.Linear(6, 6)
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(self.emb(ids)) * self.scale))


def tiny_llama() -> nn.Module:
    return tiny_models.tiny_llama(VOCAB)


def build(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(seed)
    model = TiedNet() if kind == "tiny" else tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched: object, seed: int) -> None:
    ids = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(seed))
    out = model(ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()  # type: ignore[attr-defined]


def make_state(step: int, **identity: object) -> TrainingState:
    ident = {"data_seed": 0, "objective": {"loss_type": "token-mean", "epsilon_high": 0.2}, "ref_anchor": None}
    ident.update({"n_mini": 1, **identity})
    return TrainingState(
        step=step,
        optimizer_step=step,
        zero_grad_skips_total=0,
        data_state={"index": step * 4, "seed": 0},
        engine_state={"generate_calls": step},
        rng=capture_rng(),
        identity=ident,
        extra={"note": "x"},
    )


def assert_same_training_state(a: tuple, b: tuple) -> None:
    (ma, oa, sa), (mb, ob, sb) = a, b
    for (na, pa), (nb, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb
        assert torch.equal(pa, pb), na
    sda, sdb = oa.state_dict(), ob.state_dict()
    assert sda["param_groups"] == sdb["param_groups"]
    assert sda["state"].keys() == sdb["state"].keys()
    for k in sda["state"]:
        for key, value in sda["state"][k].items():
            assert torch.equal(value, sdb["state"][k][key]), (k, key)
    assert sa.state_dict() == sb.state_dict()


Trio = tuple[nn.Module, torch.optim.Optimizer, Any]


def save(root: Path, step: int, trio: Trio, state: TrainingState, **kw: object) -> Path:
    """One synchronous save of ``trio`` (model, optimizer, scheduler) through a fresh writer (``kw``:
    ``fmt``, ``keep_*_last``); retention reads what is on disk, so one writer per save changes nothing."""
    with CheckpointWriter(root, **kw) as writer:  # type: ignore[arg-type]
        model, opt, sched = trio
        return writer.save(step, model, opt, sched, state)


def quick_save(root: Path, step: int, fmt: str = "consolidated", **kw: object) -> Path:
    model, opt, sched = build("tiny", seed=step)
    train_step(model, opt, sched, seed=step)
    return save(root, step, (model, opt, sched), make_state(step), fmt=fmt, **kw)


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tiny", "llama"])
@pytest.mark.parametrize("fmt", ["consolidated", "dcp"])
def test_round_trip_continues_bitwise(tmp_path: Path, kind: str, fmt: str) -> None:
    ref = build(kind, seed=0)
    for s in range(3):
        train_step(*ref, seed=s)
    state = make_state(3)
    path = save(tmp_path, 3, ref, state, fmt=fmt)
    assert path == tmp_path / "iter_000000003"
    assert verify_checkpoint(path) == []
    manifest = read_manifest(path)
    assert manifest["checkpoint_format"] == fmt and manifest["step"] == 3
    assert manifest["model_dtype"] == "float32"

    assert read_training_state(path) == state
    resumed = build(kind, seed=123)  # different init: everything must come from the checkpoint
    loaded = load_checkpoint(path, *resumed)
    assert loaded == state
    assert_same_training_state(ref, resumed)
    # the tie survives: one parameter object, not two equal copies
    head, emb = (
        (resumed[0].head.weight, resumed[0].emb.weight)
        if kind == "tiny"
        else (resumed[0].lm_head.weight, resumed[0].model.embed_tokens.weight)
    )
    assert head is emb
    for s in (3, 4):
        train_step(*ref, seed=s)
        train_step(*resumed, seed=s)
    assert_same_training_state(ref, resumed)


def test_consolidated_files_and_hf_meta(tmp_path: Path) -> None:
    model, opt, sched = build("llama", seed=0)
    path = save(tmp_path, 1, (model, opt, sched), make_state(1))
    names = set(read_manifest(path)["files"])
    # the HF side files sit beside the weights (a model directory transformers and vLLM load as is)
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "training_state.json", "config.json"} <= names
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        assert "lm_head.weight" not in set(fh.keys())  # stored once, as an alias
        assert json.loads(fh.metadata()["posttrain_aliases"]) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert json.loads((path / "training_state.json").read_text())["engine_state"] == {"generate_calls": 1}
    assert read_latest_pointer(tmp_path) == path


def test_package_exports_resolve() -> None:
    import posttrain.checkpoint as pkg

    for name in pkg.__all__:
        assert getattr(pkg, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pkg.nope  # noqa: B018


def test_rng_capture_restore_reproduces_draws() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    # advance every generator (numpy also caches a second gaussian, which the state must carry)
    random.random(), np.random.normal(), torch.randn(2)
    state = json.loads(json.dumps(capture_rng()))  # it must survive the JSON file
    first = (random.random(), np.random.normal(), np.random.randint(1 << 30), torch.randn(4), torch.randint(9, (3,)))
    restore_rng(state)
    second = (random.random(), np.random.normal(), np.random.randint(1 << 30), torch.randn(4), torch.randint(9, (3,)))
    assert first[:3] == second[:3]
    assert torch.equal(first[3], second[3]) and torch.equal(first[4], second[4])


def test_training_state_json_rules() -> None:
    state = make_state(2)
    state.extra = {"count": np.int64(3), "loss": torch.tensor(0.5)}
    back = TrainingState.from_json(state.to_json())
    assert back.extra == {"count": 3, "loss": 0.5}
    state.data_state = {"order": object()}
    with pytest.raises(CheckpointError, match=r"TrainingState\.data_state is not JSON-serialisable"):
        state.to_json()


# -- integrity -----------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    f = path / "optimizer.pt"
    f.write_bytes(f.read_bytes()[:-10])


def _flip_byte(path: Path) -> None:
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))


CORRUPTIONS = {
    "missing file": (lambda p: (p / "scheduler.pt").unlink(), "scheduler.pt: missing"),
    "wrong size": (_truncate, "optimizer.pt: .* bytes, the manifest says"),
    "altered bytes": (_flip_byte, "model.safetensors: content differs from the manifest"),
    "missing manifest": (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    for step in (1, 2, 3):
        quick_save(tmp_path, step)
    corrupt, message = CORRUPTIONS[case]
    newest = tmp_path / iter_name(3)
    corrupt(newest)
    with caplog.at_level(logging.WARNING, logger="posttrain.checkpoint"):
        assert find_latest_complete(tmp_path) == tmp_path / iter_name(2)
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "skipping incomplete or corrupt checkpoint" in warning and str(newest) in warning
    assert any(re.search(message, r.getMessage()) for r in caplog.records)
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_checkpoint(newest, *build("tiny", seed=0))
    with pytest.raises(CheckpointError, match="does not verify"):
        resolve_resume(str(newest), tmp_path)


def test_leftover_tmp_dir_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = quick_save(tmp_path, 1)
    partial = tmp_path / "iter_000000002.tmp-99999"
    shutil.copytree(good, partial)  # even with every file present, a .tmp- dir is never a checkpoint
    with caplog.at_level(logging.WARNING, logger="posttrain.checkpoint"):
        assert find_latest_complete(tmp_path) == good
    assert "unfinished save" in caplog.text and "iter_000000002.tmp-99999" in caplog.text
    assert verify_checkpoint(partial) == [
        f"{partial}: an unfinished save (.tmp- directory); it never became a checkpoint"
    ]


def test_pointer_only_names_complete_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2):
        path = quick_save(tmp_path, step)
        assert read_latest_pointer(tmp_path) == path and verify_checkpoint(path) == []
    model, opt, sched = build("tiny", seed=0)
    bad = make_state(3)
    bad.engine_state = {"sampler": object()}  # fails mid-save
    with pytest.raises(CheckpointError, match="engine_state"):
        save(tmp_path, 3, (model, opt, sched), bad)
    assert read_latest_pointer(tmp_path) == tmp_path / iter_name(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [iter_name(1), iter_name(2), LATEST_NAME]


def test_resave_of_same_step_replaces_it(tmp_path: Path) -> None:
    quick_save(tmp_path, 4)
    path = quick_save(tmp_path, 4)
    assert verify_checkpoint(path) == [] and sorted(p.name for p in tmp_path.iterdir()) == [iter_name(4), LATEST_NAME]


# -- retention -----------------------------------------------------------------------------------


def test_retention_prunes_model_and_optimizer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for step in (1, 2, 3, 4, 5):
        quick_save(tmp_path, step, keep_model_last=3, keep_optim_last=1)
    # 5: complete; 4, 3: weights only (optimizer pruned); 2, 1: nothing left -> deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == [iter_name(3), iter_name(4), iter_name(5), LATEST_NAME]
    assert (tmp_path / iter_name(5) / "optimizer.pt").exists()
    for step in (3, 4):
        path = tmp_path / iter_name(step)
        assert not (path / "optimizer.pt").exists() and not (path / "scheduler.pt").exists()
        assert (path / "model.safetensors").exists()
        assert verify_checkpoint(path) == []  # pruned, not corrupt
        assert read_manifest(path)["pruned"] == {"optimizer": "rl.keep_optim_last=1"}
    shutil.rmtree(tmp_path / iter_name(5))
    with caplog.at_level(logging.INFO, logger="posttrain.checkpoint"):
        assert find_latest_complete(tmp_path) is None  # weights alone cannot resume exactly
    assert "retention removed its optimizer state (rl.keep_optim_last=1)" in caplog.text
    model, opt, sched = build("tiny", seed=0)
    load_checkpoint(tmp_path / iter_name(4), model)  # weights only: still usable for export / eval
    with pytest.raises(CheckpointError, match="optimizer state was removed by retention"):
        load_checkpoint(tmp_path / iter_name(4), model, opt, sched)
    with pytest.raises(CheckpointError, match="cannot resume: retention removed"):
        resolve_resume(str(tmp_path / iter_name(4)), tmp_path)


def test_retention_keep_model_last_dcp(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        quick_save(tmp_path, step, fmt="dcp", keep_model_last=1)
    assert not (tmp_path / iter_name(1) / "model_dcp").exists()
    assert (tmp_path / iter_name(1) / "optim_dcp").is_dir()
    assert read_manifest(tmp_path / iter_name(2))["pruned"] == {"model": "rl.keep_model_last=1"}
    assert (tmp_path / iter_name(3) / "model_dcp").is_dir()
    assert find_latest_complete(tmp_path) == tmp_path / iter_name(3)
    with pytest.raises(CheckpointError, match="model state was removed by retention"):
        load_checkpoint(tmp_path / iter_name(2), *build("tiny", seed=0))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rl.keep_model_last=0", r"rl\.keep_model_last=0: Input should be greater than or equal to 1"),
        ("rl.keep_optim_last=0", r"rl\.keep_optim_last=0: Input should be greater than or equal to 1"),
        ("rl.checkpoint_format=zip", r"rl\.checkpoint_format='zip': Input should be 'consolidated' or 'dcp'"),
    ],
)
def test_writer_settings_are_refused_by_the_config(override: str, message: str) -> None:
    # the one place these are checked: CheckpointWriter takes them from the validated config
    with pytest.raises(ConfigError, match=message):
        build_config(None, [override])


# -- async ---------------------------------------------------------------------------------------


def test_async_save_equals_sync_save(tmp_path: Path) -> None:
    model, opt, sched = build("llama", seed=0)
    train_step(model, opt, sched, seed=0)
    state = make_state(1)
    sync = save(tmp_path / "sync", 1, (model, opt, sched), state)
    writer = CheckpointWriter(tmp_path / "async", async_save=True)
    path = writer.save(1, model, opt, sched, state)
    train_step(model, opt, sched, seed=1)  # training goes on while the thread writes
    assert writer.wait() == path
    a, b = read_manifest(sync), read_manifest(path)
    assert a["files"] == b["files"]  # byte-identical files
    assert read_latest_pointer(tmp_path / "async") == path


def test_async_failure_is_reported_at_the_next_join(tmp_path: Path) -> None:
    model, opt, sched = build("tiny", seed=0)
    writer = CheckpointWriter(tmp_path, async_save=True)
    good = writer.save(4, model, opt, sched, make_state(4))
    assert writer.wait() == good
    (tmp_path / iter_name(5)).write_text("in the way")  # the final rename will fail in the thread
    writer.save(5, model, opt, sched, make_state(5))
    with pytest.raises(CheckpointError, match=r"background save of step 5 .* failed: .*not a checkpoint directory"):
        writer.wait()
    assert writer.wait() == good  # reported once; the last save that completed
    writer.save(6, model, opt, sched, make_state(6))
    (tmp_path / iter_name(7)).write_text("in the way")
    writer.save(7, model, opt, sched, make_state(7))
    with pytest.raises(CheckpointError, match=r"background save of step 7 .* failed"):
        writer.save(8, model, opt, sched, make_state(8))  # the next save joins first, and reports it
    assert not writer.pending and read_latest_pointer(tmp_path) == tmp_path / iter_name(6)
    assert not list(tmp_path.glob("*.tmp-*"))


# -- resolve rl.resume -----------------------------------------------------------------------------


def test_resolve_resume_auto_across_attempts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    job = tmp_path / "proj" / "grpo" / "name"
    assert resolve_resume("off", job) is None
    assert resolve_resume("auto", job) is None  # no job dir yet
    older, newer = job / "20260101-100000", job / "20260101-110000"
    quick_save(older / "checkpoints", 2)
    quick_save(older / "checkpoints", 4)
    (job / "20260101-120000").mkdir()  # an attempt that died before its first checkpoint
    assert resolve_resume("auto", job) == older / "checkpoints" / iter_name(4)
    newest = quick_save(newer / "checkpoints", 6)
    assert resolve_resume("auto", job) == newest
    (newest / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="posttrain.checkpoint"):
        assert resolve_resume("auto", job) == older / "checkpoints" / iter_name(4)
    assert "skipping incomplete or corrupt checkpoint" in caplog.text
    assert resolve_resume(str(older / "checkpoints" / iter_name(2)), job) == older / "checkpoints" / iter_name(2)
    with pytest.raises(CheckpointError, match=r"did you mean .*iter_000000004"):
        resolve_resume(str(older), job)
    with pytest.raises(CheckpointError, match="no such path"):
        resolve_resume(str(job / "nope"), job)


# -- signals ---------------------------------------------------------------------------------------


def test_graceful_stop_first_signal_requests_second_interrupts() -> None:
    before = signal.getsignal(signal.SIGTERM)
    before_int = signal.getsignal(signal.SIGINT)  # SIG_IGN under nohup or a CI runner
    with GracefulStop() as stop:
        assert not stop.should_stop()
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested and stop.should_stop() and stop.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match="second stop signal"):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGINT) is before_int


# -- multi-rank (FSDP2 on gloo, CPU) -----------------------------------------------------------------


def _fsdp_worker(rank: int, world: int, root: str, store: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

    def build_sharded(seed: int) -> Trio:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, VOCAB))
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))

    def step(model: nn.Module, opt: torch.optim.Optimizer, sched: object, seed: int) -> None:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed * 10 + rank))  # per-rank data
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()  # type: ignore[attr-defined]

    try:
        ref = build_sharded(0)
        for s in range(2):
            step(*ref, seed=s)
        torch.manual_seed(100 + rank)  # each rank's RNG differs and must come back to that rank
        state = make_state(2)
        save(Path(root) / "dcp", 2, ref, state, fmt="dcp")
        # consolidated: gathered to rank 0 before save returns, written in the background
        writer = CheckpointWriter(Path(root) / "consolidated", async_save=True)
        gathered = writer.save(2, *ref, state)
        assert writer.wait() == gathered and verify_checkpoint(gathered) == []
        resumed = build_sharded(5)
        loaded = load_checkpoint(find_latest_complete(Path(root) / "dcp"), *resumed)  # type: ignore[arg-type]
        assert loaded.rng == state.rng
        from_full = build_sharded(7)
        assert load_checkpoint(gathered, *from_full).rng == state.rng
        for s in (2, 3):
            for trio in (ref, resumed, from_full):
                step(*trio, seed=s)
        for a, b, c in zip(ref[0].parameters(), resumed[0].parameters(), from_full[0].parameters()):
            assert torch.equal(a.full_tensor(), b.full_tensor()) and torch.equal(a.full_tensor(), c.full_tensor())
        dist.barrier()  # no rank leaves while its peer is still in the last collective
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as exit_rank_process does: gloo's threads may abort a finalizing interpreter


def test_two_ranks_fsdp_round_trips(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "ckpt"), str(tmp_path / "store")), nprocs=2)
    for fmt in ("dcp", "consolidated"):
        path = tmp_path / "ckpt" / fmt / iter_name(2)
        manifest = read_manifest(path)
        assert verify_checkpoint(path) == [] and manifest["checkpoint_format"] == fmt
        assert {"training_state.json", "training_state.rank00001.json"} <= set(manifest["files"])
        assert manifest["world_size"] == 2
    assert read_manifest(tmp_path / "ckpt" / "consolidated" / iter_name(2))["optimizer_layout"] == "fqn"
