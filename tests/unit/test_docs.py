"""The configuration reference page is generated from the config models and must match them."""

from pathlib import Path

from posttrain.config.docs import render_config_reference
from posttrain.config.loading import known_keys

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_config_reference_is_current() -> None:
    assert DOC.read_text() == render_config_reference(), (
        "docs/config.md is stale: run `python -m posttrain.config.docs > docs/config.md`"
    )


def test_every_leaf_key_is_documented() -> None:
    text = DOC.read_text()
    leaves = [k for k in known_keys() if f"`{k}.`" not in text]
    missing = [k for k in leaves if f"| `{k}` |" not in text and not any(o.startswith(k + ".") for o in known_keys())]
    assert missing == []
