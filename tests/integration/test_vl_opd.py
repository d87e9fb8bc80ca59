"""Multimodal OPD end to end through ``posttrain opd`` on a tiny Qwen3-VL pair (CPU, transformers).

The pair is built as ``models/vl_opd_demo.py`` builds the demo's, only smaller: a random tiny
Qwen3-VL teacher (4 text layers) trained for 15 steps on the shape-count answers, and its student,
the teacher cut to its first text layer (same tokenizer, processor, template and placeholders: the
identity ``shared_vocab_multimodal`` binds). The student samples answers to image prompts of the
built-in shape-count task, the teacher renders its own image prefix from the same raw bytes and
returns its top-k at every completion position, and the student minimises the reverse KL:
``train/opd_divergence`` falls over the run (the acceptance, as tests/integration/test_opd_e2e.py
asserts it for text). A run resumed from its
step-2 checkpoint reproduces step 3 of the uninterrupted run, metrics and weights, bitwise. Also: a
``cross_token_multimodal`` DPCA run (a teacher with a tokenizer of its own) and a run under two gloo
policy ranks (``torchrun``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rank_runs import run_two_ranks
from safetensors.torch import load_file

from posttrain.entrypoints.opd import main as opd_main

STEPS = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> Path:
    """``out/teacher``: a random tiny Qwen3-VL trained for a few steps on the true counts (peaked,
    image-conditioned preferences); ``out/student``: its first text layer."""
    from posttrain.models.tiny import make_tiny_vl_model
    from posttrain.models.vl_opd_demo import train_on_counts, truncate_text_layers

    out = tmp_path_factory.mktemp("vl_opd_pair")
    teacher = make_tiny_vl_model(str(out / "teacher"), smollm2_tokenizer_dir, num_layers=4, vision_depth=1)
    train_on_counts(teacher, 15, lr=1e-2).save_pretrained(teacher)
    truncate_text_layers(teacher, str(out / "student"), 1)
    return out


def _overrides(pair: Path, out: Path, name: str, *extra: str) -> list[str]:
    return [
        f"model.name_or_path={pair / 'student'}",
        f"rl.teacher.name_or_path={pair / 'teacher'}",
        "rl.teacher.input_mode=shared_vocab_multimodal",
        f"job.output_root={out}",
        f"job.name={name}",
        "rl.data.factory=posttrain.data.visual:shape_count_rows",
        "rl.reward=arithmetic",
        "rl.batch_per_replica=8",
        "rl.group_size=4",
        "rollout.max_tokens=4",
        "rl.optimizer.lr=3e-3",
        f"rl.max_steps={STEPS}",
        *extra,
    ]


def _run(overrides: list[str]) -> Path:
    assert opd_main(["--", *overrides]) == 0
    job = next(o.split("=", 1)[1] for o in overrides if o.startswith("job.name="))
    root = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("job.output_root=")))
    return sorted((root / "posttrain" / "opd" / job).iterdir())[-1]


def _frames(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"iter_{step:09d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def whole_run(pair: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(_overrides(pair, tmp_path_factory.mktemp("vl_opd_runs"), "whole", "rl.save_every=1"))


def test_multimodal_direct_opd_divergence_falls(pair: Path, whole_run: Path) -> None:
    frames = _frames(whole_run)
    assert [f["step"] for f in frames] == list(range(1, STEPS + 1))
    for f in frames:
        assert f["train/opd_teacher_score_success_count"] == 1.0 and f["train/opd_teacher_score_failure_count"] == 0
        assert f["train/opd_teacher_scored_sequences"] == 8 and f["train/grad_norm"] > 0
    divergence = [f["train/opd_divergence"] for f in frames]
    assert divergence[-1] < 0.5 * divergence[0] and min(divergence) == divergence[-1], divergence
    # the student's vision tower and language model both moved toward the teacher
    before = load_file(str(pair / "student" / "model.safetensors"))
    after = _weights(whole_run, STEPS)
    for prefix in ("model.visual.", "model.language_model."):
        assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith(prefix)), prefix
    state = json.loads((whole_run / "checkpoints" / f"iter_{STEPS:09d}" / "training_state.json").read_text())
    media = state["identity"]["teacher"]["media"]  # the teacher's media identity is in the resume identity
    assert media["videos"] == 0 and set(media) >= {"tokenizer", "processor", "chat_template", "placeholders"}


def test_resumed_multimodal_opd_run_equals_the_uninterrupted_one(pair: Path, whole_run: Path, tmp_path: Path) -> None:
    resume = f"rl.resume={whole_run / 'checkpoints' / 'iter_000000002'}"
    resumed = _run(_overrides(pair, tmp_path, "resumed", resume, "rl.save_every=1"))
    a, b = _frames(whole_run), _frames(resumed)
    assert [f["step"] for f in b] == list(range(1, STEPS + 1))

    def comparable(frame: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in frame.items() if not k.startswith(("timer/", "rollout/", "memory/"))}

    assert [comparable(f) for f in b[2:]] == [comparable(f) for f in a[2:]]
    whole, again = _weights(whole_run, STEPS), _weights(resumed, STEPS)
    assert whole.keys() == again.keys() and all(torch.equal(whole[k], again[k]) for k in whole)


def _bpe_tokenizer(out: Path) -> str:
    """A small byte-level BPE with other ids and merges than SmolLM2's (the teacher's own tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [f"How many squares are in the image? Reply with only the number. {k}" for k in range(1, 6)]
    tok.train_from_iterator(corpus * 20 + ["user assistant system"] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    fast.save_pretrained(str(out))
    return str(out)


def test_cross_token_multimodal_dpca_run(pair: Path, tmp_path: Path) -> None:
    """A teacher with its own tokenizer (and so its own vision-token ids) renders its own image prefix;
    DPCA aligns the decoded completion texts and credits the aligned chunks."""
    from posttrain.models.tiny import make_tiny_vl_model

    teacher = make_tiny_vl_model(str(tmp_path / "teacher"), _bpe_tokenizer(tmp_path / "bpe"), vision_depth=1)
    overrides = _overrides(pair, tmp_path, "dpca", "rl.max_steps=2", "rl.batch_per_replica=4")
    overrides = [o for o in overrides if not o.startswith(("rl.teacher.name_or_path=", "rl.teacher.input_mode="))]
    overrides += [f"rl.teacher.name_or_path={teacher}", "rl.teacher.input_mode=cross_token_multimodal"]
    overrides += ["rl.teacher.signal_mode=dpca", "rl.teacher.top_k=0", "rl.distillation_mode=advantage"]
    overrides += ["rl.jsd_beta=null", "rl.teacher.conditional_think_prefix=<think></think>"]
    frames = _frames(_run(overrides))
    assert [f["step"] for f in frames] == [1, 2]
    for f in frames:
        assert f["train/opd_teacher_score_success_count"] == 1.0 and f["train/opd_divergence"] == 0.0
        assert f["train/opd_dpca_chunk_count"] > 0 and 0.0 < f["train/opd_dpca_coverage"] <= 1.0
        assert f["train/opd_teacher_credit"] != 0.0 and f["train/grad_norm"] > 0


@pytest.mark.slow
def test_multimodal_opd_under_two_gloo_ranks(pair: Path, tmp_path: Path) -> None:
    """The real entrypoint under ``torchrun`` with two policy ranks: each rank samples its data cell's
    image prompts and its own in-process teacher scores them; the metrics cover the whole batch."""
    overrides = _overrides(pair, tmp_path, "two", "rl.max_steps=2", "grid.shapes.policy=[1,2]")
    res = run_two_ranks("posttrain.entrypoints.opd", ["--", *overrides, "grid.collective_timeout_s=60"], timeout_s=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (run_dir,) = (tmp_path / "posttrain" / "opd" / "two").iterdir()
    frames = _frames(run_dir)
    assert [f["step"] for f in frames] == [1, 2]
    for f in frames:  # the two cells' teacher work together: the whole batch of 8 completions
        assert f["train/opd_teacher_scored_sequences"] == 8 and f["train/opd_teacher_score_failure_count"] == 0
        assert f["train/opd_divergence"] > 0 and f["train/grad_norm"] > 0
