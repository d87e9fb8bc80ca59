"""Vision-language prompts: render chat messages with ordered images into a Qwen3-VL model's inputs.

A multimodal prompt is a chat-message list whose contents may be lists of parts, ``{"type": "text",
"text": ...}`` and ``{"type": "image", "image": <raw encoded bytes>}`` (``posttrain.data.images``
produces this canonical form from every row format). The ordered raw bytes are the payload every
role shares; each role (policy, rollout engine, an OPD teacher) renders them with its own processor
through ``VisionProcessor``.

``VisionProcessor`` does what ``transformers``' ``Qwen3VLProcessor`` does for images, with pieces
that need no torchvision (that processor's video half imports it): the tokenizer's chat template
writes one ``<|vision_start|><|image_pad|><|vision_end|>`` marker per image part, the image
processor (``Qwen2VLImageProcessorPil``, read from the model directory's ``preprocessor_config.json``)
gives each image's patch grid ``(t, h, w)``, and each marker's single ``<|image_pad|>`` is expanded to
``t * h * w / merge_size**2`` copies, the number of vision embeddings the model scatters there. The
expansion is checked: exactly one pad token per marker before, the expanded width after.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
"""The special tokens of Qwen3-VL's image path, in the order the tiny model adds them."""

IMAGE_MARKER = VISION_START + IMAGE_PAD + VISION_END
"""What the chat template writes for one image part, before expansion."""

VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A ChatML template (SmolLM2's, without its default system message) that renders image parts as markers."""


@dataclass(frozen=True)
class VisionPrompt:
    """One rendered multimodal prompt.

    ``input_ids`` holds every image's expanded pad run; ``pixel_values_P`` the flattened patches of
    all images in order (P rows, ``channels * temporal_patch * patch**2`` columns); ``image_grid_thw_I3``
    one ``(t, h, w)`` row per image (I images). ``mm_token_type_ids`` (1 on image pads, else 0) is
    what Qwen3-VL's forward needs to place its multimodal rotary positions.
    """

    input_ids: list[int]
    pixel_values_P: torch.Tensor | None
    image_grid_thw_I3: torch.Tensor | None
    images: tuple[Any, ...] = ()
    """The decoded (PIL) images in order: what a vLLM engine is sent (it runs its own processor
    and its expansion is checked against ``input_ids``, ``rollout/vllm_images.py``)."""

    def mm_token_type_ids(self, image_pad_id: int) -> list[int]:
        """1 where a token is an image pad, 0 elsewhere."""
        return [1 if t == image_pad_id else 0 for t in self.input_ids]


VISION_MODEL_TYPES = frozenset({"qwen3_vl"})
"""``config.json`` ``model_type``s a run trains as a vision-language policy (the MoE variant,
``qwen3_vl_moe``, comes with the MoE work)."""


def vision_model_type(model_dir: str | Path) -> str | None:
    """The ``model_type`` of a vision-language model directory (its ``config.json`` has a
    ``vision_config``: Qwen3-VL and its relatives), None for a text model or a directory without a
    readable ``config.json``. Reads JSON only (the preflight asks before anything loads)."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        return None
    return str(config.get("model_type") or "unknown")


def image_parts(messages: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """The raw bytes of every image part of ``messages``, in reading order (the shared payload)."""
    out: list[bytes] = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            out += [part["image"] for part in content if isinstance(part, Mapping) and part.get("type") == "image"]
    return out


def decode_image(data: bytes, what: str) -> Any:
    """The RGB ``PIL.Image`` of encoded ``data``; a ``DataError`` naming ``what`` when PIL cannot read it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DataError(f"{what}: not an image PIL can decode ({exc})") from exc


class VisionProcessor:
    """Tokenizer plus image processor of one vision-language model directory (see the module docstring)."""

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.merge_size = int(image_processor.merge_size)
        ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
        unk = getattr(tokenizer, "unk_token_id", None)
        missing = [tok for tok, i in zip(VISION_TOKENS, ids, strict=True) if i is None or i == unk]
        if missing:
            raise ConfigError([f"the tokenizer has no vision tokens {missing}; it is not a Qwen3-VL tokenizer"])
        self.vision_start_id, self.vision_end_id, self.image_pad_id, self.video_pad_id = ids

    @classmethod
    def from_dir(cls, path: str, tokenizer: Any = None) -> VisionProcessor:
        """The processor of a model directory holding a tokenizer and ``preprocessor_config.json``
        (``tokenizer``: that directory's tokenizer, already loaded)."""
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        if not (Path(path) / "preprocessor_config.json").is_file():
            raise ConfigError([f"model directory {path} holds no preprocessor_config.json: it has no image processor"])
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(tokenizer, Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True))

    def image_width(self, grid_thw: Sequence[int]) -> int:
        """How many pad tokens one image of patch grid ``(t, h, w)`` expands to."""
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // (self.merge_size**2)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        where: str = "prompt",
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> VisionPrompt:
        """``messages`` rendered for generation (``add_generation_prompt``) with every marker expanded."""
        images = image_parts(messages)
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=False, **dict(template_kwargs or {})
        )
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not images:
            return VisionPrompt(ids, None, None)
        pil = [decode_image(data, f"{where} image {k}") for k, data in enumerate(images)]
        out = self.image_processor(images=pil, return_tensors="pt")
        grid = out["image_grid_thw"]
        return VisionPrompt(
            self.expand(ids, [self.image_width(g) for g in grid.tolist()], where),
            out["pixel_values"],
            grid,
            tuple(pil),
        )

    def expand(self, ids: Sequence[int], widths: Sequence[int], where: str = "prompt") -> list[int]:
        """``ids`` with its k-th single ``<|image_pad|>`` replaced by ``widths[k]`` pads.

        Each pad must sit alone between ``<|vision_start|>`` and ``<|vision_end|>`` and there must be
        one per image: a prompt already expanded, or with a marker the template did not write, fails.
        """
        pads = [i for i, t in enumerate(ids) if t == self.image_pad_id]
        if len(pads) != len(widths):
            raise DataError(
                f"{where}: {len(pads)} {IMAGE_PAD} token(s) in the rendered prompt for {len(widths)} image(s); "
                f"the chat template must write exactly one {IMAGE_MARKER} per image part"
            )
        out: list[int] = []
        last = 0
        for k, (pos, width) in enumerate(zip(pads, widths, strict=True)):
            if (
                pos == 0
                or ids[pos - 1] != self.vision_start_id
                or pos + 1 >= len(ids)
                or ids[pos + 1] != self.vision_end_id
            ):
                raise DataError(
                    f"{where}: image {k}'s {IMAGE_PAD} is not alone between {VISION_START} and {VISION_END}"
                )
            out += list(ids[last:pos]) + [self.image_pad_id] * width
            last = pos + 1
        return out + list(ids[last:])

    def collapse(self, ids: Sequence[int]) -> list[int]:
        """``ids`` with every run of ``<|image_pad|>`` collapsed to one: the form vLLM takes a token prompt
        with images in (it re-applies the expansion itself), and the inverse of ``expand``."""
        out: list[int] = []
        for t in ids:
            if t == self.image_pad_id and out and out[-1] == self.image_pad_id:
                continue
            out.append(t)
        return out
