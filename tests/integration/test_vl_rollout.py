"""The transformers engine's sampler on image prompts: seeded, never samples vision tokens, and its
logprobs agree with the training forward's (``policy.images.vl_completion_logprobs``)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from posttrain.models.vision import VISION_TOKENS, VisionProcessor, VisionPrompt
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.images import ImageInputs, vl_completion_logprobs
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf_engine import HFRolloutEngine
from posttrain.rollout.vl_sampling import generate_image_prompts

N = 3


def _png(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def engine_and_prompts(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str
) -> tuple[HFRolloutEngine, VisionProcessor, list[VisionPrompt]]:
    from transformers import AutoModelForImageTextToText

    from posttrain.models.tiny import make_tiny_vl_model

    path = make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")), smollm2_tokenizer_dir)
    vp = VisionProcessor.from_dir(path)
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True)
    q = {"type": "text", "text": "How many squares?"}
    prompts = [
        vp.render([{"role": "user", "content": [{"type": "image", "image": _png((64, 32), (9, 9, 200))}, q]}]),
        vp.render([{"role": "user", "content": "Count to three."}]),
        vp.render(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": _png((40, 40), (200, 9, 9))},
                        {"type": "image", "image": _png((64, 64), (9, 200, 9))},
                        q,
                    ],
                }
            ]
        ),
    ]
    return HFRolloutEngine(model, vp.tokenizer), vp, prompts


def _generate(engine: HFRolloutEngine, vp: VisionProcessor, prompts: list[VisionPrompt], max_tokens: int = 8):
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=5)
    vision = [int(vp.tokenizer.convert_tokens_to_ids(t)) for t in VISION_TOKENS]
    return generate_image_prompts(engine, prompts, N, params, image_pad_id=vp.image_pad_id, vision_token_ids=vision)


def test_engine_and_trainer_logprobs_agree_on_image_prompts(engine_and_prompts) -> None:
    engine, vp, prompts = engine_and_prompts
    rollout = _generate(engine, vp, prompts)
    comps = rollout.completions
    assert [c.prompt_index for c in comps] == [p for p in range(3) for _ in range(N)]
    assert rollout.prompt_token_ids == [p.input_ids for p in prompts]
    vision = {int(vp.tokenizer.convert_tokens_to_ids(t)) for t in VISION_TOKENS}
    assert not any(set(c.token_ids) & vision for c in comps)
    images = ImageInputs.repeat([p.pixel_values_P for p in prompts], [p.image_grid_thw_I3 for p in prompts], N)
    batch = build_policy_batch(
        [rollout.prompt_token_ids[c.prompt_index] for c in comps],
        [c.token_ids for c in comps],
        pad_id=engine.pad_id,
        device="cpu",
    )
    with torch.no_grad():
        logprobs_BT = vl_completion_logprobs(
            engine.model, batch, images, image_pad_id=vp.image_pad_id, merge_size=vp.merge_size
        )
    for b, c in enumerate(comps):
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) > 0
        torch.testing.assert_close(logprobs_BT[b, : len(c.token_ids)], torch.tensor(c.logprobs), atol=2e-5, rtol=0)
    # The samples of one prompt are drawn independently (not copies of one another).
    assert len({tuple(c.token_ids) for c in comps[:N]}) > 1


def test_engine_stream_is_seeded_and_resumable(engine_and_prompts) -> None:
    engine, vp, prompts = engine_and_prompts
    saved = engine.state_dict()
    first = [c.token_ids for c in _generate(engine, vp, prompts[:1], 4).completions]
    second = [c.token_ids for c in _generate(engine, vp, prompts[:1], 4).completions]
    assert first != second  # the call counter moves the stream on
    engine.load_state_dict(saved)
    assert [c.token_ids for c in _generate(engine, vp, prompts[:1], 4).completions] == first
    with pytest.raises(ValueError, match=r"neither rollout\.repetition_penalty nor score centering"):
        generate_image_prompts(
            engine,
            prompts,
            1,
            SamplingParams(max_tokens=2, repetition_penalty=1.1),
            image_pad_id=vp.image_pad_id,
            vision_token_ids=[],
        )
