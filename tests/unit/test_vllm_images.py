"""Image prompts for a vLLM engine (``rollout/vllm_images.py``): the collapsed form vLLM is sent, and
the check of vLLM's own expansion against the processor's, which refuses a doubled expansion, a
width drift, a lost image and a boundary drift by name. vLLM's CPU build cannot serve Qwen3-VL here
(no torchvision), so the outputs checked are built in the test as vLLM would report each case; the
real engine's expansion is checked by ``tests/gpu/test_vl_vllm_gpu.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from posttrain.errors import TrainingError
from posttrain.rollout.vllm_images import (
    check_engine_expansion,
    collapse_pads,
    image_token_prompts,
    multimodal_engine_args,
    pad_runs,
)

PAD, START, END = 9, 7, 8
# "a <start> pad x4 <end> b <start> pad x2 <end> c": two images of widths 4 and 2
EXPANDED = [1, START, *[PAD] * 4, END, 2, START, *[PAD] * 2, END, 3]


def _out(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=ids)


def test_runs_and_collapse_by_hand() -> None:
    assert pad_runs(EXPANDED, PAD) == [4, 2]
    assert collapse_pads(EXPANDED, PAD) == [1, START, PAD, END, 2, START, PAD, END, 3]
    assert pad_runs([PAD, PAD, 1, PAD], PAD) == [2, 1]
    assert pad_runs([1, 2], PAD) == [] and collapse_pads([1, 2], PAD) == [1, 2]


def test_engine_args_only_for_an_image_engine() -> None:
    assert multimodal_engine_args(0) == {}
    assert multimodal_engine_args(3) == {"limit_mm_per_prompt": {"image": 3, "video": 0}}


def test_the_processors_expansion_passes() -> None:
    check_engine_expansion([_out(list(EXPANDED)), _out([5, 6])], [0, 1], [EXPANDED, [5, 6]], PAD)


@pytest.mark.parametrize(
    ("engine_ids", "why"),
    [
        # vLLM expanded an already expanded run again: each of the 4 pads became 4
        ([1, START, *[PAD] * 16, END, 2, START, *[PAD] * 4, END, 3], r"image widths \[16, 4\] where .* \[4, 2\]"),
        ([1, START, *[PAD] * 6, END, 2, START, *[PAD] * 2, END, 3], r"image widths \[6, 2\] .* \(a width drift\)"),
        ([1, START, *[PAD] * 4, END, 2, 3], r"1 image pad run\(s\) where the processor placed 2"),
        ([1, START, *[PAD] * 4, END, 2, START, *[PAD] * 2, END, 3, 3], r"\(a boundary drift\)"),
    ],
)
def test_each_drift_refuses_the_batch_by_name(engine_ids: list[int], why: str) -> None:
    with pytest.raises(TrainingError, match=r"vLLM's expanded prompt 0 is not the processor's") as err:
        check_engine_expansion([_out(engine_ids)], [0], [EXPANDED], PAD)
    assert err.match(why)


def test_the_second_prompt_is_named() -> None:
    with pytest.raises(TrainingError, match="expanded prompt 1 is not"):
        check_engine_expansion([_out([5, 6]), _out([5, 6, PAD])], [0, 1], [[5, 6], [5, 6]], PAD)


def test_requests_carry_collapsed_ids_and_images_in_order() -> None:
    images = [["img-a", "img-b"], []]
    prompts = image_token_prompts([EXPANDED, [5, 6]], images, [0, 0, 1], PAD)
    assert [p["prompt_token_ids"] for p in prompts] == [collapse_pads(EXPANDED, PAD)] * 2 + [[5, 6]]
    assert prompts[0]["multi_modal_data"] == {"image": ["img-a", "img-b"]} and "multi_modal_data" not in prompts[2]
    with pytest.raises(TrainingError, match=r"prompt 0: 2 <\|image_pad\|> run\(s\) for 1 image\(s\)"):
        image_token_prompts([EXPANDED], [["only-one"]], [0], PAD)
