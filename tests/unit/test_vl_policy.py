"""The training forward of a vision-language policy: image payload slicing, logprobs that agree with
transformers' own sampling on image prompts, micro-batch exactness, the refusals, the frozen vision tower."""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
import torch
from PIL import Image

from posttrain.distributed.cells import take_rows
from posttrain.errors import TrainingError
from posttrain.models.vision import VISION_TOKENS, VisionProcessor
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.images import (
    ImageInputs,
    freeze_vision_tower,
    image_widths,
    multimodal_body_and_head,
    vl_completion_logprobs,
)

N = 2  # completions per prompt


def _png(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class _Rows:
    """A batch-shaped dataclass (``completion_ids`` counts its rows) for ``take_rows``."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    reference: list[torch.Tensor]
    images: ImageInputs | None = None
    group_size: int = N


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str
) -> tuple[object, VisionProcessor, _Rows]:
    """The tiny VL model, its processor, and 2 samples each of 3 prompts (two images, one text-only)
    with the logprobs transformers' ``generate`` reports from its raw logits."""
    from transformers import AutoModelForImageTextToText

    from posttrain.models.tiny import make_tiny_vl_model

    path = make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")), smollm2_tokenizer_dir)
    vp = VisionProcessor.from_dir(path)
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval()
    question = {"type": "text", "text": "How many squares?"}
    prompts = [
        vp.render([{"role": "user", "content": [{"type": "image", "image": _png((64, 32), (200, 0, 0))}, question]}]),
        vp.render([{"role": "user", "content": [{"type": "image", "image": _png((40, 40), (0, 0, 200))}, question]}]),
        vp.render([{"role": "user", "content": "How many squares?"}]),
    ]
    vision_ids = [int(vp.tokenizer.convert_tokens_to_ids(t)) for t in VISION_TOKENS]
    prompt_ids, completion_ids, reference = [], [], []
    for p, prompt in enumerate(prompts):
        ids = torch.tensor([prompt.input_ids])
        extra = {}
        if prompt.pixel_values_P is not None:
            extra = {"pixel_values": prompt.pixel_values_P, "image_grid_thw": prompt.image_grid_thw_I3}
        for s in range(N):
            torch.manual_seed(10 * p + s)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                mm_token_type_ids=(ids == vp.image_pad_id).int(),
                max_new_tokens=6,
                do_sample=True,
                top_k=0,
                suppress_tokens=vision_ids,  # a sampled pad token would break the image alignment
                output_logits=True,
                return_dict_in_generate=True,
                **extra,
            )
            new = out.sequences[0, ids.shape[1] :]
            logps = [torch.log_softmax(step[0].float(), -1)[tok] for step, tok in zip(out.logits, new, strict=True)]
            prompt_ids.append(prompt.input_ids)
            completion_ids.append(new.tolist())
            reference.append(torch.stack(logps))
    images = ImageInputs.repeat([p.pixel_values_P for p in prompts], [p.image_grid_thw_I3 for p in prompts], N)
    return model, vp, _Rows(prompt_ids, completion_ids, reference, images)


def _logprobs(model: object, vp: VisionProcessor, rows: _Rows) -> torch.Tensor:
    batch = build_policy_batch(rows.prompt_ids, rows.completion_ids, pad_id=vp.tokenizer.pad_token_id, device="cpu")
    assert rows.images is not None
    return vl_completion_logprobs(model, batch, rows.images, image_pad_id=vp.image_pad_id, merge_size=vp.merge_size)


def test_trainer_logprobs_match_transformers_sampling_on_image_prompts(
    setup: tuple[object, VisionProcessor, _Rows],
) -> None:
    model, vp, rows = setup
    with torch.no_grad():
        logprobs_BT = _logprobs(model, vp, rows)
    assert logprobs_BT.shape[0] == 3 * N
    for b, ref in enumerate(rows.reference):
        torch.testing.assert_close(logprobs_BT[b, : len(ref)], ref, atol=2e-5, rtol=0)
        assert torch.all(logprobs_BT[b, len(ref) :] == 0)


def test_micro_batches_are_exact_and_take_rows_slices_the_images(setup: tuple[object, VisionProcessor, _Rows]) -> None:
    model, vp, rows = setup
    with torch.no_grad():
        full_BT = _logprobs(model, vp, rows)
        for part in ([0, 5], [3], [4, 1, 2]):
            sub = take_rows(rows, part)
            assert sub.images is not None and rows.images is not None
            assert all(sub.images.pixel_values[j] is rows.images.pixel_values[i] for j, i in enumerate(part))
            sub_BT = _logprobs(model, vp, sub)
            for j, i in enumerate(part):
                n = len(rows.completion_ids[i])
                torch.testing.assert_close(sub_BT[j, :n], full_BT[i, :n], atol=1e-5, rtol=0)


def test_packing_and_misaligned_pads_are_refused(setup: tuple[object, VisionProcessor, _Rows]) -> None:
    model, vp, rows = setup
    assert rows.images is not None
    packed = build_policy_batch(rows.prompt_ids, rows.completion_ids, pad_id=0, device="cpu", pack_capacity=64)
    with pytest.raises(TrainingError, match=r"model\.sequence_packing=true cannot pack image prompts"):
        vl_completion_logprobs(model, packed, rows.images, image_pad_id=vp.image_pad_id, merge_size=vp.merge_size)
    bad = [list(c) for c in rows.completion_ids]
    bad[0] = [vp.image_pad_id, *bad[0]]  # the completion "generated" an image pad
    padded = build_policy_batch(rows.prompt_ids, bad, pad_id=0, device="cpu")
    widths = image_widths(rows.images.grid_thw[0], vp.merge_size)
    with pytest.raises(
        TrainingError, match=rf"row 0 holds {sum(widths) + 1} image pad tokens but its images expand to {sum(widths)}"
    ):
        vl_completion_logprobs(model, padded, rows.images, image_pad_id=vp.image_pad_id, merge_size=vp.merge_size)
    assert widths == [2] and image_widths(rows.images.grid_thw[2], vp.merge_size) == [1]  # 8 and 4 patches / 2**2


def test_vision_tower_trains_unless_frozen(
    setup: tuple[object, VisionProcessor, _Rows], tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str
) -> None:
    from transformers import AutoModelForImageTextToText

    from posttrain.models.tiny import make_tiny_vl_model

    _, vp, rows = setup
    path = make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl_grad")), smollm2_tokenizer_dir)
    for freeze in (False, True):
        model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True)
        visual = model.model.visual
        if freeze:
            assert freeze_vision_tower(model) == sum(p.numel() for p in visual.parameters())
        _logprobs(model, vp, rows).sum().backward()
        grads = [p.grad for p in visual.parameters()]
        if freeze:
            assert all(g is None for g in grads)
        else:
            assert any(g is not None and g.abs().sum() > 0 for g in grads)
        lm = model.model.language_model.layers[0].self_attn.q_proj.weight.grad
        assert lm is not None and lm.abs().sum() > 0


def test_text_model_is_not_a_vision_language_model(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(TrainingError, match="is not a vision-language model with a vision tower"):
        multimodal_body_and_head(model)
