"""The ``rl.data.images`` section: how rows carry images for a vision-language policy (docs/multimodal.md).

Read only when ``model.name_or_path`` is a vision-language model (Qwen3-VL); a text run ignores it.
Kept in its own module so that ``config/data.py`` stays small; like every config module it
imports nothing above config.
"""

from __future__ import annotations

from pydantic import Field

from posttrain.config.section import Section


class ImageDataConfig(Section):
    """Images of a row: in its chat messages (``{"type": "image", "image": ...}`` parts) or in a column."""

    column: str = Field("images", min_length=1)
    """Column holding a row's images (one value or a list: file paths, raw bytes, ``datasets`` Image
    cells) when they are not inside the messages; filled into the messages' payload-free
    ``{"type": "image"}`` placeholders in order, or put before the first user text when there are none."""
    max_per_row: int = Field(8, ge=1)
    """Most images one row may carry; a row with more is refused by name (file and line, or row)."""
    max_pixels: int = Field(4096 * 4096, ge=1)
    """Most pixels (width x height, read from the image header) one image may have; a larger one is
    refused by name. The model's image processor resizes what it is given independently of this."""
