"""Shared test fixtures: the SmolLM2 tokenizer copy and a tiny random model built from it once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
SMOLLM2_TOKENIZER_DIR = FIXTURES / "smollm2_tokenizer"


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> str:
    """The SmolLM2 tokenizer (49152 ids, ChatML template, ``<|im_end|>`` as EOS)."""
    return str(SMOLLM2_TOKENIZER_DIR)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama (hidden 64) with the SmolLM2 tokenizer, saved as a Hugging Face directory.

    Session-scoped: tests that change weights must load their own copy from this directory.
    """
    from posttrain.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny_model")
    return make_tiny_model(str(out), str(SMOLLM2_TOKENIZER_DIR))
