"""Prompts longer than the context leaves for ``rollout.max_tokens``: refused by sample, before sampling.

The preflight counts file and dataset rows, and now the arithmetic generator's longest question (a
long ``rl.data.system_prompt`` used to pass unchecked: a transformers engine then sampled past the
model's positions without a word). The run checks every rendered prompt against the loaded model's
context, or vLLM's smaller ``rollout.max_model_len``, for what the preflight cannot count: factory
rows, a model not yet on disk, evaluation prompts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from posttrain.config.loading import build_config
from posttrain.data.base import PromptSample
from posttrain.data.prompt_length import PromptBudget, positions_in, prompt_budget
from posttrain.data.rows import check_rows
from posttrain.errors import DataError
from posttrain.loop.collect import check_prompt_lengths

CONTEXT = 8192  # max_position_embeddings in the SmolLM2 fixture's config.json


def _rollout(*overrides: str) -> Any:
    return build_config(None, list(overrides)).rollout


def test_the_budget_is_the_smaller_of_the_model_and_engine_contexts() -> None:
    own = prompt_budget(positions_in({"max_position_embeddings": 100}), _rollout("rollout.max_tokens=10"))
    assert own is not None and own.limit == 90
    assert "the model's context (max_position_embeddings=100) minus rollout.max_tokens=10 leaves 90" in own.describe(95)
    vllm = ("rollout.backend=vllm", "rollout.max_tokens=10")
    engine = prompt_budget(100, _rollout(*vllm, "rollout.max_model_len=50"))
    assert engine is not None and engine.limit == 40
    assert "the engine's context (rollout.max_model_len=50) minus rollout.max_tokens=10 leaves 40" in engine.describe(
        45
    )
    wider = prompt_budget(100, _rollout(*vllm, "rollout.max_model_len=200"))  # vLLM refuses a longer one itself
    assert wider is not None and wider.limit == 90
    hf = prompt_budget(100, _rollout("rollout.backend=hf", "rollout.max_tokens=10", "rollout.max_model_len=50"))
    assert hf is not None and hf.limit == 90  # the transformers engine does not read max_model_len
    multimodal = prompt_budget(
        positions_in({"text_config": {"max_position_embeddings": 64}}), _rollout("rollout.max_tokens=4")
    )
    assert multimodal is not None and multimodal.limit == 60
    assert prompt_budget(positions_in({"hidden_size": 8}), _rollout("rollout.max_tokens=10")) is None
    only_engine = prompt_budget(None, _rollout(*vllm, "rollout.max_model_len=30"))
    assert only_engine is not None and only_engine.limit == 20


def test_the_preflight_holds_rows_to_a_smaller_vllm_context(tmp_path: Path, model_dir: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"prompt": "word " * 300, "answer": 1}) + "\n" + json.dumps({"prompt": "hi", "answer": 2}) + "\n"
    )
    base = [f"rl.data.path={rows}", f"model.name_or_path={model_dir}", "rollout.max_tokens=16"]
    assert check_rows(build_config(None, base)) == []  # within the model's 8,192 positions
    problems = check_rows(build_config(None, [*base, "rollout.backend=vllm", "rollout.max_model_len=256"]))
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{rows} line 1 (sample rows.jsonl:1): the prompt is "), problems[0]
    assert "the engine's context (rollout.max_model_len=256) minus rollout.max_tokens=16 leaves 240" in problems[0]


def test_a_rendered_prompt_over_the_budget_is_refused_by_sample() -> None:
    budget = PromptBudget(max_positions=20, max_tokens=4)
    prompts = [PromptSample("a", uid="rows.jsonl:1"), PromptSample("b", uid="rows.jsonl:2")]
    check_prompt_lengths(budget, prompts, [[1] * 16, [2] * 3])  # exactly the limit fits
    check_prompt_lengths(None, prompts, [[1] * 500, [2] * 500])  # no known context: nothing to check
    with pytest.raises(DataError) as info:
        check_prompt_lengths(budget, prompts, [[1] * 3, [2] * 17])
    assert str(info.value) == (
        "sample rows.jsonl:2: the prompt is 17 tokens, but the model's context (max_position_embeddings=20) "
        "minus rollout.max_tokens=4 leaves 16 for it; shorten or drop the row, or lower rollout.max_tokens"
    )


@pytest.mark.parametrize(("bounds", "operand"), [((1, 20), "20"), ((-100, 5), "-100")])
def test_the_preflight_counts_the_arithmetic_generators_longest_question(
    model_dir: Path, smollm2_tokenizer_dir: str, bounds: tuple[int, int], operand: str
) -> None:
    from transformers import AutoTokenizer

    from posttrain.models.chat import render_prompt_ids

    base = [
        f"model.name_or_path={model_dir}",
        "rollout.max_tokens=8000",
        f"rl.data.arithmetic_min={bounds[0]}",
        f"rl.data.arithmetic_max={bounds[1]}",
        "rl.data.arithmetic_ops=[+,-]",
    ]
    assert check_rows(build_config(None, base)) == []  # the default questions fit
    system = "Read the problem carefully. " * 60
    problems = check_rows(build_config(None, [*base, f"rl.data.system_prompt='{system}'"]))
    assert len(problems) == 1, problems
    found = re.fullmatch(
        r"rl\.data \(the arithmetic generator's longest question\) \(sample arith:longest\): the prompt is (\d+) "
        rf"tokens, but the model's context \(max_position_embeddings={CONTEXT}\) minus rollout\.max_tokens=8000 "
        r"leaves 192 for it; shorten rl\.data\.system_prompt or arithmetic_template, or lower rollout\.max_tokens",
        problems[0],
    )
    assert found, problems[0]
    # The count is the loop's own rendering of the longest question (both operands the widest one).
    question = f"What is {operand} + {operand}? Reply with only the number."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    ids = render_prompt_ids(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir), messages, use_chat_template=True)
    assert int(found.group(1)) == len(ids)


@pytest.mark.parametrize("template", ["{op:d} {a} {b}", "{a:>100000000} + {b}", "{a:{b}}", "{"])
def test_a_template_the_generator_cannot_fill_is_left_to_its_own_check(model_dir: Path, template: str) -> None:
    from posttrain.preflight.grpo import grpo_preflight

    overrides = [
        f"model.name_or_path={model_dir}",
        "rl.data.system_prompt=Be brief.",
        f"rl.data.arithmetic_template='{template}'",
    ]
    cfg = build_config(None, overrides)
    assert check_rows(cfg) == []  # not formatted here (a width of 1e8 would build a 100 MB string)
    errors = grpo_preflight(cfg).errors
    assert len([e for e in errors if e.startswith("rl.data.arithmetic_template")]) == 1, errors
