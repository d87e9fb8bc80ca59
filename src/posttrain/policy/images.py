"""Images in the training forward of a vision-language policy (Qwen3-VL): the payload and the logprobs.

``ImageInputs`` is the ``TrainBatch`` payload of the image path: per completion, its prompt's
flattened patches ``[P, D]`` and patch grids ``[I, 3]`` (``posttrain.models.vision.VisionPrompt``),
None for a text-only prompt. The ``n`` completions of one prompt hold the same tensors (no copy), and
``distributed.cells.take_rows`` slices the payload with the batch like every other one.

``vl_completion_logprobs`` is ``policy.logprobs.completion_logprobs`` for such a model: the
multimodal body (``model.model``: vision tower, merger, language model) runs once over the padded
micro-batch with the rows' pixel values, grids and ``mm_token_type_ids`` (from which the model places
its multimodal rotary positions), and the LM head is applied to the completion positions in chunks.
Every row's image pads are counted against its grids first: a row whose pad run does not match its
images (a completion that generated a pad token, a prompt expanded twice) fails by name instead of
scattering image features into the wrong places.

What stays exact and what is refused (the caller's preflight enforces it; docs/multimodal.md):

* micro-batching: exact. Each row carries its own images, and a row's logprobs depend only on its
  own tokens and images (right padding, causal attention), whatever else shares the micro-batch.
* sequence packing (``model.sequence_packing``): refused (``PACKING_REFUSAL``). Qwen3-VL computes
  its 3-D positions per input row from the row's tokens; restarting position ids cannot express
  several image-bearing sequences in one row.
* the shared-prompt forward (``policy/shared_prefix.py``): refused (``SHARED_PROMPT_REFUSAL``). It
  runs the prompt once and the completions against its KV cache with 1-D positions; the image
  features and 3-D positions of the prompt would have to travel with that cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.errors import TrainingError
from posttrain.policy.batching import PolicyBatch
from posttrain.policy.logprobs import chunked_head_logprobs

PACKING_REFUSAL = (
    "model.sequence_packing=true cannot pack image prompts: Qwen3-VL places its multimodal rotary "
    "positions per input row; set model.sequence_packing=false for vision-language runs"
)
SHARED_PROMPT_REFUSAL = (
    "the shared-prompt forward runs a prompt once and its completions against the prompt's cache with "
    "text positions, which loses the prompt's image positions; turn it off for vision-language runs"
)


@dataclass(frozen=True)
class ImageInputs:
    """Per completion, its prompt's image patches ``[P, D]`` and grids ``[I, 3]`` (None: no image)."""

    pixel_values: list[Tensor | None]
    grid_thw: list[Tensor | None]

    @classmethod
    def repeat(cls, pixel_values: list[Tensor | None], grid_thw: list[Tensor | None], n: int) -> ImageInputs:
        """The payload of ``n`` completions per prompt, grouped by prompt (the rollout's order)."""
        return cls([p for p in pixel_values for _ in range(n)], [g for g in grid_thw for _ in range(n)])


def image_widths(grid_thw: Tensor | None, merge_size: int) -> list[int]:
    """Pad tokens per image of a prompt: ``t * h * w / merge_size**2`` for each grid row."""
    if grid_thw is None:
        return []
    return [int(v) // (merge_size**2) for v in grid_thw.prod(dim=-1).tolist()]


def image_forward_kwargs(
    images: ImageInputs, batch: PolicyBatch, *, image_pad_id: int, merge_size: int
) -> dict[str, Tensor]:
    """The image arguments of the multimodal body for ``batch`` (padded, row ``b`` = ``images`` row ``b``)."""
    if batch.position_ids_RL is not None:
        raise TrainingError(PACKING_REFUSAL)
    rows = batch.input_ids_RL.shape[0]
    if len(images.pixel_values) != rows or len(images.grid_thw) != rows:
        raise TrainingError(f"the micro-batch has {rows} rows but image inputs for {len(images.pixel_values)}")
    is_pad_RL = batch.input_ids_RL == image_pad_id
    pads_R = is_pad_RL.sum(dim=1).tolist()
    for b in range(rows):
        expected = sum(image_widths(images.grid_thw[b], merge_size))
        if pads_R[b] != expected:
            raise TrainingError(
                f"row {b} holds {pads_R[b]} image pad tokens but its images expand to {expected}; a completion "
                "that generated the image pad token, or a prompt expanded twice, cannot be scored"
            )
    chosen = [b for b in range(rows) if images.grid_thw[b] is not None]
    if not chosen:
        return {}
    device = batch.input_ids_RL.device
    return {
        # The model scatters image features into the pad positions in row-major order: row by row,
        # each row's images in prompt order, which is the order they are concatenated in here.
        "pixel_values": torch.cat([_tensor(images.pixel_values[b]) for b in chosen]).to(device),
        "image_grid_thw": torch.cat([_tensor(images.grid_thw[b]) for b in chosen]).to(device),
        "mm_token_type_ids": is_pad_RL.int(),
    }


def _tensor(value: Tensor | None) -> Tensor:
    assert value is not None
    return value


def multimodal_body_and_head(model: Any) -> tuple[nn.Module, nn.Module]:
    """The multimodal body (vision tower + language model, returns hidden states) and the LM head."""
    body = getattr(model, "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if body is None or head is None or not hasattr(body, "visual"):
        raise TrainingError(
            f"{type(model).__name__} is not a vision-language model with a vision tower (model.model.visual)"
        )
    return body, head


def freeze_vision_tower(model: Any) -> int:
    """Stop gradients into the vision tower and its merger (``model.model.visual``); returns how many
    parameters were frozen. The language model and the LM head still train."""
    body, _ = multimodal_body_and_head(model)
    visual: nn.Module = getattr(body, "visual")  # noqa: B009  # nn.Module.__getattr__ is typed as Tensor | Module
    frozen = 0
    for param in visual.parameters():
        param.requires_grad_(False)
        frozen += param.numel()
    return frozen


def vl_completion_logprobs(
    model: Any,
    batch: PolicyBatch,
    images: ImageInputs,
    *,
    image_pad_id: int,
    merge_size: int,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> Tensor:
    """``logprobs_BT[b, t] = log p(completion token t of row b | its prompt, its images, the tokens before)``,
    from ``logits / temperature`` in fp32, 0 where ``completion_mask_BT`` is 0."""
    out_NJ = _vl_head_logprobs(
        model,
        batch,
        images,
        None,
        image_pad_id=image_pad_id,
        merge_size=merge_size,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
    )
    rows, width = batch.completion_ids_BT.shape
    return out_NJ.new_zeros((rows, width)).index_put((batch.row_N, batch.col_N), out_NJ[:, 0])


def vl_completion_logprobs_at(
    model: Any,
    batch: PolicyBatch,
    images: ImageInputs,
    head_ids_BTK: Tensor,
    *,
    image_pad_id: int,
    merge_size: int,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[Tensor, Tensor]:
    """``vl_completion_logprobs`` plus the logprobs at ``head_ids_BTK`` (an OPD teacher's top-k ids)
    from the same forward: the chunked LM head gathers K + 1 columns per token, as on the text path."""
    out_NJ = _vl_head_logprobs(
        model,
        batch,
        images,
        head_ids_BTK,
        image_pad_id=image_pad_id,
        merge_size=merge_size,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
    )
    rows, width = batch.completion_ids_BT.shape
    b_N, t_N = batch.row_N, batch.col_N
    logprobs_BT = out_NJ.new_zeros((rows, width)).index_put((b_N, t_N), out_NJ[:, 0])
    head_BTK = out_NJ.new_zeros((rows, width, out_NJ.shape[1] - 1)).index_put((b_N, t_N), out_NJ[:, 1:])
    return logprobs_BT, head_BTK


def _vl_head_logprobs(
    model: Any,
    batch: PolicyBatch,
    images: ImageInputs,
    head_ids_BTK: Tensor | None,
    *,
    image_pad_id: int,
    merge_size: int,
    temperature: float,
    chunk_tokens: int,
) -> Tensor:
    """``out_NJ``: per completion token, its own logprob (column 0) and those at ``head_ids_BTK``."""
    if temperature <= 0:
        raise ValueError(f"rl.temperature must be > 0, got {temperature}")
    body, head = multimodal_body_and_head(model)
    kwargs = image_forward_kwargs(images, batch, image_pad_id=image_pad_id, merge_size=merge_size)
    out = body(input_ids=batch.input_ids_RL, use_cache=False, **kwargs)
    hidden_NH = out.last_hidden_state.flatten(0, 1)[batch.source_N]
    b_N, t_N = batch.row_N, batch.col_N
    ids_NJ = batch.completion_ids_BT[b_N, t_N].unsqueeze(-1)
    if head_ids_BTK is not None:
        ids_NJ = torch.cat([ids_NJ, head_ids_BTK[b_N, t_N].long()], dim=-1)
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return chunked_head_logprobs(
        hidden_NH, ids_NJ, head, temperature=temperature, softcap=softcap, chunk_tokens=chunk_tokens
    )


def row_images(images: ImageInputs | None, rows: list[int]) -> ImageInputs | None:
    """The payload of ``rows`` of a batch (None when the batch carries no images)."""
    if images is None:
        return None
    return ImageInputs([images.pixel_values[i] for i in rows], [images.grid_thw[i] for i in rows])


def image_layout(model: Any) -> tuple[int, int]:
    """``(image pad token id, spatial merge size)`` of a Qwen3-VL model, from its config."""
    config = getattr(model, "config", None)
    pad = getattr(config, "image_token_id", None)
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    if pad is None or merge is None:
        raise TrainingError(f"{type(model).__name__} has no image_token_id / vision_config.spatial_merge_size")
    return int(pad), int(merge)
