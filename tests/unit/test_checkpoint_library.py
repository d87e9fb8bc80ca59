"""Checkpoints through the libraries built for them (issue 17): asynchronous ``dcp`` saves through
``torch.distributed.checkpoint.async_save`` (one process and two FSDP2 ranks on gloo), the
consolidated checkpoint as a Hugging Face model directory, and ``rl.checkpoint_verify``.

The reference for "resumes bit-exactly" is a synchronous save of the same state and the run that
was never interrupted: both continue to the same bits as the async save's resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tiny_models
from posttrain.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    TrainingState,
    capture_rng,
    find_latest_complete,
    load_checkpoint,
    resolve_resume,
    restore_rng,
    verify_checkpoint,
)
from posttrain.checkpoint.failed_saves import remove_unfinished_saves
from posttrain.checkpoint.layout import iter_name, read_latest_pointer
from posttrain.checkpoint.manifest import read_manifest
from posttrain.checkpoint.reader import verify_main
from posttrain.config.loading import build_config
from posttrain.errors import ConfigError

VOCAB = 64
Trio = tuple[nn.Module, torch.optim.Optimizer, Any]


def tiny_llama(*, config_dtype: str | None = None) -> nn.Module:
    return tiny_models.tiny_llama(VOCAB, config_dtype=config_dtype)


def build(seed: int, **kw: Any) -> Trio:
    torch.manual_seed(seed)
    model = tiny_llama(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def train_step(trio: Trio, seed: int) -> None:
    model, opt, sched = trio
    ids = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def state_at(step: int) -> TrainingState:
    identity = {"data_seed": 0, "objective": {}, "ref_anchor": None, "n_mini": 1}
    return TrainingState(step, step, 0, {"index": step}, {"generate_calls": step}, capture_rng(), identity)


def flat(trio: Trio) -> dict[str, torch.Tensor]:
    """Every tensor of weights, optimizer state and schedule, by a stable name."""
    model, opt, sched = trio
    out = {f"w.{k}": v for k, v in model.state_dict().items()}
    for index, per_param in opt.state_dict()["state"].items():
        out.update({f"o.{index}.{k}": v for k, v in per_param.items()})
    out["lr"] = torch.tensor(sched.get_last_lr())
    return out


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]


def scribble(model: nn.Module) -> dict[str, torch.Tensor]:
    """Overwrite the weights in place (what the next training step does while an async save is in
    flight); returns the values to put back."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return saved


# -- async dcp, one process -------------------------------------------------------------------------


def test_async_dcp_save_resumes_bitwise_like_a_sync_save(tmp_path: Path) -> None:
    ref = build(0)
    for s in range(2):
        train_step(ref, s)
    torch.manual_seed(42)
    state = state_at(2)
    sync = CheckpointWriter(tmp_path / "sync", fmt="dcp").save(2, *ref, state)
    writer = CheckpointWriter(tmp_path / "async", fmt="dcp", async_save=True)
    path = writer.save(2, *ref, state)
    saved = scribble(ref[0])  # the staged copy, not the live weights, is what gets written
    assert writer.wait() == path
    ref[0].load_state_dict(saved)
    assert verify_checkpoint(path) == [] and read_latest_pointer(tmp_path / "async") == path
    manifest = read_manifest(path)
    assert manifest["checkpoint_format"] == "dcp"
    assert read_manifest(sync)["parts"] == manifest["parts"]

    resumed = {name: build(7 + i) for i, name in enumerate(("sync", "async"))}  # other inits
    for name, where in (("sync", sync), ("async", path)):
        loaded = load_checkpoint(where, *resumed[name])
        assert loaded == state  # RNG, cursors and counters as captured
    assert_bitwise(flat(resumed["async"]), flat(ref))
    assert_bitwise(flat(resumed["async"]), flat(resumed["sync"]))
    restore_rng(state.rng)
    draws = torch.randn(4)
    restore_rng(load_checkpoint(path, build(9)[0]).rng)
    assert torch.equal(torch.randn(4), draws)
    for s in (2, 3):  # and every run continues to the same bits
        for trio in (ref, *resumed.values()):
            train_step(trio, s)
    assert_bitwise(flat(resumed["async"]), flat(ref))
    assert_bitwise(flat(resumed["sync"]), flat(ref))


def test_async_failure_of_a_dcp_save_surfaces_at_the_join(tmp_path: Path) -> None:
    trio = build(0)
    writer = CheckpointWriter(tmp_path, fmt="dcp", async_save=True)
    good = writer.save(1, *trio, state_at(1))
    assert writer.wait() == good
    (tmp_path / iter_name(2)).write_text("in the way")  # the publish fails in the background
    writer.save(2, *trio, state_at(2))
    with pytest.raises(CheckpointError, match=r"background save of step 2 .* failed: .*not a checkpoint directory"):
        writer.save(3, *trio, state_at(3))  # the next save joins first, and reports it (saving nothing)
    assert not (tmp_path / iter_name(3)).exists() and read_latest_pointer(tmp_path) == good
    writer.save(3, *trio, state_at(3))
    assert writer.wait() == tmp_path / iter_name(3)
    assert find_latest_complete(tmp_path) == tmp_path / iter_name(3)
    assert not list(tmp_path.glob("*.tmp-*"))


KILLED = textwrap.dedent(
    """
    import os, resource, signal, sys
    from pathlib import Path
    import torch
    from torch import nn
    from posttrain.checkpoint import CheckpointError, CheckpointWriter, TrainingState

    root, case = Path(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 8 MiB, 24 MiB with Adam
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 1024)).sum().backward()
    opt.step()

    def state(step):
        return TrainingState(step, step, 0, {}, {}, {}, {})

    writer = CheckpointWriter(root, fmt="dcp", async_save=True)
    writer.save(1, model, opt, None, state(1))
    writer.wait()
    if case == "kill":
        writer.save(2, model, opt, None, state(2))
        os.kill(os.getpid(), signal.SIGKILL)  # the uploads, the manifest and the rename have not run
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))  # 1 MiB files at most
    writer.save(2, model, opt, None, state(2))
    try:
        writer.wait()
    except CheckpointError as exc:
        print("ERROR", exc)
    """
)


def _killed(root: Path, case: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", KILLED, str(root), case], capture_output=True, text=True, timeout=120, check=False
    )


def test_killed_or_failed_async_dcp_save_is_never_taken_for_complete(tmp_path: Path) -> None:
    job = tmp_path / "job"
    root = job / "20260101-000000" / "checkpoints"
    out = _killed(root, "kill")
    assert out.returncode == -9, out.stderr
    first = root / iter_name(1)
    leftovers = list(root.glob(f"{iter_name(2)}.tmp-*"))
    assert len(leftovers) == 1 and not (root / iter_name(2)).exists()
    assert not (leftovers[0] / "manifest.json").exists()
    for verify in ("size", "hash"):
        assert resolve_resume("auto", job, verify=verify) == first  # type: ignore[arg-type]
    assert read_latest_pointer(root) == first
    assert remove_unfinished_saves(job)[0].startswith(f"removed {leftovers[0]}")

    out = _killed(tmp_path / "fsize", "fsize")
    assert out.returncode == 0, out.stderr
    message = out.stdout
    assert "ERROR the background save of step 2" in message and "file too large" in message, message
    assert f"the newest complete one is {tmp_path / 'fsize' / iter_name(1)}" in message
    assert sorted(p.name for p in (tmp_path / "fsize").iterdir()) == [iter_name(1), "latest_checkpoint.txt"]


# -- async saves on two FSDP2 ranks (gloo) ----------------------------------------------------------


def _two_rank_worker(rank: int, world: int, root: str, store: str) -> None:
    import faulthandler

    import torch.distributed as dist

    # a rank that dies of a signal prints every thread's Python stack (CI saw one SIGSEGV here once, on
    # 2026-12-06; 42 fresh runs and 120 saves in a loop did not repeat it)
    faulthandler.enable(all_threads=True)
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

    def sharded(seed: int) -> Trio:
        trio = build(seed)
        fully_shard(trio[0])
        opt = torch.optim.AdamW(trio[0].parameters(), lr=1e-2, weight_decay=0.1)
        return trio[0], opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))

    def full(trio: Trio) -> dict[str, torch.Tensor]:
        return {k: v.full_tensor() for k, v in trio[0].state_dict().items()}

    try:
        ref = sharded(0)
        for s in range(2):
            train_step(ref, s * 10 + rank)  # per-rank data
        torch.manual_seed(100 + rank)
        state = state_at(2)
        for fmt in ("dcp", "consolidated"):
            expected = full(ref)
            writer = CheckpointWriter(Path(root) / fmt, fmt=fmt, async_save=True)  # type: ignore[arg-type]
            path = writer.save(2, *ref, state)
            train_step(ref, 99)  # the next step trains (collectives on the default group) during the upload
            assert writer.wait() == path and verify_checkpoint(path) == []
            resumed = sharded(5)
            assert load_checkpoint(path, *resumed).rng == state.rng
            got = full(resumed)
            assert all(torch.equal(got[k], expected[k]) for k in expected), fmt
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as exit_rank_process does: gloo's threads may abort a finalizing interpreter


def test_two_ranks_async_saves_of_both_formats_round_trip(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_two_rank_worker, args=(2, str(tmp_path / "ckpt"), str(tmp_path / "store")), nprocs=2)
    for fmt in ("dcp", "consolidated"):
        manifest = read_manifest(tmp_path / "ckpt" / fmt / iter_name(2))
        assert manifest["world_size"] == 2 and "training_state.rank00001.json" in manifest["files"]
    # the sharded policy's consolidated checkpoint is a model directory too (FSDP2's wrapper class
    # is not what config.json names)
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "ckpt" / "consolidated" / iter_name(2)
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


# -- the consolidated checkpoint is a Hugging Face model directory ----------------------------------


def test_consolidated_checkpoint_loads_in_transformers_as_is(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    # a config that says bfloat16 over fp32 weights (fp32 master weights of a bf16 checkpoint)
    model, opt, sched = build(0, config_dtype="bfloat16")
    train_step((model, opt, sched), 0)
    path = CheckpointWriter(tmp_path / "a").save(1, model, opt, sched, state_at(1))
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    assert model.config.dtype == torch.bfloat16  # the live model's config is left alone
    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        assert fh.metadata()["format"] == "pt"
        assert "lm_head.weight" not in set(fh.keys())
    loaded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert loaded.dtype == torch.float32 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    # the same tensors give the same bytes, whatever order safetensors put the metadata keys in
    again = CheckpointWriter(tmp_path / "b").save(1, model, opt, sched, state_at(1))
    digests = {hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest() for p in (path, again)}
    assert len(digests) == 1
    raw = (path / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert list(header["__metadata__"]) == ["format", "posttrain_aliases"]  # in sorted order, on disk


# -- rl.checkpoint_verify -----------------------------------------------------------------------------


def _same_size_corruption(path: Path) -> None:
    f = path / "optimizer.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


def test_verify_size_catches_truncation_and_hash_catches_same_size_corruption(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job"
    root = job / "20260101-000000" / "checkpoints"
    trio = build(0)
    for step in (1, 2):
        train_step(trio, step)
        CheckpointWriter(root).save(step, *trio, state_at(step))
    newest, older = root / iter_name(2), root / iter_name(1)
    _same_size_corruption(newest)
    # size mode trusts the manifest's sizes: the flipped bit goes through (it reads no byte)
    assert resolve_resume("auto", job, verify="size") == newest
    assert resolve_resume(str(newest), job, verify="size") == newest
    assert verify_checkpoint(newest, full=False) == []
    # hash mode reads every byte: the newest is skipped, and refused when named
    assert resolve_resume("auto", job, verify="hash") == older
    with pytest.raises(CheckpointError, match=r"optimizer.pt: content differs from the manifest \(sha256"):
        resolve_resume(str(newest), job, verify="hash")
    with pytest.raises(CheckpointError, match=r"refusing to load .*sha256 mismatch"):
        load_checkpoint(newest, *build(3), verify="hash")
    # the command-line check always hashes
    assert verify_main([str(older), str(newest)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{older}: ok (sizes and sha256 match the manifest)"
    assert lines[1].startswith(f"{newest}: {newest}/optimizer.pt: content differs from the manifest")
    # a truncated file is caught by sizes alone
    f = older / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"model.safetensors: \d+ bytes, the manifest says \d+"):
        load_checkpoint(older, *build(3), verify="size")
    assert verify_checkpoint(older, full=False) != []
    with pytest.raises(CheckpointError, match="does not verify"):
        resolve_resume(str(older), job, verify="size")


def test_checkpoint_verify_knob() -> None:
    assert build_config(None, []).rl.checkpoint_verify == "size"
    assert build_config(None, ["rl.checkpoint_verify=hash"]).rl.checkpoint_verify == "hash"
    with pytest.raises(ConfigError, match=r"rl\.checkpoint_verify='md5': Input should be 'size' or 'hash'"):
        build_config(None, ["rl.checkpoint_verify=md5"])
