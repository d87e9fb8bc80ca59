"""DPCA: token end offsets on two real byte-level tokenizers (SmolLM2 and a small BPE trained here),
chunk alignment and its guard, and the chunk credit on hand-computed numbers. Teachers whose text
differs from the student's: ``test_dpca_unmatched.py``."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest
import torch

from posttrain.algorithm.distillation import TeacherPayloadError
from posttrain.algorithm.dpca import (
    AlignmentError,
    Chunk,
    align_chunks,
    dpca_credit,
    dpca_credit_batch,
    eos_chunk,
)
from posttrain.teacher.text_offsets import (
    byte_level_end_offsets,
    is_byte_level,
    prefix_end_offsets,
    token_end_offsets,
)

F64 = torch.float64

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A caf in the old town serves naive tourists, and they like it.",
    "Numbers: 12 + 7 = 19, and 3 * 4 = 12.",
    "def f(x):\n    return x * 2\n",
    "Tabs\tand   spaces  matter here.",
    "Distillation trains a student to imitate a teacher.",
] * 3

SPECIAL = "<|fin de séance|>"


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def small_bpe() -> Any:
    """A byte-level BPE with 400 ids trained on a few sentences: its merges differ from SmolLM2's,
    and text outside its training data (accents, CJK, emoji) falls back to single bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    # An added token whose text is outside the byte alphabet (space, accent): decoded verbatim.
    hf.add_special_tokens({"additional_special_tokens": [SPECIAL]})
    return hf


def _encode(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
    return list(ids)


def _align(student_tok: Any, teacher_tok: Any, text: str, max_chunk_tokens: int = 64) -> tuple[list[Chunk], Any, Any]:
    s_ids, t_ids = _encode(student_tok, text), _encode(teacher_tok, text)
    chunks = align_chunks(
        token_end_offsets(student_tok, s_ids),
        token_end_offsets(teacher_tok, t_ids),
        text,
        max_chunk_tokens=max_chunk_tokens,
    )
    return chunks, s_ids, t_ids


# ----------------------------------------------------------------------------------------------
# Token end offsets
# ----------------------------------------------------------------------------------------------


def test_offsets_skip_tokens_that_end_inside_a_character(smollm2: Any, small_bpe: Any) -> None:
    ids = _encode(smollm2, "中文字符")
    # SmolLM2 splits 符 (3 UTF-8 bytes) into 'ç¬' + '¦': the first piece ends inside the character.
    assert smollm2.convert_ids_to_tokens(ids) == ["ä¸Ń", "æĸĩ", "åŃĹ", "ç¬", "¦"]
    assert token_end_offsets(smollm2, ids) == [1, 2, 3, None, 4]
    ids = _encode(small_bpe, "é!")
    assert small_bpe.convert_ids_to_tokens(ids) == ["Ã", "©", "!"]
    assert token_end_offsets(small_bpe, ids) == [None, 1, 2]


def test_offsets_of_invalid_utf8(smollm2: Any) -> None:
    # The lone lead byte 0xE4 followed by 'A': the text is '\ufffdA', and the prefix [0xE4] decodes
    # to '\ufffd', a prefix of it, so the byte token is a boundary at 1.
    lead = smollm2.convert_tokens_to_ids("ä")
    a = smollm2.convert_tokens_to_ids("A")
    ids = [lead, a]
    assert smollm2.decode(ids) == "\ufffdA"
    assert token_end_offsets(smollm2, ids) == [1, 2] == prefix_end_offsets(smollm2, ids)


def test_special_tokens_decode_to_their_text(smollm2: Any, small_bpe: Any) -> None:
    eos = smollm2.eos_token_id
    ids = [*_encode(smollm2, "Hi"), eos]
    assert token_end_offsets(smollm2, ids) == [2, 2 + len("<|im_end|>")]
    special = small_bpe.convert_tokens_to_ids(SPECIAL)
    ids = [special, *_encode(small_bpe, "é")]
    assert token_end_offsets(small_bpe, ids) == [len(SPECIAL), None, len(SPECIAL) + 1]


def _random_ids(tokenizer: Any, rng: random.Random, byte_ids: list[int], extra: list[int]) -> list[int]:
    """Mostly single-byte and short tokens (partial and invalid UTF-8 galore), some arbitrary ids."""
    out = []
    for _ in range(rng.randint(1, 20)):
        r = rng.random()
        out.append(
            rng.choice(byte_ids) if r < 0.6 else rng.choice(extra) if r < 0.65 else rng.randrange(len(tokenizer))
        )
    return out


@pytest.mark.parametrize("which", ["smollm2", "small_bpe"])
def test_byte_fast_path_agrees_with_prefix_decoding(which: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(which)
    assert is_byte_level(tokenizer)
    specials = list(tokenizer.all_special_ids)
    byte_ids = [i for i in range(len(tokenizer)) if len(tokenizer.convert_ids_to_tokens(i)) <= 2]
    rng = random.Random(7)
    for _ in range(150):
        ids = _random_ids(tokenizer, rng, byte_ids, specials)
        fast = byte_level_end_offsets(tokenizer, ids)
        assert fast is not None
        assert fast == prefix_end_offsets(tokenizer, ids), ids
        assert token_end_offsets(tokenizer, ids) == fast


def test_non_byte_level_tokenizer_uses_prefix_decoding() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(
        TRAINING_TEXT, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = hf.encode("the lazy teacher", add_special_tokens=False)
    assert not is_byte_level(hf)
    assert token_end_offsets(hf, ids) == prefix_end_offsets(hf, ids)
    with pytest.raises(ValueError, match="method='prefix'"):
        token_end_offsets(hf, ids, method="bytes")


# ----------------------------------------------------------------------------------------------
# Alignment
# ----------------------------------------------------------------------------------------------


def test_align_hand_example() -> None:
    # "abcdefg": student "ab|cde|fg", teacher "abc|de|f|g": common boundaries at 5 and 7.
    chunks = align_chunks([2, 5, 7], [3, 5, 6, 7], "abcdefg", max_chunk_tokens=4)
    assert chunks == [Chunk(0, 2, 0, 2, 0, 5), Chunk(2, 3, 2, 4, 5, 7)]


def test_align_none_offsets_and_empty_tokens() -> None:
    # A None offset and a token that decodes to nothing (ends where the previous one did).
    assert align_chunks([1, None, 3, 3], [3], "abc", max_chunk_tokens=4) == [Chunk(0, 4, 0, 1, 0, 3)]
    # A leading empty token joins the first chunk with text.
    assert align_chunks([0, 2, 3], [1, 2, 3], "abc", max_chunk_tokens=4) == [
        Chunk(0, 2, 0, 2, 0, 2),
        Chunk(2, 3, 2, 3, 2, 3),
    ]
    assert align_chunks([0], [0, 0], "", max_chunk_tokens=4) == [Chunk(0, 1, 0, 2, 0, 0)]
    assert align_chunks([], [], "", max_chunk_tokens=4) == []


def test_guard_rejects_a_long_chunk_whole() -> None:
    # "ababababab": student "ab|ab|ab|ab|ab", teacher "a|ba|ba|ba|ba|b": only the end is shared. Over
    # the guard the chunk is kept whole (not force-closed into pieces) and marked for no credit.
    assert align_chunks([2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 10], "ababababab", max_chunk_tokens=4) == [
        Chunk(0, 5, 0, 6, 0, 10, "too_long")
    ]
    assert align_chunks([2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 10], "ababababab", max_chunk_tokens=6) == [
        Chunk(0, 5, 0, 6, 0, 10)
    ]
    # Only the long chunk is rejected: "xy|ababababab" with a shared boundary after "xy".
    chunks = align_chunks([2, 4, 6, 8, 10, 12], [2, 3, 5, 7, 9, 11, 12], "xyababababab", max_chunk_tokens=4)
    assert chunks == [Chunk(0, 1, 0, 1, 0, 2), Chunk(1, 6, 1, 7, 2, 12, "too_long")]
    credit, stats = dpca_credit(torch.full((6,), -1.0, dtype=F64), torch.full((7,), -0.5, dtype=F64), chunks)
    torch.testing.assert_close(credit, torch.tensor([0.5, 0, 0, 0, 0, 0], dtype=F64))
    metrics = stats.to_metrics()
    torch.testing.assert_close(metrics["train/opd_dpca_too_long_chunk_count"], torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(metrics["train/opd_dpca_coverage"], torch.tensor(1 / 6, dtype=F64))
    torch.testing.assert_close(metrics["train/opd_dpca_chunk_count"], torch.tensor(1.0, dtype=F64))


def test_offsets_that_do_not_describe_the_text_are_refused() -> None:
    with pytest.raises(AlignmentError, match="do not describe this text"):
        align_chunks([1, 2], [2], "abc", max_chunk_tokens=4)
    with pytest.raises(AlignmentError, match="past the text's end"):
        align_chunks([5, 3], [3], "abc", max_chunk_tokens=4)
    with pytest.raises(AlignmentError, match="no tokens"):
        align_chunks([], [3], "abc", max_chunk_tokens=4)


def test_align_real_tokenizers_hand_checked(smollm2: Any, small_bpe: Any) -> None:
    chunks, _, t_ids = _align(smollm2, small_bpe, "中文")
    assert small_bpe.convert_ids_to_tokens(t_ids) == ["ä", "¸", "Ń", "æ", "ĸ", "ĩ"]
    assert chunks == [Chunk(0, 1, 0, 3, 0, 1), Chunk(1, 2, 3, 6, 1, 2)]

    # SmolLM2 'c|af|é| na|ïve' against the small BPE 'caf|Ã|©| |n|a|Ã|¯|ve' (bytes for the accents).
    chunks, s_ids, t_ids = _align(smollm2, small_bpe, "café naïve")
    assert smollm2.convert_ids_to_tokens(s_ids) == ["c", "af", "Ã©", "Ġna", "Ã¯ve"]
    assert small_bpe.convert_ids_to_tokens(t_ids) == ["caf", "Ã", "©", "Ġ", "n", "a", "Ã", "¯", "ve"]
    assert chunks == [
        Chunk(0, 2, 0, 1, 0, 3),  # "caf": 2 student tokens, 1 teacher token
        Chunk(2, 3, 1, 3, 3, 4),  # "é": 1 and 2 (the teacher splits its UTF-8 bytes)
        Chunk(3, 4, 3, 6, 4, 7),  # " na": 1 and 3
        Chunk(4, 5, 6, 9, 7, 10),  # "ïve": 1 and 3
    ]

    # Crossing boundaries: 'na|ive' against 'nai|ve' share only the ends: one chunk, 2 tokens each.
    chunks, s_ids, t_ids = _align(smollm2, small_bpe, "naive")
    assert smollm2.convert_ids_to_tokens(s_ids) == ["na", "ive"]
    assert small_bpe.convert_ids_to_tokens(t_ids) == ["nai", "ve"]
    assert chunks == [Chunk(0, 2, 0, 2, 0, 5)]


UNICODE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé — déjà vu",
    "  \n\n\tindented   x\n\n\n  y \t\n",
    "数学很有趣。我喜欢中文字符！",
    "emoji 😀🎉 and flags 🇫🇷 ok 👍🏽",
    "def g(y):\n\treturn y ** 2  # squared\n",
    "mixed: naïve 中文 😀\tend",
]


@pytest.mark.parametrize(("student", "teacher"), [("smollm2", "small_bpe"), ("small_bpe", "smollm2")])
def test_align_real_tokenizers_properties(student: str, teacher: str, request: pytest.FixtureRequest) -> None:
    s_tok, t_tok = request.getfixturevalue(student), request.getfixturevalue(teacher)
    multi_student = multi_teacher = 0
    for text in UNICODE_TEXTS:
        chunks, s_ids, t_ids = _align(s_tok, t_tok, text)
        s_off, t_off = token_end_offsets(s_tok, s_ids), token_end_offsets(t_tok, t_ids)
        # The chunks tile both token sequences and the text, in order.
        assert chunks[0].student_start == chunks[0].teacher_start == chunks[0].text_start == 0
        for a, b in itertools.pairwise(chunks):
            assert (a.student_end, a.teacher_end, a.text_end) == (b.student_start, b.teacher_start, b.text_start)
        assert (chunks[-1].student_end, chunks[-1].teacher_end, chunks[-1].text_end) == (
            len(s_ids),
            len(t_ids),
            len(text),
        )
        for c in chunks:
            span = text[c.text_start : c.text_end]
            assert s_tok.decode(s_ids[c.student_start : c.student_end]) == span
            assert t_tok.decode(t_ids[c.teacher_start : c.teacher_end]) == span
            # Minimal: no boundary strictly inside the chunk is shared by both sides.
            inner_s = {
                o for o in s_off[c.student_start : c.student_end] if o is not None and c.text_start < o < c.text_end
            }
            inner_t = {
                o for o in t_off[c.teacher_start : c.teacher_end] if o is not None and c.text_start < o < c.text_end
            }
            assert not inner_s & inner_t, (text, c)
            multi_student += c.student_len > 1
            multi_teacher += c.teacher_len > 1
    assert multi_student > 0 and multi_teacher > 0


def test_guard_on_real_tokenizers(smollm2: Any, small_bpe: Any) -> None:
    # 😀 is 3 SmolLM2 tokens and 4 single-byte tokens of the small BPE: one chunk of (3, 4).
    chunks, _, _ = _align(smollm2, small_bpe, "😀")
    assert chunks == [Chunk(0, 3, 0, 4, 0, 1)]
    chunks, _, _ = _align(smollm2, small_bpe, "😀", max_chunk_tokens=3)
    assert chunks == [Chunk(0, 3, 0, 4, 0, 1, "too_long")]


# ----------------------------------------------------------------------------------------------
# Credit
# ----------------------------------------------------------------------------------------------


def _three_chunks() -> tuple[torch.Tensor, torch.Tensor, list[Chunk]]:
    """Chunk A: student [-1, -3] (L_S = -4), teacher [-0.5, -1.5] (L_T = -2): ratio 0.5.
    Chunk B: student [0, 0] (L_S = 0), teacher [-0.6]. Chunk C: student [-2], teacher [-1, -1.5]."""
    student = torch.tensor([-1.0, -3.0, 0.0, 0.0, -2.0], dtype=F64)
    teacher = torch.tensor([-0.5, -1.5, -0.6, -1.0, -1.5], dtype=F64)
    chunks = [Chunk(0, 2, 0, 2, 0, 3), Chunk(2, 4, 2, 3, 3, 5), Chunk(4, 5, 3, 5, 5, 6)]
    return student, teacher, chunks


def test_credit_hand_values() -> None:
    student, teacher, chunks = _three_chunks()
    credit, stats = dpca_credit(student, teacher, chunks)
    # A: (0.5 - 1) * [-1, -3] = [0.5, 1.5], sum 2 = L_T - L_S.
    # B: L_S = 0 -> (L_T - L_S) / 2 = -0.3 each.  C: (-2.5 / -2 - 1) * -2 = -0.5.
    expected = torch.tensor([0.5, 1.5, -0.3, -0.3, -0.5], dtype=F64)
    torch.testing.assert_close(credit, expected)
    torch.testing.assert_close(credit[:2].sum(), torch.tensor(-2.0 - -4.0, dtype=F64))
    metrics = stats.to_metrics()
    hand = {
        "train/opd_dpca_chunk_count": 3.0,
        "train/opd_dpca_student_chunk_len": 5 / 3,
        "train/opd_dpca_teacher_chunk_len": 5 / 3,
        "train/opd_dpca_coverage": 1.0,
        "train/opd_dpca_student_chunk_logprob": (-4.0 + 0.0 - 2.0) / 3,
        "train/opd_dpca_teacher_chunk_logprob": (-2.0 - 0.6 - 2.5) / 3,
        "train/opd_dpca_chunk_gap": ((-4.0 + 2.0) + (0.0 + 0.6) + (-2.0 + 2.5)) / 3,
        "train/opd_dpca_zero_logprob_chunk_frac": 1 / 3,
        "train/opd_dpca_unmatched_chunk_count": 0.0,
        "train/opd_dpca_too_long_chunk_count": 0.0,
        "train/opd_teacher_credit": (0.5 + 1.5 - 0.3 - 0.3 - 0.5) / 5,
    }
    assert set(metrics) == set(hand)
    for name, value in hand.items():
        torch.testing.assert_close(metrics[name], torch.tensor(value, dtype=F64), msg=name)


def test_credit_ignores_the_prefix_after_building_it() -> None:
    student, teacher, chunks = _three_chunks()
    credit, stats = dpca_credit(student, teacher, chunks, n_ignore_prefix_tokens=1)
    # Token 1 keeps its share of chunk A computed over the whole chunk.
    torch.testing.assert_close(credit, torch.tensor([0.0, 1.5, -0.3, -0.3, -0.5], dtype=F64))
    torch.testing.assert_close(stats.credit_sum, torch.tensor(0.4, dtype=F64))
    torch.testing.assert_close(stats.credit_tokens, torch.tensor(4.0, dtype=F64))


def test_near_zero_student_chunk_logprob_spreads_equally() -> None:
    # |L_S| = 5e-7 <= 1e-6: the proportional shares (here +2 and -1) would be rounding noise.
    student = torch.tensor([5e-7, -1e-6], dtype=F64)
    credit, _ = dpca_credit(student, torch.tensor([-1.0], dtype=F64), [Chunk(0, 2, 0, 1, 0, 1)])
    gap = -1.0 - (5e-7 - 1e-6)
    torch.testing.assert_close(credit, torch.tensor([gap / 2, gap / 2], dtype=F64))


def test_eos_chunk_and_uncovered_tokens_in_a_padded_batch() -> None:
    nan = math.nan
    # Sequence 0: text "ab" as [-1] vs teacher [-0.5], then EOS -0.2 vs teacher EOS -0.1.
    # Sequence 1: 3 real tokens, only the first two chunked (coverage 2/3); padding holds NaN.
    student = torch.tensor([[-1.0, -0.2, nan], [-0.5, -0.5, -1.0]], dtype=F64, requires_grad=True)
    teacher = torch.tensor([[-0.5, -0.1, nan], [-2.0, nan, nan]], dtype=F64)
    chunks = [
        [Chunk(0, 1, 0, 1, 0, 2), eos_chunk(1, 1, 2)],
        [Chunk(0, 2, 0, 1, 0, 1)],
    ]
    credit, stats = dpca_credit_batch(student, teacher, chunks, student_lengths_B=[2, 3])
    # (L_T/L_S - 1) * lp: seq 0: (0.5 - 1)(-1) = 0.5 and (0.5 - 1)(-0.2) = 0.1; seq 1: (2 - 1)(-0.5) = -0.5 each.
    torch.testing.assert_close(credit, torch.tensor([[0.5, 0.1, 0.0], [-0.5, -0.5, 0.0]], dtype=F64))
    assert not credit.requires_grad
    assert eos_chunk(1, 1, 2) == Chunk(1, 2, 1, 2, 2, 2)
    metrics = stats.to_metrics()
    torch.testing.assert_close(metrics["train/opd_dpca_coverage"], torch.tensor(4 / 5, dtype=F64))
    torch.testing.assert_close(metrics["train/opd_dpca_chunk_count"], torch.tensor(1.5, dtype=F64))
    merged = stats.merge(stats).to_metrics()
    torch.testing.assert_close(merged["train/opd_dpca_coverage"], torch.tensor(4 / 5, dtype=F64))


def test_bad_credit_inputs_are_refused() -> None:
    student, teacher, chunks = _three_chunks()
    bad_teacher = teacher.clone()
    bad_teacher[3] = -math.inf
    with pytest.raises(TeacherPayloadError, match="sequence 0, token 3"):
        dpca_credit(student, bad_teacher, chunks)
    with pytest.raises(AlignmentError, match="outside the sequence"):
        dpca_credit(student, teacher, [Chunk(0, 6, 0, 2, 0, 3)])
    with pytest.raises(AlignmentError, match="out of order"):
        dpca_credit(student, teacher, [chunks[1], chunks[0]])
    with pytest.raises(ValueError, match="n_ignore_prefix_tokens"):
        dpca_credit(student, teacher, chunks, n_ignore_prefix_tokens=-1)


def test_credit_end_to_end_on_real_tokenizers(smollm2: Any, small_bpe: Any) -> None:
    # With made-up logprobs (-0.1 per student token, -0.2 per teacher token) each chunk's credit sums
    # to L_T - L_S = -0.2 * (teacher tokens) + 0.1 * (student tokens).
    chunks, s_ids, t_ids = _align(smollm2, small_bpe, "café naïve 中文 😀")
    student = torch.full((len(s_ids),), -0.1, dtype=F64)
    teacher = torch.full((len(t_ids),), -0.2, dtype=F64)
    credit, stats = dpca_credit(student, teacher, chunks)
    for c in chunks:
        gap = -0.2 * c.teacher_len + 0.1 * c.student_len
        torch.testing.assert_close(credit[c.student_start : c.student_end].sum(), torch.tensor(gap, dtype=F64))
    torch.testing.assert_close(stats.to_metrics()["train/opd_dpca_coverage"], torch.tensor(1.0, dtype=F64))
