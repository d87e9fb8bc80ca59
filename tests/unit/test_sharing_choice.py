"""``model.share_prompt_prefix=auto``'s choice (policy/shared_prefix.sharing_pays), at the sizes
measured on an H200 and on either side of each threshold."""

from __future__ import annotations

import pytest

from posttrain.policy.shared_prefix import (
    GPU_SHARE_MIN_PROMPT_TO_COMPLETION,
    GPU_SHARE_MIN_PROMPT_TOKENS,
    sharing_pays,
)


@pytest.mark.parametrize(
    ("prompt", "completion", "on_cpu", "on_gpu"),
    [
        (44, 16, True, False),  # the default recipe's batch: shared 0.231 s, plain 0.113 s on an H200
        (256, 16, True, False),  # 0.4B shape, 8 x 8: shared lost (0.242 against 0.173 s)
        (256, 64, True, False),  # 0.4B shape, 32 x 8: shared lost (0.914 against 0.713 s)
        (512, 64, True, True),  # 0.4B shape, 32 x 8: shared won (1.03 against 1.22 s)
        (1024, 64, True, True),  # 0.4B shape, 32 x 8: shared won (1.71 against 2.26 s)
        (1024, 256, True, True),  # 0.4B shape, 32 x 8: shared won (1.84 against 2.78 s)
        (44, 256, False, False),  # workload W: the completions dominate everywhere
        (16, 16, True, False),  # equal lengths: the CPU rule's boundary is inclusive
    ],
)
def test_measured_sizes(prompt: float, completion: float, on_cpu: bool, on_gpu: bool) -> None:
    assert sharing_pays(prompt, completion, on_gpu=False) is on_cpu
    assert sharing_pays(prompt, completion, on_gpu=True) is on_gpu


def test_gpu_needs_both_a_long_prompt_and_a_large_ratio() -> None:
    long = float(GPU_SHARE_MIN_PROMPT_TOKENS)
    ratio = GPU_SHARE_MIN_PROMPT_TO_COMPLETION
    assert sharing_pays(long, long / ratio, on_gpu=True)
    assert not sharing_pays(long - 1, (long - 1) / ratio / 2, on_gpu=True)  # too short, ratio ample
    assert not sharing_pays(4 * long, 4 * long / ratio + 1, on_gpu=True)  # long, ratio just short
    assert sharing_pays(4 * long, 4 * long / ratio, on_gpu=True)
