"""Rows with images: every accepted image format turned into one canonical multimodal prompt.

A row carries its images either inside its chat messages, as content parts
``{"type": "image", "image": VALUE}``, or in a separate column (``images_column``) holding one
VALUE or a list of them. VALUE is a file path (absolute, or relative to ``base_dir``), raw encoded
bytes, a ``datasets`` Image cell (``{"bytes": ..., "path": ...}`` undecoded, or the ``PIL.Image``
it decodes to) or a ``PIL.Image``. With a separate column, the messages may hold payload-free
placeholders ``{"type": "image"}``, filled in order; without placeholders the images go, in order,
in front of the text of the first user message.

The result (``normalize_prompt``) is the canonical form that ``posttrain.models.vision`` renders:
a message list whose image parts are ``{"type": "image", "image": <raw bytes>}`` in reading order.
Those ordered bytes are the one payload every role gets (the policy, the rollout engine, an OPD
teacher with its own processor). Limits (``ImageLimits``: images per row, pixels per image) are
checked here, per row, from the image headers; each error names the row (file and line, or sample)
and the image's index.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.data.base import ChatMessages, PromptSample
from posttrain.errors import DataError


@dataclass(frozen=True)
class ImageLimits:
    """What one row may carry: at most ``max_images`` images of at most ``max_pixels`` (width x height) each."""

    max_images: int = 8
    max_pixels: int = 4096 * 4096


def has_images(prompt: Any) -> bool:
    """Whether a prompt value (a string or messages) holds an image part or placeholder."""
    if not isinstance(prompt, list):
        return False
    return any(
        isinstance(part, Mapping) and part.get("type") in ("image", "video")
        for msg in prompt
        if isinstance(msg, Mapping) and isinstance(msg.get("content"), list)
        for part in msg["content"]
    )


def _read_file(path: str, where: str, base_dir: str | None) -> bytes:
    full = path if os.path.isabs(path) or base_dir is None else os.path.join(base_dir, path)
    try:
        with open(full, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise DataError(f"{where}: cannot read image file {full!r} ({exc.strerror or exc})") from exc


def image_bytes(value: Any, where: str, base_dir: str | None = None) -> bytes:
    """The raw encoded bytes of one image VALUE (see the module docstring)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        if value.startswith(("http://", "https://", "data:")):
            raise DataError(f"{where}: image {value[:60]!r} is a URL; posttrain reads local files and bytes only")
        return _read_file(value, where, base_dir)
    if isinstance(value, Mapping):  # a datasets Image cell read with decode=False
        if value.get("bytes") is not None:
            return image_bytes(value["bytes"], where, base_dir)
        if value.get("path") is not None:
            return image_bytes(str(value["path"]), where, base_dir)
        raise DataError(f"{where}: image object has neither 'bytes' nor 'path' (keys {sorted(map(str, value))})")
    try:
        from PIL import Image
    except ImportError:  # without PIL no value can be a PIL image
        Image = None  # type: ignore[assignment]
    if Image is not None and isinstance(value, Image.Image):  # a decoded datasets Image cell
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    raise DataError(
        f"{where}: an image must be a file path, raw bytes, a datasets Image value or a PIL image, "
        f"got {type(value).__name__}"
    )


def _check_image(data: bytes, what: str, limits: ImageLimits) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:  # reads the header only
            width, height = img.size
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DataError(f"{what}: not an image PIL can decode ({exc})") from exc
    if width * height > limits.max_pixels:
        raise DataError(
            f"{what}: {width}x{height} = {width * height} pixels, more than the limit of {limits.max_pixels}; "
            "downscale the image"
        )


def _parts(content: Any, what: str) -> list[dict[str, Any]]:
    """A message content as a list of part dicts (a string is one text part)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise DataError(f"{what} content must be a string or a list of parts, got {type(content).__name__}")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "video":
            raise DataError(f"{what} part {j} is a video; posttrain takes images only (video input is not supported)")
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            out.append(dict(part))
        else:
            raise DataError(
                f"{what} part {j} must be {{'type': 'text', 'text': str}} or {{'type': 'image', ...}}, got {part!r:.80}"
            )
    return out


def _as_messages(prompt: Any, column: str, where: str) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: column {column!r} must be a string or a non-empty list of chat messages")
    messages = []
    for k, msg in enumerate(prompt):
        what = f"{where}: column {column!r} message {k}"
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str) or "content" not in msg:
            raise DataError(f"{what} must be an object with a string 'role' and a 'content'")
        messages.append({"role": msg["role"], "content": _parts(msg["content"], what)})
    return messages


def _column_images(images: Any) -> list[Any]:
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _fill(messages: list[dict[str, Any]], extra: list[Any], where: str, column: str, images_column: str) -> None:
    """Put the separate column's images into the messages: into the placeholders, or before the first user text."""
    slots = [part for msg in messages for part in msg["content"] if part["type"] == "image"]
    carried = [part for part in slots if part.get("image") is not None]
    if carried and extra:
        raise DataError(
            f"{where}: images both in column {column!r} and in column {images_column!r}; give them in one place"
        )
    if not extra:
        if len(carried) != len(slots):
            raise DataError(
                f"{where}: column {column!r} has {len(slots) - len(carried)} image placeholder(s) without an image "
                f"and no images in column {images_column!r}"
            )
        return
    if slots:
        if len(slots) != len(extra):
            raise DataError(
                f"{where}: column {column!r} has {len(slots)} image placeholder(s) but column {images_column!r} "
                f"holds {len(extra)} image(s); they must match one to one, in order"
            )
        for part, value in zip(slots, extra, strict=True):
            part["image"] = value
        return
    user = next((msg for msg in messages if msg["role"] == "user"), None)
    if user is None:
        raise DataError(f"{where}: column {column!r} has no user message to attach the images of {images_column!r} to")
    user["content"] = [{"type": "image", "image": value} for value in extra] + user["content"]


def normalize_prompt(
    prompt: Any,
    *,
    where: str,
    column: str = "prompt",
    images: Any = None,
    images_column: str = "images",
    limits: ImageLimits | None = None,
    base_dir: str | None = None,
) -> ChatMessages:
    """The canonical multimodal messages of a row (module docstring); ``DataError`` naming ``where``."""
    limits = limits or ImageLimits()
    messages = _as_messages(prompt, column, where)
    _fill(messages, _column_images(images), where, column, images_column)
    count = 0
    for msg in messages:
        for part in msg["content"]:
            if part["type"] != "image":
                continue
            what = f"{where}: image {count}"
            count += 1
            if count > limits.max_images:
                continue  # counted, reported below with the total
            data = image_bytes(_payload(part, what), what, base_dir)
            part.clear()  # other keys of the part (a datasets path, resize hints) are not carried on
            part.update({"type": "image", "image": data})
            _check_image(part["image"], what, limits)
    if count > limits.max_images:
        raise DataError(f"{where}: {count} images, more than the limit of {limits.max_images} per row")
    return messages


def _payload(part: Mapping[str, Any], what: str) -> Any:
    if "image" not in part:
        raise DataError(f"{what}: an image part needs its image under the key 'image'")
    return part["image"]


def image_row_to_sample(
    row: Mapping[str, Any],
    *,
    where: str,
    uid: str,
    prompt_column: str = "prompt",
    images_column: str = "images",
    response_column: str | None = None,
    limits: ImageLimits | None = None,
    base_dir: str | None = None,
) -> PromptSample:
    """One row with images as a ``PromptSample`` whose prompt is the canonical messages; the other
    columns (not the prompt's or the images') are kept in ``metadata``."""
    if prompt_column not in row:
        raise DataError(f"{where}: no column {prompt_column!r}; the row has {sorted(map(str, row))}")
    if response_column is not None and row.get(response_column) is None:
        raise DataError(f"{where}: no value in column {response_column!r} (the ground truth)")
    prompt = normalize_prompt(
        row[prompt_column],
        where=where,
        column=prompt_column,
        images=row.get(images_column),
        images_column=images_column,
        limits=limits,
        base_dir=base_dir,
    )
    metadata = {str(k): v for k, v in row.items() if k not in (prompt_column, images_column)}
    truth = row[response_column] if response_column is not None else None
    return PromptSample(prompt=prompt, ground_truth=truth, uid=uid, metadata=metadata)


def prompt_images(prompt: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """The ordered raw bytes of a canonical prompt's images (the payload every role shares)."""
    return [
        part["image"]
        for msg in prompt
        if isinstance(msg.get("content"), list)
        for part in msg["content"]
        if part.get("type") == "image"
    ]
