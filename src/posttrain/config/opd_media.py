"""The media identity of a vision-language model directory, as multimodal OPD binds and resumes it.

``rl.teacher.input_mode=shared_vocab_multimodal`` scores the student's own token ids with the
teacher, so both roles must render a prompt with its images identically: the same tokenizer (vocabulary
and added tokens), the same image processor (``preprocessor_config.json``: resize bounds, patch and
merge sizes, normalisation), the same chat template and the same placeholder ids (the four vision
tokens). ``media_identity(dir)`` reads those from the directory's files (JSON and the template,
nothing is loaded), so the preflight compares teacher and student before any model loads
(``preflight/opd_media.py``) and the OPD resume identity pins the teacher's
(``OPDConfig.resume_identity_extra``) together with the media cardinality: ordered images, at most
``rl.data.images.max_per_row`` per prompt, no video. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

PLACEHOLDERS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen3-VL's image-path tokens (``posttrain.models.vision.VISION_TOKENS``, which this layer cannot import)."""

BOUND_FIELDS = ("tokenizer", "processor", "chat_template", "placeholders")
"""What ``shared_vocab_multimodal`` requires equal between teacher and student."""


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _chat_template(root: Path) -> str | None:
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = _read_json(root / "tokenizer_config.json")
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) else None


def _placeholders(tokenizer_json: Any) -> dict[str, int | None]:
    added = tokenizer_json.get("added_tokens", []) if isinstance(tokenizer_json, dict) else []
    ids = {t.get("content"): t.get("id") for t in added if isinstance(t, dict)}
    vocab = tokenizer_json.get("model", {}).get("vocab", {}) if isinstance(tokenizer_json, dict) else {}
    return {tok: ids.get(tok, vocab.get(tok) if isinstance(vocab, dict) else None) for tok in PLACEHOLDERS}


def media_identity(model_dir: str | Path | None) -> dict[str, Any] | None:
    """sha256 digests of the tokenizer (vocabulary, merges, added tokens), the image processor config and
    the chat template, and the placeholder ids, of ``model_dir``; None when it is not a local directory."""
    if model_dir is None:
        return None
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        return None
    tokenizer_json = _read_json(root / "tokenizer.json")
    tokenizer = None
    if isinstance(tokenizer_json, dict):
        tokenizer = _sha({"model": tokenizer_json.get("model"), "added_tokens": tokenizer_json.get("added_tokens")})
    processor = _read_json(root / "preprocessor_config.json")
    template = _chat_template(root)
    return {
        "tokenizer": tokenizer,
        "processor": None if processor is None else _sha(processor),
        "chat_template": None if template is None else hashlib.sha256(template.encode()).hexdigest(),
        "placeholders": _placeholders(tokenizer_json),
    }


def media_cardinality(max_per_row: int) -> dict[str, Any]:
    """What each prompt may carry in the multimodal modes: ordered images (both roles the same ones),
    at most ``max_per_row``, no video."""
    return {"images": "ordered", "max_images_per_prompt": max_per_row, "videos": 0}
