"""Multimodal OPD's placeholder checks, each failure by name, on a tiny random Qwen3-VL (CPU).

The teacher renders its own image prefix (``teacher/multimodal.py``) and its transformers scorer
(``teacher/hf_vision_teacher.py``) expands each marker itself; the checks are exercised on real
renderings and real engine outputs: a template that writes no marker, an already-expanded request
(the engine's second expansion), an engine whose image processor resizes differently (width drift),
a prompt that moved (boundary drift), a student prompt with another image count, and a video part.
A failure inside ``TeacherSignals.score`` fails the whole batch, naming the check, with no signal.
Also: the scorer's logprobs are the model's own forward on the expanded prompt, and the preflight's
identity bind and refusals name what to change.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from posttrain.config.loading import build_config
from posttrain.config.opd import OPDConfig
from posttrain.models.vision import VisionProcessor
from posttrain.rollout.base import Completion, RolloutBatch
from posttrain.teacher.base import TeacherError
from posttrain.teacher.multimodal import (
    MediaRenderer,
    check_markers,
    render_media_prefix,
    verify_engine_prompt,
)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    from posttrain.models.tiny import make_tiny_vl_model

    return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")), smollm2_tokenizer_dir, vision_depth=1)


@pytest.fixture(scope="module")
def model(vl_dir: str) -> object:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()


@pytest.fixture
def processor(vl_dir: str) -> VisionProcessor:
    return VisionProcessor.from_dir(vl_dir)


def _prompt(n_images: int = 1, seed: int = 0) -> list[dict[str, object]]:
    from posttrain.data.visual import render_squares

    rng = random.Random(seed)
    parts: list[dict[str, object]] = [
        {"type": "image", "image": render_squares(rng, k + 1, 48 + 16 * k)} for k in range(n_images)
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "How many squares?"}]}]


def test_prefix_is_collapsed_for_the_engine_and_expanded_as_the_student_renders_it(processor: VisionProcessor) -> None:
    prompt = _prompt(2)
    prefix = render_media_prefix(processor, prompt, where="p")
    student = processor.render(prompt)
    assert prefix.expected_ids == student.input_ids  # the same processor renders the same ids
    grid = student.image_grid_thw_I3
    assert grid is not None
    assert prefix.widths == [int(g.prod()) // 4 for g in grid]
    assert prefix.collapsed_ids.count(processor.image_pad_id) == 2
    assert processor.expand(prefix.collapsed_ids, prefix.widths) == prefix.expected_ids


def test_missing_marker_fails_by_name(processor: VisionProcessor) -> None:
    # a teacher template that drops image parts writes no marker for the image
    processor.tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}"
        "{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n"
    )
    with pytest.raises(TeacherError, match=r"teacher prompt 0: missing image marker: .* 0 image block\(s\) for 1"):
        render_media_prefix(processor, _prompt(1), where="teacher prompt 0")
    s, e, pad = processor.vision_start_id, processor.vision_end_id, processor.image_pad_id
    with pytest.raises(TeacherError, match=r"missing image marker: image 0's block holds no lone"):
        check_markers([1, s, e, 2], 1, processor, "p")
    with pytest.raises(TeacherError, match=r"image 0's block holds 3 <\|image_pad\|> before expansion"):
        check_markers([1, s, pad, pad, pad, e, 2], 1, processor, "p")


def test_video_teacher_input_is_refused(processor: VisionProcessor) -> None:
    prompt = [{"role": "user", "content": [{"type": "video", "video": b"x"}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(TeacherError, match="video teacher input is not supported"):
        render_media_prefix(processor, prompt, where="p")
    with pytest.raises(TeacherError, match="video teacher input is not supported"):
        check_markers([1, processor.video_pad_id, 2], 0, processor, "p")


def _teacher(model: object, processor: VisionProcessor) -> object:
    from posttrain.teacher.hf_vision_teacher import HFVisionTeacher

    return HFVisionTeacher(model, processor, chunk_tokens=8)


def test_scorer_reports_the_prompt_it_scored_and_the_model_s_own_logprobs(
    model: object, processor: VisionProcessor
) -> None:
    from posttrain.policy.batching import build_policy_batch
    from posttrain.policy.images import ImageInputs, vl_completion_logprobs

    prompt = _prompt(2, seed=3)
    prefix = render_media_prefix(processor, prompt, where="p")
    completion = processor.tokenizer("3 squares", add_special_tokens=False)["input_ids"]
    scores = _teacher(model, processor).score([prefix.request(completion)], top_k=4)  # type: ignore[attr-defined]
    assert scores[0].prompt_ids == prefix.expected_ids
    rendered = processor.render(prompt)
    batch = build_policy_batch([rendered.input_ids], [completion], pad_id=0, device=torch.device("cpu"))
    images = ImageInputs([rendered.pixel_values_P], [rendered.image_grid_thw_I3])
    with torch.no_grad():
        ref = vl_completion_logprobs(model, batch, images, image_pad_id=processor.image_pad_id, merge_size=2)
    assert torch.allclose(torch.tensor(scores[0].logprobs), ref[0], atol=1e-5)
    top = scores[0].topk_logprobs
    assert top is not None and all(row[0] >= lp - 1e-6 for row, lp in zip(top, scores[0].logprobs, strict=True))


def test_second_expansion_fails_by_name(model: object, processor: VisionProcessor) -> None:
    from posttrain.teacher.multimodal import MediaScoreRequest

    prefix = render_media_prefix(processor, _prompt(1), where="teacher prompt 0")
    width = prefix.widths[0]
    assert width > 1
    # a request sent already expanded: the engine replaces its marker's first pad once more
    expanded = MediaScoreRequest(
        token_ids=[*prefix.expected_ids, 11, 12],
        score_from=len(prefix.expected_ids),
        images=prefix.images,
        expected_prompt_ids=tuple(prefix.expected_ids),
        widths=tuple(prefix.widths),
        where="teacher prompt 0",
    )
    match = rf"teacher prompt 0: second expansion: image 0's marker .* became {2 * width - 1} .* grid says {width}"
    with pytest.raises(TeacherError, match=match):
        _teacher(model, processor).score([expanded], top_k=2)  # type: ignore[attr-defined]


def _upscaling(vl_dir: str) -> object:
    """The directory's image processor with other resize bounds: every image at least 96 x 96."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(vl_dir, size={"shortest_edge": 96 * 96, "longest_edge": 128 * 128})


def test_width_drift_fails_by_name(model: object, vl_dir: str) -> None:
    renderer = VisionProcessor.from_dir(vl_dir)
    engine = VisionProcessor.from_dir(vl_dir)
    engine.image_processor = _upscaling(vl_dir)
    prefix = render_media_prefix(renderer, _prompt(1), where="teacher prompt 0")
    assert prefix.widths == [4]
    with pytest.raises(TeacherError, match=r"teacher prompt 0: width drift: image 0's marker .* became 9 .* says 4"):
        _teacher(model, engine).score([prefix.request([11, 12])], top_k=2)  # type: ignore[attr-defined]


def test_boundary_drift_and_engine_image_count_fail_by_name(processor: VisionProcessor) -> None:
    pad, s, e = processor.image_pad_id, processor.vision_start_id, processor.vision_end_id
    expected = [1, s, pad, pad, e, 5, 6]
    verify_engine_prompt(expected, expected, [2], pad, "p")  # the right prompt passes
    with pytest.raises(TeacherError, match=r"p: boundary drift: .* departs from the expected prefix .* at token 5"):
        verify_engine_prompt([1, s, pad, pad, e, 7, 6], expected, [2], pad, "p")
    with pytest.raises(TeacherError, match=r"p: image count mismatch between roles: .* 2 image pad run\(s\) for 1"):
        verify_engine_prompt([1, s, pad, pad, e, s, pad, e], expected, [2], pad, "p")


def test_image_count_mismatch_between_roles_fails_by_name(processor: VisionProcessor) -> None:
    renderer = MediaRenderer(processor, student_vision_start_id=processor.vision_start_id, shared=True)
    student_two = processor.render(_prompt(2)).input_ids  # the student rendered two images
    with pytest.raises(TeacherError, match=r"teacher prompt 0: image count mismatch between roles: .* 2 image\(s\)"):
        renderer.prefixes([student_two], [_prompt(1)])
    shifted = [11, *processor.render(_prompt(1)).input_ids]  # one token in front of the same prompt
    with pytest.raises(TeacherError, match=r"teacher's expanded prompt .* differs from the student's .* from token 0"):
        renderer.prefixes([shifted], [_prompt(1)])


def test_a_failed_check_fails_the_whole_batch_before_any_signal(model: object, vl_dir: str, tmp_path: Path) -> None:
    from posttrain.teacher.scoring import TeacherSignals

    cfg = build_config(
        None,
        [
            f"model.name_or_path={vl_dir}",
            f"rl.teacher.name_or_path={vl_dir}",
            "rl.teacher.input_mode=shared_vocab_multimodal",
        ],
        OPDConfig,
    )
    student = VisionProcessor.from_dir(vl_dir)
    engine = VisionProcessor.from_dir(vl_dir)
    teacher = _teacher(model, engine)
    signals = TeacherSignals(cfg, teacher, student.tokenizer, len(student.tokenizer))  # type: ignore[arg-type]
    prompt = _prompt(1)
    ids = student.render(prompt).input_ids
    rollout = RolloutBatch([ids], [Completion(0, [11, 12], [-1.0, -1.0], "length")])
    good = signals.score(rollout, [prompt])
    assert good.topk_ids is not None and len(good.topk_ids[0]) == 2
    # the engine's own processor now resizes differently from the renderer's (built with the signals)
    teacher.processor = VisionProcessor(engine.tokenizer, _upscaling(vl_dir))  # type: ignore[attr-defined]
    with pytest.raises(TeacherError, match=r"failed 2 time\(s\) in a row.*nothing of this batch.*width drift"):
        signals.score(rollout, [prompt])


def _opd(vl_dir: str, teacher: str, *extra: str) -> list[str]:
    from posttrain.preflight.opd import opd_preflight

    overrides = [f"model.name_or_path={vl_dir}", f"rl.teacher.name_or_path={teacher}", *extra]
    return opd_preflight(build_config(None, overrides, OPDConfig)).errors


def test_preflight_binds_the_media_identity_and_refuses_what_carries_no_images(
    vl_dir: str, tiny_model_dir: str, tmp_path: Path
) -> None:
    shared = "rl.teacher.input_mode=shared_vocab_multimodal"
    data = "rl.data.factory=posttrain.data.visual:shape_count_rows"
    assert _opd(vl_dir, vl_dir, shared, data) == []
    other = tmp_path / "teacher"
    shutil.copytree(vl_dir, other)
    processor_file = other / "preprocessor_config.json"
    processor_file.write_text(processor_file.read_text().replace('"patch_size": 16', '"patch_size": 8'))
    errors = _opd(vl_dir, str(other), shared, data)
    assert len(errors) == 1 and "binds the teacher's image processor (preprocessor_config.json" in errors[0]
    assert "cross_token_multimodal" in errors[0]
    assert any("needs a vision-language teacher" in e for e in _opd(vl_dir, tiny_model_dir, shared, data))
    refused = _opd(vl_dir, vl_dir, shared, data, "rl.teacher.backend=vllm", "grid.backend=ray")
    assert any("rl.teacher.backend=vllm: the vLLM teacher does not take images yet" in e for e in refused)
    assert any("grid.backend=ray: the Ray teacher pool does not carry images yet" in e for e in refused)


def test_the_media_identity_is_part_of_the_resume_identity(vl_dir: str, tmp_path: Path) -> None:
    from posttrain.checkpoint import CheckpointError
    from posttrain.checkpoint.layout import TrainingState
    from posttrain.loop.resume import check_resume_compatible, resume_identity

    teacher = tmp_path / "teacher"
    shutil.copytree(vl_dir, teacher)
    base = [f"model.name_or_path={vl_dir}", f"rl.teacher.name_or_path={teacher}"]
    text = build_config(None, base, OPDConfig)
    assert "media" not in text.resume_identity_extra()["teacher"]  # text identities stay as they were
    cfg = build_config(None, [*base, "rl.teacher.input_mode=shared_vocab_multimodal"], OPDConfig)
    saved = resume_identity(cfg)
    media = saved["teacher"]["media"]
    assert media["placeholders"]["<|image_pad|>"] == VisionProcessor.from_dir(vl_dir).image_pad_id
    assert media["videos"] == 0 and media["max_images_per_prompt"] == 8
    processor_file = teacher / "preprocessor_config.json"
    processor_file.write_text(processor_file.read_text().replace('"patch_size": 16', '"patch_size": 8'))
    state = TrainingState(2, 2, 0, {}, {}, {}, saved)
    with pytest.raises(CheckpointError, match=r"teacher changed: .*media"):
        check_resume_compatible(state, resume_identity(cfg), 1)


def test_same_vocabulary_advantage_mode_credits_every_completion_token(model: object, vl_dir: str) -> None:
    from posttrain.teacher.scoring import TeacherSignals

    overrides = [f"model.name_or_path={vl_dir}", f"rl.teacher.name_or_path={vl_dir}"]
    overrides += ["rl.teacher.input_mode=shared_vocab_multimodal", "rl.distillation_mode=advantage", "rl.jsd_beta=null"]
    cfg = build_config(None, overrides, OPDConfig)
    processor = VisionProcessor.from_dir(vl_dir)
    signals = TeacherSignals(cfg, _teacher(model, processor), processor.tokenizer, len(processor.tokenizer))  # type: ignore[arg-type]
    prompt = _prompt(1)
    rollout = RolloutBatch(
        [processor.render(prompt).input_ids], [Completion(0, [11, 12, 13], [-1.0, -2.0, -3.0], "length")]
    )
    signal = signals.score(rollout, [prompt])
    assert signal.credit is not None and signal.topk_ids is None
    teacher = (
        _teacher(model, processor)
        .score(  # type: ignore[attr-defined]
            [render_media_prefix(processor, prompt, where="p").request([11, 12, 13])], top_k=0
        )[0]
        .logprobs
    )
    # the legacy same-token credit: teacher minus rollout logprob of each realized token
    assert signal.credit[0] == pytest.approx([t - r for t, r in zip(teacher, [-1.0, -2.0, -3.0], strict=True)])
