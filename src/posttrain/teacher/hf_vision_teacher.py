"""The transformers teacher scorer of a vision-language teacher (Qwen3-VL): forced sequences with images.

It takes ``MediaScoreRequest``s (``teacher/multimodal.py``) as a multimodal serving engine takes a
token prompt with images: each image marker holds one ``<|image_pad|>``, and the engine itself
decodes the ordered raw bytes, runs its own image processor and replaces the first pad after each
``<|vision_start|>`` with as many pads as the image's grid says. The prompt it scored is reported
back (``SequenceScores.prompt_ids``), so the caller can check the expansion against what the
teacher's renderer expected: a request that was already expanded comes back ``W - 1`` pads longer
per image, a processor with other resize rules with another width. This engine also runs that check
itself before its forward (``verify_engine_prompt``): no position is scored on a drifted prompt.

The rows are right-padded, the multimodal body (vision tower, merger, language model) runs over
them with their pixel values, grids and ``mm_token_type_ids`` (``policy.images.image_forward_kwargs``),
and the LM head is applied to the scored positions in chunks, as in ``hf_teacher.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.models.vision import VisionProcessor, decode_image
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.images import ImageInputs, image_forward_kwargs, multimodal_body_and_head
from posttrain.teacher.base import ScoreRequest, SequenceScores, TeacherError
from posttrain.teacher.hf_teacher import HFTeacher, head_scores, split_scores
from posttrain.teacher.multimodal import MediaScoreRequest, verify_engine_prompt


class HFVisionTeacher(HFTeacher):
    """Scores forced sequences with images with a frozen transformers vision-language model; each
    ``SequenceScores`` carries the prompt it was scored on (``prompt_ids``)."""

    def __init__(
        self,
        model: Any,
        processor: VisionProcessor,
        *,
        batch_size: int = 64,
        chunk_tokens: int = 1024,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(
            model, processor.tokenizer, batch_size=batch_size, chunk_tokens=chunk_tokens, max_model_len=max_model_len
        )
        self.processor = processor

    def expand(self, request: ScoreRequest) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        """The engine's view of one request: its prompt with each marker's first pad replaced by the
        image's width (the rest of the sequence as given), and the images' patches and grids."""
        images = request.images if isinstance(request, MediaScoreRequest) else ()
        prompt = list(request.token_ids[: request.score_from])
        if not images:
            return prompt, None, None
        where = request.where if isinstance(request, MediaScoreRequest) else "teacher request"
        pil = [decode_image(data, f"{where} image {k}") for k, data in enumerate(images)]
        out = self.processor.image_processor(images=pil, return_tensors="pt")
        widths = [self.processor.image_width(g) for g in out["image_grid_thw"].tolist()]
        expanded: list[int] = []
        k = 0
        for i, t in enumerate(prompt):
            after_start = i > 0 and prompt[i - 1] == self.processor.vision_start_id
            if t == self.processor.image_pad_id and after_start:
                if k >= len(widths):
                    raise TeacherError(f"{where}: more image markers than the {len(widths)} image(s) sent")
                expanded += [t] * widths[k]
                k += 1
            else:
                expanded.append(t)
        if k != len(widths):
            raise TeacherError(f"{where}: {len(widths)} image(s) sent for {k} image marker(s) in the prompt")
        return expanded, out["pixel_values"], out["image_grid_thw"]

    def _score_batch(self, requests: list[ScoreRequest], top_k: int) -> list[SequenceScores]:
        views = [self.expand(r) for r in requests]
        for r, view in zip(requests, views, strict=True):
            # Before any position is scored (the spec): a drifted prompt would scatter image features
            # into the wrong places; the caller checks the reported prompt again, whatever the engine.
            if isinstance(r, MediaScoreRequest):
                verify_engine_prompt(view[0], r.expected_prompt_ids, r.widths, self.processor.image_pad_id, r.where)
            length = len(view[0]) + len(r.token_ids) - r.score_from  # the image pads count too
            if self.max_model_len is not None and length > self.max_model_len:
                raise TeacherError(
                    f"teacher request of {length} tokens with its images expanded > rl.teacher.max_model_len="
                    f"{self.max_model_len}"
                )
        batch = build_policy_batch(
            [v[0] for v in views],
            [list(r.token_ids[r.score_from :]) for r in requests],
            pad_id=self.pad_id,
            device=self.device,
        )
        images = ImageInputs([v[1] for v in views], [v[2] for v in views])
        body, head = multimodal_body_and_head(self.model)
        kwargs = image_forward_kwargs(
            images, batch, image_pad_id=self.processor.image_pad_id, merge_size=self.processor.merge_size
        )
        hidden = body(input_ids=batch.input_ids_RL, use_cache=False, **kwargs).last_hidden_state
        hidden_NH = hidden.flatten(0, 1)[batch.source_N]
        ids_N = batch.completion_ids_BT[batch.row_N, batch.col_N]
        lp_N, tid_NK, tlp_NK = head_scores(hidden_NH, ids_N, head, top_k=top_k, chunk_tokens=self.chunk_tokens)
        # the prompt each request was scored on goes back with its scores (the caller checks it again)
        return split_scores(requests, lp_N, tid_NK, tlp_NK, top_k=top_k, prompt_ids=[v[0] for v in views])
