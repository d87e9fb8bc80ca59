"""Fixtures shared by the unit tests (the session-wide ones are in ``tests/conftest.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path: Path, smollm2_tokenizer_dir: str) -> Path:
    """The SmolLM2 tokenizer files and config.json (``max_position_embeddings=8192``), plus a
    placeholder weights file (never read): what the preflight's row and length checks read."""
    out = tmp_path / "model"
    shutil.copytree(smollm2_tokenizer_dir, out)
    (out / "model.safetensors").write_bytes(b"\0" * 8)
    return out
