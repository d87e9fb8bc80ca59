"""The multimodal teacher's own prefix, and the checks that keep its image placeholders honest.

In the ``*_multimodal`` input modes every role gets the same ordered raw image bytes (the canonical
prompt's image parts, ``posttrain.data.images``) and renders them itself. The teacher renders its
prefix with its own chat template and tokenizer (``render_media_prefix``): the template must write
exactly one logical image marker, ``<|vision_start|><|image_pad|><|vision_end|>``, per submitted
image block (``check_markers``), and the teacher's own image processor gives each image's patch grid
and therefore the width ``t * h * w / merge_size**2`` each marker expands to. The request the engine
receives holds each marker collapsed to its single pad plus the student's completion (a scoring
engine re-applies the placeholder expansion to token prompts, as vLLM does); the engine reports the
prompt it actually scored, and ``verify_engine_prompt`` demands that it equals the expected ids:

* each image block's pad run has exactly the width the teacher processor's grid says; a longer run
  of ``2W - 1`` (or a multiple of ``W``) pads is a **second expansion**, any other a **width drift**;
* after collapsing those exact-width runs, every other token equals the expected prefix (a
  **boundary drift** otherwise), and the number of image blocks equals the number of images.

Every failure raises ``TeacherError`` naming the sample, the image and the check, which fails the
scoring attempt (``teacher/scoring.py``) before any signal is published. Video teacher input is
refused. The same-vocabulary mode (``shared_vocab_multimodal``) additionally requires the teacher's
expanded prefix to equal the student's prompt ids exactly (the processor, template and
placeholders are bound identical before the run: ``preflight/opd_media.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.models.vision import (
    IMAGE_MARKER,
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    VisionProcessor,
    decode_image,
    image_parts,
)
from posttrain.teacher.base import ScoreRequest, SequenceScores, TeacherError
from posttrain.teacher.render import EMPTY_THINK_SUFFIX, check_single_prefix

VIDEO_REFUSAL = (
    "video teacher input is not supported: the multimodal teacher takes ordered images only "
    "(rl.teacher.input_mode=*_multimodal)"
)


@dataclass(frozen=True)
class MediaScoreRequest(ScoreRequest):
    """A teacher request with images: ``token_ids`` hold one pad per image marker (collapsed),
    ``images`` the ordered raw bytes; ``expected_prompt_ids`` the expanded prefix the engine must
    report back, ``widths`` each image's expected pad count."""

    images: tuple[bytes, ...] = ()
    expected_prompt_ids: tuple[int, ...] = ()
    widths: tuple[int, ...] = ()
    where: str = "teacher request"


@dataclass(frozen=True)
class MediaPrefix:
    """One prompt as the teacher renders it: collapsed ids, expected expanded ids, widths, images."""

    collapsed_ids: list[int]
    expected_ids: list[int]
    widths: list[int]
    images: tuple[bytes, ...]
    where: str

    def request(self, tail: Sequence[int]) -> MediaScoreRequest:
        """The engine request of this prefix followed by ``tail`` (the completion's ids)."""
        return MediaScoreRequest(
            token_ids=self.collapsed_ids + list(tail),
            score_from=len(self.collapsed_ids),
            images=self.images,
            expected_prompt_ids=tuple(self.expected_ids),
            widths=tuple(self.widths),
            where=self.where,
        )


def _blocks(ids: Sequence[int], processor: VisionProcessor) -> list[tuple[int, int]]:
    """``(start, end)`` of every image block: ``ids[start]`` a vision start, ``ids[end]`` its vision end."""
    out, open_at = [], None
    for i, t in enumerate(ids):
        if t == processor.vision_start_id:
            if open_at is not None:
                raise TeacherError(f"{VISION_START} at token {i} opens a block inside the block opened at {open_at}")
            open_at = i
        elif t == processor.vision_end_id:
            if open_at is None:
                raise TeacherError(f"{VISION_END} at token {i} closes no open image block")
            out.append((open_at, i))
            open_at = None
    if open_at is not None:
        raise TeacherError(f"the image block opened at token {open_at} is never closed by {VISION_END}")
    return out


def check_markers(ids: Sequence[int], n_images: int, processor: VisionProcessor, where: str) -> None:
    """Exactly one logical image marker per submitted image block, one block per image, no video."""
    if processor.video_pad_id in ids:
        raise TeacherError(f"{where}: {VIDEO_REFUSAL}")
    try:
        blocks = _blocks(ids, processor)
    except TeacherError as exc:
        raise TeacherError(f"{where}: {exc}") from None
    if len(blocks) != n_images:
        raise TeacherError(
            f"{where}: missing image marker: the teacher's rendered prompt has {len(blocks)} image block(s) for "
            f"{n_images} image(s); its chat template must write exactly one {IMAGE_MARKER} per image part"
        )
    inside = 0
    for k, (start, end) in enumerate(blocks):
        pads = sum(1 for t in ids[start + 1 : end] if t == processor.image_pad_id)
        if pads == 0 or end - start - 1 != pads:
            raise TeacherError(
                f"{where}: missing image marker: image {k}'s block holds no lone {IMAGE_PAD} between "
                f"{VISION_START} and {VISION_END}"
            )
        if pads > 1:
            raise TeacherError(
                f"{where}: image {k}'s block holds {pads} {IMAGE_PAD} before expansion, not one logical marker "
                "(an already-expanded prompt: the engine would expand it a second time)"
            )
        inside += pads
    if sum(1 for t in ids if t == processor.image_pad_id) != inside:
        raise TeacherError(f"{where}: an {IMAGE_PAD} outside any image block of the teacher's prompt")


def render_media_prefix(
    processor: VisionProcessor,
    prompt: str | list[dict[str, Any]],
    *,
    where: str,
    think_prefix: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> MediaPrefix:
    """The teacher's own rendering of ``prompt`` (chat template, one think prefix when given, its
    tokenizer, its processor's grids), checked (``check_markers``) and expanded."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") == "video" for p in content):
            raise TeacherError(f"{where}: {VIDEO_REFUSAL}")
    images = tuple(image_parts(messages))
    tokenizer = processor.tokenizer
    text = str(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **dict(template_kwargs or {})
        )
    )
    if think_prefix:
        text = EMPTY_THINK_SUFFIX.sub("", text) + think_prefix
        check_single_prefix(text, think_prefix)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    check_markers(ids, len(images), processor, where)
    widths = image_grid_widths(processor, images, where) if images else []
    expected = processor.expand(ids, widths, where)
    return MediaPrefix(processor.collapse(ids), expected, widths, images, where)


def image_grid_widths(processor: VisionProcessor, images: Sequence[bytes], where: str) -> list[int]:
    """Each image's expanded width under ``processor``'s own resize rules (its grid ``(t, h, w)``)."""
    pil = [decode_image(data, f"{where} image {k}") for k, data in enumerate(images)]
    grid = processor.image_processor(images=pil, return_tensors="pt")["image_grid_thw"]
    return [processor.image_width(g) for g in grid.tolist()]


def student_image_count(ids: Sequence[int], vision_start_id: int | None) -> int:
    """How many images the student's rendered prompt holds (its vision blocks)."""
    return 0 if vision_start_id is None else sum(1 for t in ids if t == vision_start_id)


def check_image_counts(student: int, teacher: int, where: str) -> None:
    """Both roles must see the same number of images (the same ordered bytes)."""
    if student != teacher:
        raise TeacherError(
            f"{where}: image count mismatch between roles: the student's prompt holds {student} image(s), the "
            f"teacher's {teacher}; both must render the same ordered images"
        )


def check_same_prompt(student_ids: Sequence[int], teacher_ids: Sequence[int], where: str) -> None:
    """``shared_vocab_multimodal``: the teacher's expanded prefix is the student's prompt, token for token."""
    if list(student_ids) == list(teacher_ids):
        return
    at = next((i for i, (a, b) in enumerate(zip(student_ids, teacher_ids, strict=False)) if a != b), None)
    at = min(len(student_ids), len(teacher_ids)) if at is None else at
    raise TeacherError(
        f"{where}: the teacher's expanded prompt ({len(teacher_ids)} tokens) differs from the student's "
        f"({len(student_ids)} tokens) from token {at}; shared_vocab_multimodal needs one tokenizer, processor, "
        "chat template and placeholder set for both roles (use cross_token_multimodal otherwise)"
    )


def verify_engine_prompt(
    engine_ids: Sequence[int], expected_ids: Sequence[int], widths: Sequence[int], image_pad_id: int, where: str
) -> None:
    """The engine scored exactly the expected prefix: each image's pad run the grid's width, nothing
    else moved (see the module docstring for the names of the failures)."""
    runs: list[tuple[int, int]] = []  # (position, length) of every pad run
    i = 0
    while i < len(engine_ids):
        if engine_ids[i] == image_pad_id:
            j = i
            while j < len(engine_ids) and engine_ids[j] == image_pad_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    if len(runs) != len(widths):
        raise TeacherError(
            f"{where}: image count mismatch between roles: the engine's prompt holds {len(runs)} image pad run(s) "
            f"for {len(widths)} image(s)"
        )
    for k, ((pos, got), want) in enumerate(zip(runs, widths, strict=True)):
        if got == want:
            continue
        if got > want and (got == 2 * want - 1 or got % want == 0):
            raise TeacherError(
                f"{where}: second expansion: image {k}'s marker at token {pos} became {got} {IMAGE_PAD} where the "
                f"teacher processor's grid says {want} (the engine expanded an already-expanded prompt)"
            )
        raise TeacherError(
            f"{where}: width drift: image {k}'s marker at token {pos} became {got} {IMAGE_PAD} where the teacher "
            f"processor's grid says {want} (the engine resized the image differently)"
        )
    if list(engine_ids) != list(expected_ids):
        at = next((n for n, (a, b) in enumerate(zip(engine_ids, expected_ids, strict=False)) if a != b), None)
        at = min(len(engine_ids), len(expected_ids)) if at is None else at
        raise TeacherError(
            f"{where}: boundary drift: the engine's prompt ({len(engine_ids)} tokens) departs from the expected "
            f"prefix ({len(expected_ids)} tokens) at token {at}"
        )


def verify_media_scores(requests: Sequence[ScoreRequest], scores: Sequence[SequenceScores], image_pad_id: int) -> None:
    """Every media request's engine prompt checked (``verify_engine_prompt``) before any signal exists."""
    for n, (req, s) in enumerate(zip(requests, scores, strict=True)):
        if not isinstance(req, MediaScoreRequest):
            continue
        if s.prompt_ids is None:
            raise TeacherError(f"{req.where}: the teacher engine reported no expanded prompt for request {n}")
        verify_engine_prompt(s.prompt_ids, req.expected_prompt_ids, req.widths, image_pad_id, req.where)


class MediaRenderer:
    """The ``*_multimodal`` half of ``TeacherSignals``: each prompt's teacher prefix (checked against the
    student's rendering) and the same-vocabulary requests."""

    def __init__(
        self,
        processor: VisionProcessor,
        *,
        student_vision_start_id: int | None,
        shared: bool,
        think_prefix: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.processor = processor
        self.image_pad_id = processor.image_pad_id
        self.student_vision_start_id = student_vision_start_id
        self.shared = shared
        self.think_prefix = think_prefix
        self.template_kwargs = dict(template_kwargs or {})

    def prefixes(self, student_prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Any]) -> list[MediaPrefix]:
        """The teacher's prefix of every prompt; ``student_prompt_ids``: the student's rendering of each."""
        out = []
        for i, (ids, prompt) in enumerate(zip(student_prompt_ids, prompts, strict=True)):
            where = f"teacher prompt {i}"
            prefix = render_media_prefix(
                self.processor,
                prompt,
                where=where,
                think_prefix=self.think_prefix,
                template_kwargs=self.template_kwargs if self.shared else None,
            )
            check_image_counts(student_image_count(ids, self.student_vision_start_id), len(prefix.images), where)
            if self.shared:
                check_same_prompt(ids, prefix.expected_ids, where)
            out.append(prefix)
        return out

    def same_vocab_requests(
        self, student_prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Any], completions: Sequence[Any]
    ) -> list[ScoreRequest]:
        """One request per completion: its prompt's teacher prefix plus the student's ids verbatim."""
        prefixes = self.prefixes(student_prompt_ids, prompts)
        return [prefixes[c.prompt_index].request(c.token_ids) for c in completions]


def media_renderer(cfg: Any, teacher: Any, student_tokenizer: Any) -> MediaRenderer | None:
    """The renderer of a ``*_multimodal`` run (None otherwise); the teacher must carry its processor."""
    t = cfg.rl.teacher
    if not t.input_mode.endswith("_multimodal"):
        return None
    processor = getattr(teacher, "processor", None)
    if not isinstance(processor, VisionProcessor):
        raise TeacherError(
            f"rl.teacher.input_mode={t.input_mode} needs a vision-language teacher with its image processor; "
            f"{type(teacher).__name__} has none"
        )
    start = student_tokenizer.convert_tokens_to_ids(VISION_START)
    unk = getattr(student_tokenizer, "unk_token_id", None)
    return MediaRenderer(
        processor,
        student_vision_start_id=None if start is None or start == unk else int(start),
        shared=t.input_mode == "shared_vocab_multimodal",
        think_prefix=t.conditional_think_prefix,
        template_kwargs=cfg.model.chat_template_kwargs,
    )
