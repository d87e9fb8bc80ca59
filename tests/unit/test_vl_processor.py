"""The tiny random Qwen3-VL model and ``VisionProcessor``: placeholder expansion, its checks, a forward on images."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from posttrain.errors import ConfigError, DataError
from posttrain.models.vision import IMAGE_MARKER, VisionProcessor, image_parts


def _png(size: tuple[int, int], colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    from posttrain.models.tiny import make_tiny_vl_model

    return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")), smollm2_tokenizer_dir)


def _messages(*images: bytes) -> list[dict[str, object]]:
    parts: list[dict[str, object]] = [{"type": "image", "image": data} for data in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "How many squares?"}]}]


def test_directory_holds_model_tokenizer_and_image_processor(vl_dir: str) -> None:
    import json

    names = {p.name for p in Path(vl_dir).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= names
    config = json.loads((Path(vl_dir) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    vp = VisionProcessor.from_dir(vl_dir)
    assert config["image_token_id"] == vp.image_pad_id and config["vision_start_token_id"] == vp.vision_start_id


def test_render_expands_each_marker_to_its_grid_width(vl_dir: str) -> None:
    vp = VisionProcessor.from_dir(vl_dir)
    small, wide = _png((40, 40)), _png((64, 32))
    prompt = vp.render(_messages(small, wide))
    grid = prompt.image_grid_thw_I3
    assert grid is not None and prompt.pixel_values_P is not None
    # 16-pixel patches, resized into [32*32, 64*64] pixels at multiples of 32: (1, 2, 2) and (1, 2, 4).
    assert grid.tolist() == [[1, 2, 2], [1, 2, 4]]
    assert prompt.pixel_values_P.shape == (4 + 8, 3 * 2 * 16 * 16)
    unexpanded = vp.tokenizer(
        vp.tokenizer.apply_chat_template(_messages(small, wide), add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    # Hand-expanded: the first pad becomes 4 // 4 = 1 pad, the second 8 // 4 = 2 pads.
    pads = [i for i, t in enumerate(unexpanded) if t == vp.image_pad_id]
    expected = [*unexpanded[: pads[0]], vp.image_pad_id, *unexpanded[pads[0] + 1 : pads[1]]]
    expected += [vp.image_pad_id, vp.image_pad_id, *unexpanded[pads[1] + 1 :]]
    assert prompt.input_ids == expected
    assert sum(prompt.mm_token_type_ids(vp.image_pad_id)) == 3
    assert image_parts(_messages(small, wide)) == [small, wide]
    text_only = vp.render([{"role": "user", "content": "hi"}])
    assert text_only.pixel_values_P is None and vp.image_pad_id not in text_only.input_ids


def test_expansion_checks_fail_by_name(vl_dir: str) -> None:
    vp = VisionProcessor.from_dir(vl_dir)
    s, e, pad = vp.vision_start_id, vp.vision_end_id, vp.image_pad_id
    assert vp.expand([7, s, pad, e, 8], [3]) == [7, s, pad, pad, pad, e, 8]
    assert vp.collapse([7, s, pad, pad, pad, e, s, pad, pad, e]) == [7, s, pad, e, s, pad, e]
    assert vp.expand(vp.collapse([s, pad, pad, e, 9, s, pad, e]), [2, 1]) == [s, pad, pad, e, 9, s, pad, e]
    with pytest.raises(DataError, match=r"row 2: 3 <\|image_pad\|> token\(s\) in the rendered prompt for 1 image"):
        vp.expand([s, pad, pad, pad, e], [3], where="row 2")  # already expanded: a second expansion
    with pytest.raises(DataError, match=r"0 <\|image_pad\|> token\(s\) in the rendered prompt for 1 image"):
        vp.expand([7, 8], [1])  # the template wrote no marker
    with pytest.raises(DataError, match=r"image 0's <\|image_pad\|> is not alone between"):
        vp.expand([7, pad, e], [1])
    with pytest.raises(DataError, match="prompt image 0: not an image PIL can decode"):
        vp.render(_messages(b"garbage"))
    assert IMAGE_MARKER == "<|vision_start|><|image_pad|><|vision_end|>"


def test_processor_needs_vision_tokens_and_image_config(tiny_model_dir: str) -> None:
    with pytest.raises(ConfigError, match=r"holds no preprocessor_config\.json"):
        VisionProcessor.from_dir(tiny_model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="the tokenizer has no vision tokens"):
        VisionProcessor(tokenizer, image_processor=type("P", (), {"merge_size": 2})())


def test_transformers_forward_and_generation_agree_on_image_prompts(vl_dir: str) -> None:
    from transformers import AutoModelForImageTextToText

    vp = VisionProcessor.from_dir(vl_dir)
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, local_files_only=True).eval()
    prompt = vp.render(_messages(_png((48, 40))))
    ids = torch.tensor([prompt.input_ids])
    image_kwargs = {"pixel_values": prompt.pixel_values_P, "image_grid_thw": prompt.image_grid_thw_I3}
    torch.manual_seed(0)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=torch.tensor([prompt.mm_token_type_ids(vp.image_pad_id)]),
        max_new_tokens=6,
        do_sample=True,
        top_k=0,
        output_logits=True,
        return_dict_in_generate=True,
        **image_kwargs,
    )
    seq = out.sequences
    new = seq[0, ids.shape[1] :]
    gen_lp = torch.stack([torch.log_softmax(step[0], -1)[tok] for step, tok in zip(out.logits, new, strict=True)])
    with torch.no_grad():
        logits = model(input_ids=seq, mm_token_type_ids=(seq == vp.image_pad_id).int(), **image_kwargs).logits
    train_lp = torch.log_softmax(logits[0, ids.shape[1] - 1 : -1], -1).gather(-1, new[:, None])[:, 0]
    torch.testing.assert_close(train_lp, gen_lp, atol=1e-5, rtol=0)
    # The image conditions the output: another image changes the next-token distribution.
    other = vp.render(_messages(_png((48, 40), (0, 0, 250))))
    with torch.no_grad():
        a = model(input_ids=ids, mm_token_type_ids=(ids == vp.image_pad_id).int(), **image_kwargs).logits[0, -1]
        b = model(
            input_ids=ids,
            mm_token_type_ids=(ids == vp.image_pad_id).int(),
            pixel_values=other.pixel_values_P,
            image_grid_thw=other.image_grid_thw_I3,
        ).logits[0, -1]
    assert (a - b).abs().max() > 1e-4


def test_preflight_takes_a_vision_language_policy_and_refuses_what_it_cannot_do(
    vl_dir: str, tiny_model_dir: str
) -> None:
    from posttrain.config.loading import build_config
    from posttrain.preflight import grpo_preflight

    errors = grpo_preflight(build_config(None, [f"model.name_or_path={vl_dir}"])).errors
    assert not any("vision-language" in e for e in errors), errors
    errors = grpo_preflight(build_config(None, [f"model.name_or_path={vl_dir}", "rollout.backend=vllm"])).errors
    assert any(
        f"model.name_or_path={vl_dir} is a vision-language model (qwen3_vl): rollout.backend=vllm cannot sample" in e
        for e in errors
    ), errors
    text_errors = grpo_preflight(build_config(None, [f"model.name_or_path={tiny_model_dir}"])).errors
    assert not any("vision-language" in e for e in text_errors)
