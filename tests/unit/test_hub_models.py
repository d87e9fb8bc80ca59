"""Models by name: hub ids resolved through a hand-built Hugging Face cache under a temporary HF_HOME.

Nothing is downloaded: every test sets ``HF_HUB_OFFLINE=1`` and builds the cache layout
huggingface_hub reads (``hub/models--org--name/{blobs,refs,snapshots}``) from a tiny random model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config.loading import build_config
from posttrain.errors import ConfigError
from posttrain.loop.resume import anchor_hash
from posttrain.models import embedded
from posttrain.models.hub import HubModelNotCachedError, hub_cache_dir, is_hub_id
from posttrain.models.loading import local_model_dir, resolve_model_path
from posttrain.preflight.grpo import grpo_preflight

REPO = "tiny-org/tiny-llama"
MAIN_COMMIT = "a" * 40
V1_COMMIT = "b" * 40


def add_to_hub_cache(hf_home: Path, repo_id: str, model_dir: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """Put ``model_dir``'s files into ``hf_home``'s hub cache as huggingface_hub lays a download out:
    content-addressed blobs, a snapshot of relative symlinks to them, and ``refs/<ref>`` naming the
    commit. Returns the snapshot directory."""
    org, name = repo_id.split("/")
    repo = hf_home / "hub" / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(p for p in model_dir.iterdir() if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Path:
    """An HF_HOME whose cache holds REPO at main and at tag v1 (another commit, same files)."""
    home = tmp_path_factory.mktemp("hf_home")
    add_to_hub_cache(home, REPO, Path(tiny_model_dir), MAIN_COMMIT, ("main",))
    add_to_hub_cache(home, REPO, Path(tiny_model_dir), V1_COMMIT, ("v1",))
    return home


@pytest.fixture
def offline(hub_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(hub_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_home / "hub"


def snapshot_of(cache: Path, commit: str) -> str:
    return str((cache / "models--tiny-org--tiny-llama" / "snapshots" / commit).resolve())


def test_hub_id_shapes() -> None:
    for good in ("Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M", "a/b", "org_1/name.v2"):
        assert is_hub_id(good), good
    for bad in ("./model", "../x/y", "/abs/path", "~/models/x", "a/b/c", "org/", "/name", "gpt2", "org/.x", "a--b/c"):
        assert not is_hub_id(bad), bad


def test_cache_dir_follows_the_standard_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


def test_a_cached_hub_id_resolves_to_its_snapshot(offline: Path) -> None:
    assert resolve_model_path(REPO) == snapshot_of(offline, MAIN_COMMIT)
    assert resolve_model_path(REPO, "v1") == snapshot_of(offline, V1_COMMIT)  # a tag
    assert resolve_model_path(REPO, V1_COMMIT) == snapshot_of(offline, V1_COMMIT)  # a commit
    assert local_model_dir(REPO) == offline / "models--tiny-org--tiny-llama" / "snapshots" / MAIN_COMMIT
    assert local_model_dir(REPO, "v2") is None and local_model_dir("tiny-org/absent") is None
    # the reference anchor hashes the snapshot's files, exactly as for that directory given by path
    assert anchor_hash(REPO) == anchor_hash(snapshot_of(offline, MAIN_COMMIT))


def test_an_uncached_revision_is_refused_by_name(offline: Path) -> None:
    with pytest.raises(HubModelNotCachedError) as caught:
        resolve_model_path(REPO, "v2")
    message = str(caught.value)
    assert f"model.name_or_path={REPO} at model.revision=v2: not a local directory" in message
    assert f"not in the Hugging Face cache {offline}" in message
    assert "HF_HUB_OFFLINE is set" in message and "unset HF_HUB_OFFLINE" in message
    assert f"`hf download {REPO} --revision v2`" in message
    assert caught.value.revision == "v2" and caught.value.cache_dir == offline


def test_an_uncached_hub_id_names_the_key_and_how_to_fetch_it(offline: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_model_path("tiny-org/absent", key="rl.teacher.name_or_path")
    message = str(caught.value)
    assert "rl.teacher.name_or_path=tiny-org/absent (revision main)" in message
    assert str(offline) in message and "huggingface-cli download tiny-org/absent" in message


def test_an_existing_local_directory_wins_over_the_hub(
    offline: Path, tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / REPO
    shutil.copytree(tiny_model_dir, local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(REPO) == str(local.resolve())
    assert resolve_model_path(tiny_model_dir) == str(Path(tiny_model_dir).resolve())
    with pytest.raises(ConfigError, match=r"model\.revision=v1 applies to hub ids \(org/name\) only"):
        resolve_model_path(tiny_model_dir, "v1")


def test_the_embedded_name_still_resolves(
    offline: Path, tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A finished conversion in a temporary POSTTRAIN_CACHE (no GGUF is converted here).
    fake = embedded._EmbeddedModel("posttrain_no_such_pkg", "no-such-pkg", "x.gguf", "x-bf16")
    monkeypatch.setitem(embedded._EMBEDDED, "embedded:test-hub", fake)
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    done = tmp_path / "models" / "x-bf16"
    shutil.copytree(tiny_model_dir, done)
    (done / ".posttrain_complete.json").write_text(json.dumps({"format": 1, "gguf_file": "x.gguf", "gguf_bytes": 9}))
    assert resolve_model_path("embedded:test-hub") == str(done)
    with pytest.raises(ConfigError, match=r"model\.revision=v1 applies to hub ids .* is an embedded model"):
        resolve_model_path("embedded:test-hub", "v1")


def _model_errors(overrides: list[str]) -> list[str]:
    errors = grpo_preflight(build_config(None, overrides)).errors
    return [e for e in errors if e.startswith(("model.", "rl.ref."))]


def test_the_preflight_checks_hub_ids_in_the_cache(offline: Path) -> None:
    assert _model_errors([f"model.name_or_path={REPO}"]) == []
    assert _model_errors([f"model.name_or_path={REPO}", "model.revision=v1"]) == []
    [missing] = _model_errors([f"model.name_or_path={REPO}", "model.revision=v2"])
    assert missing.startswith(f"model.name_or_path={REPO} at model.revision=v2: not a local directory")
    assert str(offline) in missing and "HF_HUB_OFFLINE is set" in missing
    ref = ["rl.kl_beta=0.1", "rl.kl_coeff_clamp=5", "rl.ref.build_ref=true", "rl.ref.model_dir=tiny-org/absent"]
    [ref_missing] = _model_errors(ref)
    assert ref_missing.startswith("rl.ref.model_dir=tiny-org/absent (revision main): not a local directory")
    assert _model_errors([*ref[:3], f"rl.ref.model_dir={REPO}", "rl.ref.revision=v1"]) == []
    [stray] = _model_errors(["model.revision=v1"])  # the default embedded model takes no revision
    assert stray.startswith("model.revision=v1 applies to hub ids (org/name) only")


def test_the_preflight_checks_the_cached_snapshot_files(
    offline: Path, tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    snapshot = add_to_hub_cache(home, "broken/model", Path(tiny_model_dir), MAIN_COMMIT, ("main",))
    (snapshot / "model.safetensors").unlink()
    monkeypatch.setenv("HF_HOME", str(home))
    [problem] = _model_errors(["model.name_or_path=broken/model"])
    assert problem.startswith(f"model.name_or_path=broken/model: its cached snapshot {snapshot}: ")
    assert "holds no weights" in problem


def test_validate_manifest_refuses_an_uncached_hub_id_without_torch(offline: Path) -> None:
    env = {**os.environ, "HF_HOME": str(offline.parent), "HF_HUB_OFFLINE": "1"}
    run = [sys.executable, "-X", "importtime", "-m", "posttrain.entrypoints.grpo", "--validate-manifest", "--"]
    bad = subprocess.run(
        [*run, "model.name_or_path=tiny-org/absent"], capture_output=True, text=True, env=env, check=False
    )
    assert bad.returncode == 1
    assert "model.name_or_path=tiny-org/absent (revision main): not a local directory" in bad.stderr
    assert str(offline) in bad.stderr and "| torch" not in bad.stderr
    ok = subprocess.run([*run, f"model.name_or_path={REPO}"], capture_output=True, text=True, env=env, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "manifest OK" in ok.stdout and "| torch" not in ok.stderr
