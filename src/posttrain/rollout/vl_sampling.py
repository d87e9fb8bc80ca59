"""Sampling from a vision-language policy (Qwen3-VL) with the transformers engine's sampler.

``generate_image_prompts(engine, prompts, n, params)`` is the image-prompt counterpart of
``HFRolloutEngine.generate``: same seeded stream (the engine's call counter), same draw
(``draw_tokens``: inverse CDF, raw tempered logprobs), same ``RolloutBatch``. It takes rendered
``VisionPrompt``s (``posttrain.models.vision``) instead of token ids.

Why a loop of its own: Qwen3-VL places its rotary positions in three dimensions computed from the
prompt's tokens and image grids, and keeps the offset of the text positions after the images
(``rope_deltas``, one per batch row) inside the model between the prefill and the decode steps. The
text engine's left-padded prefill, explicit 1-D position ids and shrinking batch would all break
that. Here each prompt is decoded on its own as ``n`` identical rows (no padding, so no attention
mask is needed, and rows never leave the batch, so the model's per-row offsets stay aligned);
finished rows keep decoding and their tokens are dropped.

The vision special tokens are never sampled (their scores are set to -inf before the draw): a
sampled ``<|image_pad|>`` would misalign the image features in the training forward. The logprobs
reported stay those of the raw distribution, which is what the trainer computes (the masked tokens
carry negligible mass in any trained model).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from posttrain.errors import PosttrainError
from posttrain.rollout.base import RolloutBatch, SamplingParams, check_generate_inputs
from posttrain.rollout.hf_engine import HFRolloutEngine, _Sampled, call_seed, draw_tokens

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from posttrain.data.base import ChatMessages
    from posttrain.models.vision import VisionProcessor, VisionPrompt


def _image_kwargs(prompt: VisionPrompt, n: int, pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    if prompt.pixel_values_P is None or prompt.image_grid_thw_I3 is None:
        return {}
    ids = torch.tensor(prompt.input_ids, device=device)
    return {
        "pixel_values": prompt.pixel_values_P.to(device).repeat(n, 1),
        "image_grid_thw": prompt.image_grid_thw_I3.to(device).repeat(n, 1),
        "mm_token_type_ids": (ids == pad_id).int()[None].expand(n, -1),
    }


def _decode_prompt(
    engine: HFRolloutEngine,
    prompt: VisionPrompt,
    n: int,
    params: SamplingParams,
    *,
    generator: torch.Generator,
    banned: torch.Tensor,
    image_pad_id: int,
) -> list[_Sampled]:
    from transformers import DynamicCache

    model = engine.model
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    ids_NL = torch.tensor([prompt.input_ids], device=device).expand(n, -1)
    kwargs = _image_kwargs(prompt, n, image_pad_id, device)
    out = model(input_ids=ids_NL, past_key_values=cache, use_cache=True, logits_to_keep=1, **kwargs)
    eos_E = torch.tensor(engine.eos_ids, device=device)
    tokens_NT = torch.full((n, params.max_tokens), -1, dtype=torch.long, device=device)
    logprobs_NT = torch.zeros((n, params.max_tokens), device=device)
    done_N = torch.zeros(n, dtype=torch.bool, device=device)
    stopped_N = torch.zeros(n, dtype=torch.bool, device=device)
    for step in range(params.max_tokens):
        raw_NV = out.logits[:, -1, :].float()
        next_N, _ = draw_tokens(raw_NV.index_fill(-1, banned, float("-inf")), params, generator)
        temperature = params.temperature if params.temperature > 0 else 1.0
        raw_lp_N = torch.log_softmax(raw_NV / temperature, dim=-1).gather(-1, next_N[:, None])[:, 0]
        tokens_NT[~done_N, step] = next_N[~done_N]
        logprobs_NT[~done_N, step] = raw_lp_N[~done_N]
        is_eos_N = torch.isin(next_N, eos_E) & ~done_N
        stopped_N |= is_eos_N
        done_N |= is_eos_N
        if step + 1 == params.max_tokens or bool(done_N.all()):
            break
        out = model(input_ids=next_N[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
    lengths = (tokens_NT >= 0).sum(-1).tolist()
    tokens, logprobs, stopped = tokens_NT.tolist(), logprobs_NT.tolist(), stopped_N.tolist()
    return [_Sampled(tokens[i][: lengths[i]], logprobs[i][: lengths[i]], stopped[i], {}) for i in range(n)]


def generate_image_prompts(
    engine: HFRolloutEngine,
    prompts: list[VisionPrompt],
    n: int,
    params: SamplingParams,
    *,
    image_pad_id: int,
    vision_token_ids: list[int],
) -> RolloutBatch:
    """``n`` completions per rendered prompt, grouped by prompt, from ``engine``'s model and stream.

    Top-k / top-p and temperature act as in the text engine; the repetition penalty and the sampler's
    top-k head (score centering) are refused.
    """
    if params.repetition_penalty != 1.0 or params.logprobs_topk > 0:
        raise ValueError("image prompts support neither rollout.repetition_penalty nor score centering yet")
    engine.state.check_usable()
    check_generate_inputs([p.input_ids for p in prompts], n, params)
    call_index = engine.state.next_call()
    device = next(engine.model.parameters()).device
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(call_seed(params.seed, call_index))
    banned = torch.tensor(vision_token_ids, dtype=torch.long, device=device)
    start = time.perf_counter()
    was_training = engine.model.training
    engine.model.eval()
    try:
        with torch.inference_mode(), engine._compute():
            results = [
                sampled
                for prompt in prompts
                for sampled in _decode_prompt(
                    engine, prompt, n, params, generator=generator, banned=banned, image_pad_id=image_pad_id
                )
            ]
    finally:
        engine.model.train(was_training)
    return engine._package([p.input_ids for p in prompts], n, results, time.perf_counter() - start)


class ImagePromptSampler:
    """What a run's loop uses to sample a vision-language policy: renders each prompt with the
    policy's ``VisionProcessor`` (``model.chat_template_kwargs`` applied; a string prompt is one user
    message) and samples it with the transformers engine through ``generate_image_prompts``."""

    def __init__(self, processor: VisionProcessor, template_kwargs: Mapping[str, object] | None = None) -> None:
        self.processor = processor
        self.template_kwargs = dict(template_kwargs or {})
        self.vision_token_ids = [
            processor.vision_start_id,
            processor.vision_end_id,
            processor.image_pad_id,
            processor.video_pad_id,
        ]
        self.image_pad_id = processor.image_pad_id
        self.merge_size = processor.merge_size

    def render(self, prompt: str | ChatMessages, where: str = "prompt") -> VisionPrompt:
        """One prompt's token ids (image pads expanded), pixel values and image grids."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.processor.render(messages, where=where, template_kwargs=self.template_kwargs)

    def generate(self, engine: object, prompts: Sequence[VisionPrompt], n: int, params: SamplingParams) -> RolloutBatch:
        """``n`` completions per rendered prompt from ``engine``: the transformers engine through
        ``generate_image_prompts``; a vLLM engine built for images gets the decoded images and runs
        its own processor, its expansion checked against ours (``rollout/vllm_images.py``)."""
        if getattr(engine, "image_pad_id", None) is not None:  # a VLLMRolloutEngine built for images
            if params.repetition_penalty != 1.0 or params.logprobs_topk > 0:
                raise ValueError("image prompts support neither rollout.repetition_penalty nor score centering yet")
            vllm_engine: Any = engine
            batch: RolloutBatch = vllm_engine.generate(
                [p.input_ids for p in prompts],
                n,
                params,
                images=[list(p.images) for p in prompts],
                banned_token_ids=self.vision_token_ids,
            )
            return batch
        if not isinstance(engine, HFRolloutEngine):
            raise PosttrainError(
                f"the {type(engine).__name__} rollout engine does not take image prompts; a vision-language "
                "policy samples with rollout.backend=hf, or vllm where torchvision is installed (docs/multimodal.md)"
            )
        return generate_image_prompts(
            engine,
            list(prompts),
            n,
            params,
            image_pad_id=self.image_pad_id,
            vision_token_ids=self.vision_token_ids,
        )
