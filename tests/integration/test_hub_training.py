"""A GRPO run whose policy and reference are named by hub id, read offline from a hand-built
Hugging Face cache under a temporary HF_HOME (nothing is downloaded)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from posttrain.config.loading import build_config
from posttrain.loop.grpo import train
from posttrain.loop.resume import anchor_hash

RunOverrides = Callable[..., list[str]]
REPO, COMMIT = "tiny-org/tiny-llama", "c" * 40


def _cache_model(hf_home: Path, model_dir: Path) -> Path:
    """``model_dir`` laid out as a huggingface_hub download of REPO at main: blobs named by their
    sha256, a snapshot of relative symlinks to them, refs/main naming the commit."""
    repo = hf_home / "hub" / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    for folder in (repo / "blobs", repo / "refs", snapshot):
        folder.mkdir(parents=True)
    for file in sorted(p for p in model_dir.iterdir() if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_two_grpo_steps_by_hub_id_offline(
    tiny_model_dir: str, tmp_path: Path, run_overrides: RunOverrides, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = _cache_model(tmp_path / "hf_home", Path(tiny_model_dir))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ref = ["rl.kl_beta=0.05", "rl.kl_coeff_clamp=5", "rl.ref.build_ref=true", f"rl.ref.model_dir={REPO}"]
    cfg = build_config(
        None,
        run_overrides(REPO, tmp_path / "out", "hub", "rl.max_steps=2", "rl.save_every=2", "rollout.max_tokens=8", *ref),
    )
    run_dir = train(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["train/kl_mean"] > 0  # the reference, loaded by hub id, stayed at the initial weights
    resolved = yaml.safe_load((run_dir / "config_resolved.yaml").read_text())
    assert resolved["model"]["name_or_path"] == REPO and resolved["model"]["revision"] is None
    # the checkpoint pins the reference by the content of the snapshot it loaded
    state = json.loads((run_dir / "checkpoints" / "iter_000000002" / "training_state.json").read_text())
    assert state["identity"]["ref_anchor"] == anchor_hash(str(snapshot)) == anchor_hash(tiny_model_dir)
