"""The preflight of a vision-language policy: each refusal by name, and image rows checked row by row."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from posttrain.config.loading import build_config
from posttrain.config.opd import OPDConfig
from posttrain.preflight import grpo_preflight


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    from posttrain.models.tiny import make_tiny_vl_model

    return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")), smollm2_tokenizer_dir, vision_depth=1)


def _errors(overrides: list[str]) -> list[str]:
    return grpo_preflight(build_config(None, overrides)).errors


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.sequence_packing=true", "model.sequence_packing=true cannot pack image prompts"),
        ("model.share_prompt_prefix=true", "model.share_prompt_prefix=true: the shared-prompt forward"),
        ("grid.gpu_placement=disaggregated", "grid.gpu_placement=disaggregated: rollout replicas sample text"),
        ("rollout.repetition_penalty=1.1", "rollout.repetition_penalty=1.1: the image sampler has no repetition"),
        ("rl.score_centering.enabled=true", "rl.score_centering.enabled=true: the image sampler returns no top-k"),
        ("rl.grpo_surrogate=legacy_pg", "rl.grpo_surrogate=legacy_pg cannot score multimodal inputs"),
        ("model.lora.rank=8", "model.lora: adapters on a vision-language policy are not supported yet"),
        ("model.compile=true", "model.compile=true is not supported for vision-language policies yet"),
        ("rollout.engines_per_device=2", "rollout.engines_per_device=2 splits text prompts only"),
        ("model.use_chat_template=false", "model.use_chat_template=false: image markers are written by the chat"),
    ],
)
def test_each_refusal_is_named(vl_dir: str, override: str, message: str) -> None:
    head = f"model.name_or_path={vl_dir} is a vision-language model (qwen3_vl): "
    errors = _errors([f"model.name_or_path={vl_dir}", override])
    assert any(e.startswith(head + message) for e in errors), errors


def test_vllm_is_refused_by_name_where_torchvision_is_missing_and_taken_where_it_is(
    vl_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    head = f"model.name_or_path={vl_dir} is a vision-language model (qwen3_vl): rollout.backend=vllm cannot"

    def missing(name: str, *a: object) -> object:
        return None if name == "torchvision" else real(name, *a)  # type: ignore[arg-type]

    def present(name: str, *a: object) -> object:
        return object() if name == "torchvision" else real(name, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", missing)
    errors = _errors([f"model.name_or_path={vl_dir}", "rollout.backend=vllm"])
    assert any(e.startswith(head) and "needs torchvision, which is not installed" in e for e in errors), errors
    monkeypatch.setattr(importlib.util, "find_spec", present)
    errors = _errors([f"model.name_or_path={vl_dir}", "rollout.backend=vllm"])
    assert not any(e.startswith(head) for e in errors), errors


def test_a_plain_vision_run_passes_and_auto_sharing_is_not_refused(vl_dir: str) -> None:
    overrides = [f"model.name_or_path={vl_dir}", "rl.data.factory=posttrain.data.visual:shape_count_rows"]
    assert _errors([*overrides, "model.freeze_vision_tower=true"]) == []


def test_opd_with_a_vision_student_is_refused(vl_dir: str, tiny_model_dir: str) -> None:
    from posttrain.preflight.opd import opd_preflight

    cfg = build_config(None, [f"model.name_or_path={vl_dir}", f"rl.teacher.name_or_path={tiny_model_dir}"], OPDConfig)
    errors = opd_preflight(cfg).errors
    assert any("rl.teacher.input_mode=shared_vocab is a text mode: a vision-language student" in e for e in errors)


def test_model_directory_problems(vl_dir: str, tiny_model_dir: str, tmp_path: Path) -> None:
    errors = _errors([f"model.name_or_path={tiny_model_dir}", "model.freeze_vision_tower=true"])
    assert any(e.startswith("model.freeze_vision_tower=true, but model.name_or_path=") for e in errors), errors
    no_processor = tmp_path / "no_processor"
    shutil.copytree(vl_dir, no_processor)
    (no_processor / "preprocessor_config.json").unlink()
    errors = _errors([f"model.name_or_path={no_processor}"])
    assert any("holds no preprocessor_config.json (its image processor)" in e for e in errors), errors
    config = json.loads((no_processor / "config.json").read_text())
    (no_processor / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_vl_moe"}))
    errors = _errors([f"model.name_or_path={no_processor}"])
    assert any("(qwen3_vl_moe): posttrain trains qwen3_vl policies only" in e for e in errors), errors


def _png(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_image_rows_are_checked_row_by_row(vl_dir: str, tmp_path: Path) -> None:
    (tmp_path / "big.png").write_bytes(_png((40, 30)))
    (tmp_path / "small.png").write_bytes(_png((8, 8)))
    rows = [
        {"prompt": [{"role": "user", "content": [{"type": "image", "image": "small.png"}]}], "answer": 1},
        {"prompt": "How many?", "images": ["small.png", "small.png"], "answer": 2},
        {"prompt": [{"role": "user", "content": [{"type": "image", "image": "big.png"}]}], "answer": 3},
        {"prompt": "How many?", "images": "missing.png", "answer": 4},
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}], "answer": 5},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    limits = ["rl.data.images.max_per_row=1", "rl.data.images.max_pixels=1000"]
    errors = _errors([f"model.name_or_path={vl_dir}", f"rl.data.path={path}", *limits])
    assert errors == [
        f"{path} line 2: 2 images, more than the limit of 1 per row",
        f"{path} line 3: image 0: 40x30 = 1200 pixels, more than the limit of 1000; downscale the image",
        f"{path} line 4: image 0: cannot read image file '{tmp_path / 'missing.png'}' (No such file or directory)",
        f"{path} line 5: column 'prompt' has 1 image placeholder(s) without an image and no images in column 'images'",
    ]
    # the valid rows build into image samples (bytes, in order); the first bad row stops the build
    from posttrain.data.build import build_data_source
    from posttrain.data.images import prompt_images
    from posttrain.errors import DataError

    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    source = build_data_source(build_config(None, [f"rl.data.path={good}"]).rl.data, 0, images=True)
    samples = sorted(source.next_batch(2), key=lambda s: s.uid)
    assert [len(prompt_images(s.prompt)) for s in samples] == [1, 2]  # type: ignore[arg-type]
    assert prompt_images(samples[1].prompt) == [_png((8, 8))] * 2  # type: ignore[arg-type]
    with pytest.raises(DataError, match="line 2: 2 images, more than the limit of 1 per row"):
        build_data_source(build_config(None, [f"rl.data.path={path}", *limits]).rl.data, 0, images=True)
