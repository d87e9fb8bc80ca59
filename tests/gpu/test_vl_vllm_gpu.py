"""vLLM (GPU build) on a tiny random Qwen3-VL: does it serve the model, expand the image placeholders
to the widths ``VisionProcessor`` computes, and report the trainer's logprobs on image prompts?

Unrun when written: the CPU machine's vLLM build cannot load Qwen3-VL (no torchvision; see
docs/multimodal.md). Run it in a pytest process of its own on the device machine:
``pytest -m gpu tests/gpu/test_vl_vllm_gpu.py``. It answers whether item 4 of issue 20 (a vLLM
engine with multimodal requests) can build on vLLM 0.24, and with which tolerance.
"""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from posttrain.models.vision import VISION_TOKENS, VisionProcessor
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.images import ImageInputs, vl_completion_logprobs

pytestmark = pytest.mark.gpu

MEAN_GAP_TOL = 0.1  # bf16 on both sides, different kernels (as tests/gpu/test_vllm_gpu.py)


def _image(size: tuple[int, int], colour: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", size, colour)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_vllm_serves_tiny_qwen3_vl_with_the_trainers_logprobs(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str
) -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (see docs/vllm.md)")
    from transformers import AutoModelForImageTextToText

    from posttrain.models.tiny import make_tiny_vl_model

    # Vision heads of 32 (vLLM's attention kernels refuse smaller heads).
    path = make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")), smollm2_tokenizer_dir, vision_hidden_size=64)
    vp = VisionProcessor.from_dir(path)
    images = [_image((64, 32), (200, 10, 10)), _image((40, 40), (10, 10, 200))]
    rendered = [
        vp.render([{"role": "user", "content": [{"type": "image", "image": _png(img)}, {"type": "text", "text": "?"}]}])
        for img in images
    ]
    llm = vllm.LLM(model=path, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=512)
    vision = [int(vp.tokenizer.convert_tokens_to_ids(t)) for t in VISION_TOKENS]
    params = vllm.SamplingParams(max_tokens=16, temperature=1.0, seed=0, logprobs=0, n=4)
    requests = [
        # vLLM re-applies the placeholder expansion to token prompts: give it one pad per image.
        {"prompt_token_ids": vp.collapse(r.input_ids), "multi_modal_data": {"image": img}}
        for r, img in zip(rendered, images, strict=True)
    ]
    outputs = llm.generate(requests, params)
    prompt_ids, completion_ids, engine_logprobs = [], [], []
    for r, out in zip(rendered, outputs, strict=True):
        # The engine's expanded prompt must equal ours token for token (no second expansion, no drift).
        assert list(out.prompt_token_ids) == r.input_ids
        for c in out.outputs:
            if set(c.token_ids) & set(vision):
                pytest.skip("vLLM sampled a vision token (posttrain's own sampler bans them)")
            prompt_ids.append(r.input_ids)
            completion_ids.append(list(c.token_ids))
            engine_logprobs.append(torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).cuda()
    payload = ImageInputs.repeat([r.pixel_values_P for r in rendered], [r.image_grid_thw_I3 for r in rendered], 4)
    batch = build_policy_batch(prompt_ids, completion_ids, pad_id=vp.tokenizer.pad_token_id, device="cuda")
    with torch.no_grad():
        trainer_BT = vl_completion_logprobs(
            model, batch, payload, image_pad_id=vp.image_pad_id, merge_size=vp.merge_size
        ).cpu()
    gaps = torch.cat([(trainer_BT[b, : len(lp)] - lp).abs() for b, lp in enumerate(engine_logprobs)])
    assert float(gaps.mean()) < MEAN_GAP_TOL, f"mean gap {float(gaps.mean()):.3g}"
