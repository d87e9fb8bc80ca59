"""The teacher role: HF scoring against a plain full-vocabulary forward, all-or-nothing retries and
their counters, the cross-tokenizer prompt rendering, and the advantage-mode credit."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from posttrain.config.opd import OPDConfig
from posttrain.data.base import PromptSample
from posttrain.loop.collect import Collected
from posttrain.loop.opd import opd_train_batch
from posttrain.rollout.base import Completion, RolloutBatch
from posttrain.teacher.base import ScoreRequest, SequenceScores, TeacherError
from posttrain.teacher.hf_teacher import HFTeacher
from posttrain.teacher.render import render_teacher_prefix
from posttrain.teacher.scoring import TeacherSignal, TeacherSignals


@pytest.fixture(scope="module")
def hf_teacher(tiny_model_dir: str) -> HFTeacher:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return HFTeacher(model, AutoTokenizer.from_pretrained(tiny_model_dir), batch_size=2, chunk_tokens=3)


def test_hf_teacher_matches_a_plain_forward(hf_teacher: HFTeacher) -> None:
    requests = [ScoreRequest([5, 17, 300, 42, 9], 2), ScoreRequest([7, 8, 1000], 1), ScoreRequest([11, 12, 13, 14], 3)]
    scores = hf_teacher.score(requests, top_k=4)
    for req, got in zip(requests, scores, strict=True):
        with torch.no_grad():
            logits = hf_teacher.model(input_ids=torch.tensor([req.token_ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        for j, i in enumerate(range(req.score_from, len(req.token_ids))):
            assert got.logprobs[j] == pytest.approx(float(logp[i - 1, req.token_ids[i]]), abs=1e-5)
            values, indices = logp[i - 1].topk(4)
            assert got.topk_ids is not None and got.topk_logprobs is not None
            assert got.topk_ids[j] == indices.tolist()
            assert got.topk_logprobs[j] == pytest.approx(values.tolist(), abs=1e-5)


def test_hf_teacher_refuses_unscorable_requests(hf_teacher: HFTeacher) -> None:
    with pytest.raises(TeacherError, match="score_from=3 must lie inside"):
        hf_teacher.score([ScoreRequest([1, 2, 3], 3)], top_k=0)
    with pytest.raises(TeacherError, match="outside the teacher vocabulary"):
        hf_teacher.score([ScoreRequest([1, 2, 10**7], 1)], top_k=0)
    hf_teacher.max_model_len = 4
    try:
        with pytest.raises(TeacherError, match=r"rl\.teacher\.max_model_len=4"):
            hf_teacher.score([ScoreRequest([1, 2, 3, 4, 5], 2)], top_k=0)
    finally:
        hf_teacher.max_model_len = None


class ScriptedTeacher:
    """A teacher whose attempts fail or return a chosen payload, in order."""

    def __init__(self, tokenizer: Any, outcomes: list[Any]) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, 100, None
        self.outcomes = outcomes

    def score(self, requests: list[ScoreRequest], top_k: int) -> list[SequenceScores]:
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return [outcome(req) for req in requests]


def _cfg(*overrides: str) -> OPDConfig:
    from posttrain.config.loading import apply_overrides, parse_overrides

    cfg = OPDConfig()
    cfg.rl.teacher.name_or_path = "x"
    return apply_overrides(cfg, parse_overrides(overrides)) if overrides else cfg  # type: ignore[return-value]


def _rollout() -> RolloutBatch:
    comps = [Completion(0, [3, 4], [-1.0, -2.0], "stop"), Completion(0, [5], [-0.5], "length")]
    return RolloutBatch(prompt_token_ids=[[1, 2]], completions=comps)


def _good(req: ScoreRequest) -> SequenceScores:
    n = len(req.token_ids) - req.score_from
    return SequenceScores([-1.0] * n, [[7, 8]] * n, [[math.log(0.5), math.log(0.25)]] * n)


def _duplicate_ids(req: ScoreRequest) -> SequenceScores:
    n = len(req.token_ids) - req.score_from
    return SequenceScores([-1.0] * n, [[7, 7]] * n, [[math.log(0.5), math.log(0.25)]] * n)


def test_a_failed_attempt_is_retried_and_counted(smollm2_tokenizer_dir: str) -> None:
    teacher = ScriptedTeacher(smollm2_tokenizer_dir, [RuntimeError("engine hiccup"), _good])
    signal = TeacherSignals(_cfg("rl.teacher.top_k=2"), teacher, None, 100).score(_rollout(), ["q"])
    assert signal.metrics["train/opd_teacher_score_request_count"] == 2
    assert signal.metrics["train/opd_teacher_score_success_count"] == 1
    assert signal.metrics["train/opd_teacher_score_failure_count"] == 1
    assert signal.metrics["train/opd_teacher_scored_sequences"] == 2
    assert signal.metrics["train/opd_teacher_scored_tokens"] == 3
    assert signal.topk_ids == [[[7, 8], [7, 8]], [[7, 8]]]


def test_an_invalid_payload_fails_the_whole_batch(smollm2_tokenizer_dir: str) -> None:
    teacher = ScriptedTeacher(smollm2_tokenizer_dir, [_duplicate_ids, _duplicate_ids])
    with pytest.raises(TeacherError, match="failed 2 time") as err:
        TeacherSignals(_cfg("rl.teacher.top_k=2"), teacher, None, 100).score(_rollout(), ["q"])
    assert "duplicate" in str(err.value).lower()
    teacher = ScriptedTeacher(smollm2_tokenizer_dir, [lambda req: SequenceScores([-1.0], [[7, 8]], [[-0.1, -0.2]])] * 2)
    with pytest.raises(TeacherError, match="scores for"):  # one score for a 2-token completion
        TeacherSignals(_cfg("rl.teacher.top_k=2"), teacher, None, 100).score(_rollout(), ["q"])


def test_same_token_advantage_credit_and_prefix(smollm2_tokenizer_dir: str) -> None:
    cfg = _cfg(
        "rl.distillation_mode=advantage",
        "rl.jsd_beta=null",
        "rl.kl_penalty_coef=0.5",
        "rl.n_ignore_prefix_tokens=1",
        "rl.group_size=2",
        "rl.batch_per_replica=2",
    )
    teacher = ScriptedTeacher(smollm2_tokenizer_dir, [lambda req: SequenceScores([-0.25] * (len(req.token_ids) - 2))])
    signal = TeacherSignals(cfg, teacher, None, 100).score(_rollout(), ["q"])
    # teacher minus rollout logprob of each realized token
    assert signal.credit == [[0.75, 1.75], [0.25]]
    collected = Collected(
        prompts=[PromptSample("q")],
        rollout=_rollout(),
        rewards_NG=torch.tensor([[1.0, 0.0]]),
        advantages_NG=torch.tensor([[0.7, -0.7]]),
    )
    batch, metrics = opd_train_batch(cfg, collected, signal)
    # A(t) = A_reward + 0.5 * credit, with the first token of each completion carrying no credit
    assert batch.token_advantages is not None
    assert batch.token_advantages.values == [
        pytest.approx([0.7, 0.7 + 0.5 * 1.75]),
        pytest.approx([-0.7]),
    ]
    assert metrics["train/opd_teacher_credit"] == pytest.approx(1.75)  # one counted token
    assert metrics["train/opd_advantage"] == pytest.approx((0.7 + 0.7 + 0.875 - 0.7) / 3)


def test_direct_signal_goes_to_the_batch(smollm2_tokenizer_dir: str) -> None:
    cfg = _cfg("rl.group_size=2", "rl.batch_per_replica=2")
    collected = Collected([PromptSample("q")], _rollout(), torch.zeros(1, 2), torch.zeros(1, 2))
    signal = TeacherSignal(topk_ids=[[[1]], [[2]]], topk_logprobs=[[[-0.1]], [[-0.2]]])
    batch, metrics = opd_train_batch(cfg, collected, signal)
    assert batch.teacher_topk is not None
    assert batch.teacher_topk.ids == [[[1]], [[2]]] and batch.token_advantages is None and metrics == {}


class ThinkTemplate:
    """A tokenizer stand-in whose template always ends with an empty closed think block."""

    chat_template = "x"

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return f"<|user|>{messages[-1]['content']}<|assistant|><think>\n\n</think>\n\n"


def test_think_prefix_appears_exactly_once() -> None:
    prefix = "<think>\n\n</think>\n\n"
    text = render_teacher_prefix(ThinkTemplate(), "2+2?", use_chat_template=True, think_prefix=prefix)
    assert text == "<|user|>2+2?<|assistant|>" + prefix and text.count(prefix) == 1
    other = render_teacher_prefix(ThinkTemplate(), "2+2?", use_chat_template=True, think_prefix="Answer: ")
    assert other == "<|user|>2+2?<|assistant|>Answer: "
    with pytest.raises(TeacherError, match="duplicated"):
        render_teacher_prefix(ThinkTemplate(), "say Answer: now", use_chat_template=True, think_prefix="Answer: ")
    # without a prefix the template's own rendering is kept as is
    plain = render_teacher_prefix(ThinkTemplate(), "2+2?", use_chat_template=True, think_prefix=None)
    assert plain.endswith("</think>\n\n")


def test_cross_token_requests_use_the_teachers_tokenization(smollm2_tokenizer_dir: str, tiny_model_dir: str) -> None:
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    eos = student.eos_token_id
    body = student("  héllo wörld 12", add_special_tokens=False)["input_ids"]
    rollout = RolloutBatch(
        prompt_token_ids=[[1, 2]],
        completions=[Completion(0, [*body, eos], [-1.0] * (len(body) + 1), "stop")],
    )
    cfg = _cfg(
        "rl.teacher.input_mode=cross_token_text",
        "rl.teacher.signal_mode=dpca",
        "rl.teacher.top_k=0",
        "rl.distillation_mode=advantage",
        "rl.jsd_beta=null",
    )
    seen: list[ScoreRequest] = []

    def record(req: ScoreRequest) -> SequenceScores:
        seen.append(req)
        return SequenceScores([-2.0] * (len(req.token_ids) - req.score_from))

    teacher = ScriptedTeacher(student, [record])
    teacher.vocab_size = len(student)
    signal = TeacherSignals(cfg, teacher, student, len(student)).score(rollout, ["hi"])
    prefix = student.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    req = seen[0]
    assert student.decode(req.token_ids[: req.score_from]) == prefix
    assert req.token_ids[req.score_from :] == [*body, eos]  # same tokenizer: identical ids, EOS paired
    # identical tokenizations: one chunk per token, each credit = L_T - L_S of that token
    assert signal.credit == [pytest.approx([-1.0] * (len(body) + 1))]
    assert signal.metrics["train/opd_dpca_coverage"] == 1.0
    assert signal.metrics["train/opd_dpca_chunk_count"] == len(body) + 1


def _byte_bpe_student() -> Any:
    """A student tokenizer of its own: a byte-level BPE (every byte in its alphabet) trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(["The answer is 602.", "12 + 7 = 19, so 602 it is."] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _dpca_cfg() -> OPDConfig:
    return _cfg(
        "rl.teacher.input_mode=cross_token_text",
        "rl.teacher.signal_mode=dpca",
        "rl.teacher.top_k=0",
        "rl.distillation_mode=advantage",
        "rl.jsd_beta=null",
    )


def test_dpca_text_the_teacher_does_not_reproduce_is_unmatched_not_a_failed_batch(
    smollm2_tokenizer_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's completion '.\x16 602': SmolLM2 has no token for byte 0x16 and drops it. The
    student's '\x16' token gets no credit; the tokens before and after it keep theirs; the batch
    scores on the first attempt and the coverage metrics count the unmatched tokens."""
    from transformers import AutoTokenizer

    student, teacher_tok = _byte_bpe_student(), AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    body = student(".\x16 602", add_special_tokens=False)["input_ids"]
    assert student.convert_ids_to_tokens(body) == [".", "Ė", "Ġ602"]
    dropped = student("\x16\x04", add_special_tokens=False)["input_ids"]  # the teacher keeps nothing of it
    rollout = RolloutBatch(
        prompt_token_ids=[[1, 2]],
        completions=[
            Completion(0, [*body, student.eos_token_id], [-1.0, -2.0, -0.5, -0.1], "stop"),
            Completion(0, dropped, [-1.0, -1.0], "length"),
        ],
    )
    seen: list[ScoreRequest] = []

    def record(req: ScoreRequest) -> SequenceScores:
        seen.append(req)
        return SequenceScores([-0.5, -0.25, -0.25, -0.5, -1.0, -0.3][: len(req.token_ids) - req.score_from])

    teacher = ScriptedTeacher(teacher_tok, [record])
    teacher.vocab_size = len(teacher_tok)
    with caplog.at_level("WARNING", logger="posttrain.teacher"):
        signal = TeacherSignals(_dpca_cfg(), teacher, student, len(student)).score(rollout, ["hi"])
    # One request only (the second text tokenizes to nothing): '. 602' in SmolLM2 tokens, then its EOS.
    assert len(seen) == 1
    assert seen[0].token_ids[seen[0].score_from :] == [*teacher_tok(". 602")["input_ids"], teacher_tok.eos_token_id]
    # '.': -0.5 - -1.0; '\x16': none; ' 602' (four teacher tokens): -2.0 - -0.5; EOS: -0.3 - -0.1.
    assert signal.credit == [pytest.approx([0.5, 0.0, -1.5, -0.2]), [0.0, 0.0]]
    m = signal.metrics
    assert m["train/opd_teacher_score_success_count"] == 1 and m["train/opd_teacher_score_failure_count"] == 0
    assert m["train/opd_teacher_scored_sequences"] == 1 and m["train/opd_teacher_scored_tokens"] == 6
    assert m["train/opd_dpca_coverage"] == pytest.approx(3 / 6)  # 3 of the 6 student tokens get credit
    assert m["train/opd_dpca_unmatched_chunk_count"] == pytest.approx(1.0)  # (1 + 1) over 2 completions
    assert m["train/opd_dpca_chunk_count"] == pytest.approx(1.5)
    assert m["train/opd_dpca_too_long_chunk_count"] == 0.0
    assert "reads the student's '\\x16' as ''" in caplog.text


def test_dpca_replacement_characters_and_control_characters_align(smollm2_tokenizer_dir: str) -> None:
    """Invalid UTF-8 the student samples (the encoding of a lone surrogate, ED A0 80) decodes to
    three U+FFFD, and NUL / ESC are bytes SmolLM2 has: the teacher reproduces the text, every token
    is its own chunk and gets credit."""
    from transformers import AutoTokenizer

    student, teacher_tok = _byte_bpe_student(), AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    pieces = ["a", "í", "ł", "Ģ", "b", "Ā", "ě"]  # 'a', bytes ED A0 80, 'b', NUL, ESC
    body = student.convert_tokens_to_ids(pieces)
    assert student.decode(body) == "a\ufffd\ufffd\ufffdb\x00\x1b"
    rollout = RolloutBatch(prompt_token_ids=[[1, 2]], completions=[Completion(0, body, [-1.0] * len(body), "length")])
    teacher = ScriptedTeacher(
        teacher_tok, [lambda req: SequenceScores([-0.25] * (len(req.token_ids) - req.score_from))]
    )
    teacher.vocab_size = len(teacher_tok)
    signal = TeacherSignals(_dpca_cfg(), teacher, student, len(student)).score(rollout, ["hi"])
    assert signal.credit == [pytest.approx([0.75] * len(body))]
    assert signal.metrics["train/opd_dpca_coverage"] == 1.0
    assert signal.metrics["train/opd_dpca_unmatched_chunk_count"] == 0.0


def _direct_batch(teacher: HFTeacher, top_k: int) -> Any:
    """A two-completion batch with the teacher's own top-k attached."""
    from posttrain.policy.train_batch import TeacherTopK, TrainBatch

    prompts, completions = [[5, 17, 300], [7, 8]], [[42, 9, 11, 12], [1000, 3]]
    scores = teacher.score([ScoreRequest(p + c, len(p)) for p, c in zip(prompts, completions, strict=True)], top_k)
    return TrainBatch(
        prompt_ids=prompts,
        completion_ids=completions,
        advantages_B=torch.zeros(2),
        in_loss_B=torch.ones(2, dtype=torch.bool),
        sampler_logprobs=[s.logprobs for s in scores],
        teacher_topk=TeacherTopK(
            ids=[s.topk_ids for s in scores],  # type: ignore[arg-type]
            logprobs=[s.topk_logprobs for s in scores],  # type: ignore[arg-type]
        ),
    )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_direct_opd_fixed_point_and_micro_batch_invariance(tiny_model_dir: str, beta: float) -> None:
    """A student equal to its teacher has zero divergence; a different student's divergence and
    gradient do not depend on how the batch is split into micro-batches."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.policy.objective import direct_distillation_objective
    from posttrain.policy.trainer import PolicyTrainer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    teacher_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    teacher = HFTeacher(teacher_model, tok)
    batch = _direct_batch(teacher, top_k=5)

    def one_step(student_seed: int | None, micro: int | None) -> tuple[dict[str, float], list[torch.Tensor]]:
        student = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        if student_seed is not None:
            with torch.no_grad():
                g = torch.Generator().manual_seed(student_seed)
                for p in student.parameters():
                    p.add_(0.5 * torch.randn(p.shape, generator=g))
        cfg = _cfg(
            "rl.group_size=1", "rl.batch_per_replica=2", f"rl.jsd_beta={beta}", "model.share_prompt_prefix=false"
        )
        if micro is not None:
            cfg.rl.micro_batch_per_replica = micro
        trainer = PolicyTrainer(student, cfg, objective=direct_distillation_objective(cfg), pad_id=0)
        grads: list[torch.Tensor] = []
        trainer._optimizer_step = lambda step: (
            grads.extend(  # type: ignore[method-assign]
                p.grad.clone() for p in student.parameters() if p.grad is not None
            )
            or 1.0
        )
        return trainer.train_on(batch, 1), grads

    same, _ = one_step(None, None)
    assert same["train/opd_divergence"] < 1e-5
    whole, g_whole = one_step(3, None)
    split, g_split = one_step(3, 1)
    assert whole["train/opd_divergence"] > max(1e-5, 100 * same["train/opd_divergence"]), (whole, same)
    assert split["train/opd_divergence"] == pytest.approx(whole["train/opd_divergence"], rel=1e-5)
    for a, b in zip(g_whole, g_split, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
