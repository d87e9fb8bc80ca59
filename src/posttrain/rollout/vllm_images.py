"""Image prompts through a vLLM engine: a vision-language policy (Qwen3-VL) with ``rollout.backend=vllm``.

The processor's rendering (``models/vision.VisionProcessor``) is the reference: it expands each
image's single ``<|image_pad|>`` marker to the width the image grid says. vLLM applies that expansion
itself to a token prompt with ``multi_modal_data``, so the engine is sent the collapsed ids (one pad
per image) with the decoded images in their order, and the prompt vLLM reports back must equal the
processor's expanded ids token for token. A second expansion (vLLM expanding an already expanded
run), a width drift (another resize rule, another merge size) or a different image count would put
the image features at other positions than the trainer's forward does; any of them fails the whole
call by name before a completion is returned (opd.md, "Multimodal teacher/student": boundary checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from posttrain.errors import TrainingError

IMAGE_PAD = "<|image_pad|>"


def multimodal_engine_args(max_images_per_prompt: int) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of an engine that takes up to ``max_images_per_prompt`` images per
    prompt and no video (none for 0: a text engine)."""
    if max_images_per_prompt <= 0:
        return {}
    return {"limit_mm_per_prompt": {"image": max_images_per_prompt, "video": 0}}


def collapse_pads(ids: Sequence[int], pad_id: int) -> list[int]:
    """``ids`` with each run of ``pad_id`` collapsed to one token (the form vLLM expands itself)."""
    out: list[int] = []
    for t in ids:
        if t == pad_id and out and out[-1] == pad_id:
            continue
        out.append(int(t))
    return out


def pad_runs(ids: Sequence[int], pad_id: int) -> list[int]:
    """The length of each run of ``pad_id`` in ``ids``, in order (one per image)."""
    runs: list[int] = []
    previous = None
    for t in ids:
        if t == pad_id:
            if previous == pad_id:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = t
    return runs


BANNED_LOGIT_BIAS = -100.0
"""The most negative bias vLLM accepts: with it a banned token's probability is exp(-100) times
its share, never drawn in practice. The reported logprobs stay the raw distribution's (the engine's
``raw_logprobs`` mode reads the logits before any processor), which is what the trainer computes."""


def ban_tokens(requests: Sequence[Any], token_ids: Sequence[int]) -> None:
    """Give every vLLM sampling request a logit bias that keeps ``token_ids`` from being sampled (a
    sampled ``<|image_pad|>`` would misalign the image features of the training forward)."""
    if not token_ids:
        return
    bias = {int(t): BANNED_LOGIT_BIAS for t in token_ids}
    for request in requests:
        request.logit_bias = dict(bias)


def image_token_prompts(
    expanded_ids: Sequence[Sequence[int]], images: Sequence[Sequence[Any]], owners: Sequence[int], pad_id: int
) -> list[Any]:
    """One vLLM token prompt per request (``TokensPrompt`` is a TypedDict: plain dicts are what vLLM
    reads): the owner prompt's collapsed ids and its images in order."""
    if len(images) != len(expanded_ids):
        raise TrainingError(f"{len(images)} image lists for {len(expanded_ids)} prompts")
    prompts = []
    for p in owners:
        markers = len(pad_runs(expanded_ids[p], pad_id))
        if markers != len(images[p]):
            raise TrainingError(
                f"prompt {p}: {markers} {IMAGE_PAD} run(s) for {len(images[p])} image(s); every submitted image "
                "needs exactly one marker"
            )
        prompt: dict[str, Any] = {"prompt_token_ids": collapse_pads(expanded_ids[p], pad_id)}
        if images[p]:
            prompt["multi_modal_data"] = {"image": list(images[p])}
        prompts.append(prompt)
    return prompts


def check_engine_expansion(
    outputs: Sequence[Any], owners: Sequence[int], expanded_ids: Sequence[Sequence[int]], pad_id: int
) -> None:
    """Refuse the call unless every prompt vLLM ran equals the processor's expanded ids."""
    for request_output, p in zip(outputs, owners, strict=True):
        got, want = list(request_output.prompt_token_ids), list(expanded_ids[p])
        if got == want:
            continue
        got_runs, want_runs = pad_runs(got, pad_id), pad_runs(want, pad_id)
        if len(got_runs) != len(want_runs):
            why = f"{len(got_runs)} image pad run(s) where the processor placed {len(want_runs)}"
        elif got_runs != want_runs:
            why = f"image widths {got_runs} where the processor's grids give {want_runs} (a width drift)"
        else:
            why = "the tokens around the images differ (a boundary drift)"
        raise TrainingError(
            f"vLLM's expanded prompt {p} is not the processor's ({len(got)} tokens against {len(want)}): {why}; "
            "the batch is refused before any completion is used. The engine and the trainer must expand images "
            "with the same processor settings (docs/multimodal.md)"
        )
