"""The ``rl.upload`` section (``config/upload.py``) and its preflight (``preflight/upload.py``): defaults,
bounds, overrides, and every refusal before any model loads (no destination, a backend package that
is missing, an unknown protocol, the output root itself, a destination that cannot be written)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config.loading import build_config
from posttrain.config.upload import UploadConfig
from posttrain.errors import ConfigError
from posttrain.preflight.findings import Findings
from posttrain.preflight.upload import check_upload


def _findings(tmp_path: Path, *overrides: str) -> Findings:
    cfg = build_config(None, [f"job.output_root={tmp_path / 'out'}", "rl.save_every=1", *overrides])
    out = Findings()
    check_upload(cfg, out)
    return out


def test_defaults_are_off_and_every_field_is_documented() -> None:
    cfg = build_config(None, [])
    up = cfg.rl.upload
    assert (up.enabled, up.destination, up.required, up.retries) == (False, None, False, 3)
    assert (up.retry_backoff_s, up.wait_timeout_s, up.storage_options) == (2.0, 3600.0, {})
    for name, field in UploadConfig.model_fields.items():
        assert field.description and len(field.description) > 20, name


def test_overrides_reach_the_section() -> None:
    cfg = build_config(
        None,
        [
            "rl.upload.enabled=true",
            "rl.upload.destination=s3://bucket/runs",
            "rl.upload.required=true",
            "rl.upload.retries=0",
            "rl.upload.storage_options={endpoint_url: 'http://127.0.0.1:9000', anon: false}",
        ],
    )
    up = cfg.rl.upload
    assert (up.enabled, up.destination, up.required, up.retries) == (True, "s3://bucket/runs", True, 0)
    assert up.storage_options == {"endpoint_url": "http://127.0.0.1:9000", "anon": False}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rl.upload.retries=-1", r"rl\.upload\.retries.*greater than or equal to 0"),
        ("rl.upload.retry_backoff_s=inf", r"rl\.upload\.retry_backoff_s"),
        ("rl.upload.wait_timeout_s=-5", r"rl\.upload\.wait_timeout_s.*greater than or equal to 0"),
        ("rl.upload.destnation=/x", r"rl\.upload\.destnation"),
    ],
)
def test_bad_values_are_refused_by_name(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(None, [override])


def test_off_checks_nothing(tmp_path: Path) -> None:
    out = _findings(tmp_path, "rl.upload.destination=nosuch://x")
    assert out.errors == [] and out.warnings == []


def test_enabled_needs_a_destination(tmp_path: Path) -> None:
    out = _findings(tmp_path, "rl.upload.enabled=true")
    assert out.errors == [
        "rl.upload.enabled=true needs rl.upload.destination: a path or an fsspec URL such as s3://bucket/prefix"
    ]


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_a_missing_backend_package_says_what_to_install(tmp_path: Path) -> None:
    out = _findings(tmp_path, "rl.upload.enabled=true", "rl.upload.destination=gs://bucket/runs")
    assert len(out.errors) == 1
    assert "rl.upload.destination='gs://bucket/runs': the gs:// protocol needs a package" in out.errors[0]
    assert out.errors[0].endswith("pip install gcsfs")


def test_an_unknown_protocol_is_refused(tmp_path: Path) -> None:
    out = _findings(tmp_path, "rl.upload.enabled=true", "rl.upload.destination=nosuch://bucket")
    assert len(out.errors) == 1
    assert "rl.upload.destination='nosuch://bucket': Protocol not known: nosuch" in out.errors[0]


def test_the_output_root_itself_is_refused(tmp_path: Path) -> None:
    out = _findings(tmp_path, "rl.upload.enabled=true", f"rl.upload.destination={tmp_path / 'out'}")
    assert len(out.errors) == 1 and "is the output root itself" in out.errors[0]


def test_an_unwritable_destination_is_refused(tmp_path: Path) -> None:
    # a regular file where a directory must go: refused even for root (which ignores permission bits)
    (tmp_path / "blocker").write_text("not a directory")
    dest = tmp_path / "blocker" / "archive"
    out = _findings(tmp_path, "rl.upload.enabled=true", f"rl.upload.destination={dest}")
    assert len(out.errors) == 1
    assert out.errors[0].startswith(f"rl.upload.destination={str(dest)!r} is not writable from here: writing ")
    assert "check the URL, rl.upload.storage_options and the credentials" in out.errors[0]


def test_a_writable_destination_passes_and_keeps_no_probe(tmp_path: Path) -> None:
    dest = tmp_path / "archive"
    out = _findings(tmp_path, "rl.upload.enabled=true", f"rl.upload.destination={dest}", "job.name=j")
    assert out.errors == [] and out.warnings == []
    job = dest / "posttrain" / "grpo" / "j"
    assert job.is_dir() and list(job.iterdir()) == []  # the probe object was removed again


def test_uploads_without_checkpoints_warn(tmp_path: Path) -> None:
    out = _findings(tmp_path, "rl.upload.enabled=true", f"rl.upload.destination={tmp_path / 'a'}", "rl.save_every=0")
    assert out.errors == []
    assert out.warnings == ["rl.upload.enabled=true with rl.save_every=0: no checkpoint is written, nothing uploads"]


def test_the_preflight_refuses_through_validate_manifest(tmp_path: Path, tiny_model_dir: str) -> None:
    """The entry point's ``--validate-manifest`` runs the check, before any model loads."""
    args = [f"model.name_or_path={tiny_model_dir}", f"job.output_root={tmp_path}", "rl.save_every=1"]
    args += ["rl.upload.enabled=true", "rl.upload.destination=nosuch://bucket"]
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.entrypoints.grpo", "--validate-manifest", "--", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "rl.upload.destination='nosuch://bucket': Protocol not known: nosuch" in proc.stderr
