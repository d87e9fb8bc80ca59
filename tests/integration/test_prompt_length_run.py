"""A run refuses, by sample and before sampling, a prompt longer than the model's context leaves for
``rollout.max_tokens`` in rows the preflight cannot count (a factory's); it used to sample past the
model's positions on the transformers engine without a word."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess


def test_a_factory_prompt_over_the_context_stops_the_run_by_sample(
    tmp_path: Path,
    tiny_model_dir: str,
    subprocess_run_overrides: Callable[..., list[str]],
    grpo_cli: Callable[..., CompletedProcess[str]],
) -> None:
    overrides = subprocess_run_overrides(
        tiny_model_dir,
        tmp_path,
        "too_long",
        "rl.data.factory=e2e_data:long_prompt_rows",
        "rl.data.shuffle=false",
        "rl.max_steps=2",
    )
    result = grpo_cli(overrides)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    from transformers import AutoTokenizer

    from posttrain.models.chat import render_prompt_ids

    tokens = len(
        render_prompt_ids(AutoTokenizer.from_pretrained(tiny_model_dir), "word " * 4500, use_chat_template=True)
    )
    assert (
        f"error: sample e2e_data:long_prompt_rows:0: the prompt is {tokens} tokens, but the model's context "
        "(max_position_embeddings=4096) minus rollout.max_tokens=12 leaves 4084 for it"
    ) in result.stderr, result.stderr[-3000:]
    assert not list(tmp_path.rglob("checkpoints/step_*")), "no step was trained"
