"""On-policy distillation end to end on CPU: tiny students learning from tiny, deliberately peaked
teachers, with the same tokenizer (direct top-k JSD) and with different tokenizers (DPCA).

The teachers are random tiny Llamas whose LM head is scaled up, so each has sharp, context-dependent
preferences a student can move toward within a few steps; the assertions are on the curves the
spec names: ``train/opd_divergence`` falling (direct) and the student-minus-teacher chunk logprob
gap falling (DPCA).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.entrypoints.opd import main as opd_main

STEPS = 8


def _trained_teacher(out: Path, base_dir: str, *, steps: int = 30) -> str:
    """``base_dir``'s tiny model fine-tuned to continue a counting text: a teacher with sharp,
    consistent preferences that differ from the untrained student's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    text = " ".join(["one two three four five six seven eight nine ten"] * 6)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return str(out)


def _bpe_tokenizer_dir(out: Path, smollm2_tokenizer_dir: str) -> str:
    """A small byte-level BPE (different ids and merges from SmolLM2's) with the same chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [f"What is {a} + {b}? Reply with only the number. {a + b}" for a in range(1, 30) for b in range(1, 30)]
    tok.train_from_iterator(corpus + ["the quick brown fox jumps over the lazy dog"] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    fast.chat_template = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir).chat_template
    fast.save_pretrained(str(out))
    return str(out)


def _run(tmp_path: Path, student: str, teacher: str, name: str, *extra: str) -> list[dict[str, float]]:
    overrides = [
        f"model.name_or_path={student}",
        f"rl.teacher.name_or_path={teacher}",
        f"job.output_root={tmp_path}",
        f"job.name={name}",
        "rl.data.arithmetic_max=5",
        f"rl.max_steps={STEPS}",
        "rl.batch_per_replica=16",
        "rl.group_size=4",
        "rollout.max_tokens=8",
        "rl.optimizer.lr=1e-2",
        *extra,
    ]
    assert opd_main(["--config", "opd_direct", "--", *overrides]) == 0
    metrics = next(tmp_path.glob(f"posttrain/opd/{name}/*/metrics.jsonl"))
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _mean(frames: list[dict[str, float]], key: str) -> float:
    return sum(f[key] for f in frames) / len(frames)


@pytest.mark.slow
def test_direct_topk_divergence_falls(tmp_path: Path, tiny_model_dir: str, smollm2_tokenizer_dir: str) -> None:
    teacher = _trained_teacher(tmp_path / "teacher", tiny_model_dir)
    frames = _run(tmp_path, tiny_model_dir, teacher, "direct", "rl.teacher.top_k=4")
    assert len(frames) == STEPS
    first, last = _mean(frames[:2], "train/opd_divergence"), _mean(frames[-2:], "train/opd_divergence")
    assert last < 0.8 * first, (first, last)
    for f in frames:
        assert f["train/opd_teacher_score_success_count"] == 1 and f["train/opd_teacher_score_failure_count"] == 0
        assert f["train/opd_teacher_scored_sequences"] == 16
        assert f["train/opd_teacher_scored_tokens"] > 0


@pytest.mark.slow
def test_cross_tokenizer_dpca_gap_falls(tmp_path: Path, tiny_model_dir: str, smollm2_tokenizer_dir: str) -> None:
    tokenizer = _bpe_tokenizer_dir(tmp_path / "bpe", smollm2_tokenizer_dir)
    from posttrain.models.tiny import make_tiny_model

    teacher = _trained_teacher(tmp_path / "teacher", make_tiny_model(str(tmp_path / "base"), tokenizer, seed=3))
    frames = _run(
        tmp_path,
        tiny_model_dir,
        teacher,
        "dpca",
        "rl.teacher.input_mode=cross_token_text",
        "rl.teacher.signal_mode=dpca",
        "rl.teacher.top_k=0",
        "rl.distillation_mode=advantage",
        "rl.jsd_beta=null",
        "rl.reward=constant",
        # the test's 400-token BPE spells a run of spaces one token per space; SmolLM2 has single tokens
        "rl.teacher.dpca_max_chunk_tokens=64",
    )
    assert len(frames) == STEPS
    gap_first, gap_last = _mean(frames[:2], "train/opd_dpca_chunk_gap"), _mean(frames[-2:], "train/opd_dpca_chunk_gap")
    assert gap_last < gap_first, (gap_first, gap_last)
    for f in frames:
        assert f["train/opd_dpca_coverage"] == 1.0
        assert f["train/opd_dpca_chunk_count"] >= 1
        assert f["train/opd_divergence"] == 0.0
        assert f["train/reward_mean"] == 0.0


@pytest.mark.slow
def test_resume_keeps_the_teacher_and_refuses_a_changed_one(
    tmp_path: Path, tiny_model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [
        f"model.name_or_path={tiny_model_dir}",
        f"rl.teacher.name_or_path={tiny_model_dir}",
        f"job.output_root={tmp_path}",
        "job.name=resume",
        "rl.batch_per_replica=4",
        "rl.group_size=2",
        "rollout.max_tokens=4",
        "rl.save_every=1",
    ]
    assert opd_main(["--config", "opd_direct", "--", *common, "rl.max_steps=1"]) == 0
    capsys.readouterr()
    changed = opd_main(["--config", "opd_direct", "--", *common, "rl.max_steps=2", "rl.resume=auto", "rl.jsd_beta=0.5"])
    err = capsys.readouterr().err
    assert changed == 1 and "teacher changed: jsd_beta 1.0 -> 0.5" in err
    assert opd_main(["--config", "opd_direct", "--", *common, "rl.max_steps=2", "rl.resume=auto"]) == 0
    runs = sorted(tmp_path.glob("posttrain/opd/resume/*/metrics.jsonl"))
    assert [json.loads(line)["step"] for line in runs[-1].read_text().splitlines()] == [1, 2]
