"""DPCA when the teacher's tokenizer does not reproduce the student's text (issue 15): the text
alignment, the exact chunks on real tokenizers (SmolLM2 and BPEs trained here: one with every
byte, one that spells unknown characters as ``<|endoftext|>``, one that normalises NFKC and
collapses whitespace), and the credit: none for an unmatched stretch, full credit around it."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from posttrain.algorithm.dpca import Chunk, align_chunks, dpca_credit, eos_chunk, text_blocks
from posttrain.teacher.text_offsets import token_end_offsets

F64 = torch.float64

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Numbers: 12 + 7 = 19, and 3 * 4 = 12. The answer is 602.",
    "def f(x):\n    return x * 2\n",
    "Tabs\tand   spaces  matter here, fine.",
] * 3


def _bpe(*, normalise: bool = False) -> Any:
    """A byte-level BPE with every byte in its alphabet (so any text round-trips unless it normalises)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if normalise:
        tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " ")])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer_dir: str) -> Any:
    """Drops the bytes it has no token for (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d) when it encodes."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def byte_bpe() -> Any:
    return _bpe()


@pytest.fixture(scope="module")
def normalising_bpe() -> Any:
    return _bpe(normalise=True)


@pytest.fixture(scope="module")
def unk_bpe() -> Any:
    """A character-level BPE (Metaspace) whose unknown characters become ``<|endoftext|>``, as the
    issue's teacher spelled ``'\\x16'``; not byte-level, so its offsets come from prefix decoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator([*TRAINING_TEXT, "0123456789"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _align(
    student: Any, teacher: Any, s_ids: list[int], max_chunk_tokens: int = 64
) -> tuple[list[Chunk], str, list[int], str]:
    """As the teacher role does it: the student's text, the teacher's tokenization and decode of it."""
    text = _decode(student, s_ids)
    t_ids = list(teacher.encode(text, add_special_tokens=False))
    teacher_text = _decode(teacher, t_ids)
    chunks = align_chunks(
        token_end_offsets(student, s_ids),
        token_end_offsets(teacher, t_ids),
        text,
        teacher_text=teacher_text,
        max_chunk_tokens=max_chunk_tokens,
    )
    return chunks, text, t_ids, teacher_text


def _ids(tokenizer: Any, text: str) -> list[int]:
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    assert _decode(tokenizer, ids) == text
    return ids


def _byte_ids(tokenizer: Any, data: bytes) -> list[int]:
    """One single-byte token per byte (the GPT-2 byte alphabet: printable Latin-1 bytes are their own
    character, the other 68 bytes ``chr(256 + n)`` in byte order)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    return [int(tokenizer.convert_tokens_to_ids(char[b])) for b in data]


# ----------------------------------------------------------------------------------------------
# Text alignment
# ----------------------------------------------------------------------------------------------


def test_text_blocks_hand_examples() -> None:
    assert text_blocks("abc", "abc") == [(0, 0, 3)]
    assert text_blocks("a\x16b", "ab") == [(0, 0, 1), (2, 1, 1)]  # a dropped character
    assert text_blocks(".\x16 602", ".<|endoftext|> 602") == [(0, 0, 1), (2, 14, 4)]
    assert text_blocks("ﬁx", "fix") == [(1, 2, 1)]  # NFKC: the ligature is not at the start of the teacher's text
    assert text_blocks("x  y\t\tz", "x y z") == [(0, 0, 2), (3, 2, 1), (6, 4, 1)]  # whitespace collapsed
    assert text_blocks("", "") == [] and text_blocks("", "x") == [] and text_blocks("①", "1") == []


def _lcs_length(a: str, b: str) -> int:
    """Textbook dynamic programme, the reference for the alignment's optimality."""
    row = [0] * (len(b) + 1)
    for ch in a:
        prev_diag, row[0] = 0, 0
        for j, other in enumerate(b, start=1):
            prev_diag, row[j] = row[j], prev_diag + 1 if ch == other else max(row[j], row[j - 1])
    return row[-1]


def test_text_blocks_are_a_longest_common_subsequence() -> None:
    rng = random.Random(15)
    for _ in range(400):
        a = "".join(rng.choice("ab \x16\t") for _ in range(rng.randint(0, 16)))
        b = "".join(rng.choice("ab <>") for _ in range(rng.randint(0, 16)))
        blocks = text_blocks(a, b)
        i_end = j_end = 0
        for n, (i, j, k) in enumerate(blocks):
            assert k > 0 and i >= i_end and j >= j_end
            assert n == 0 or (i, j) != (i_end, j_end)  # blocks on one diagonal are merged
            assert a[i : i + k] == b[j : j + k]
            i_end, j_end = i + k, j + k
        assert sum(k for _, _, k in blocks) == _lcs_length(a, b), (a, b, blocks)


def test_text_blocks_give_up_past_the_edit_budget() -> None:
    # 100 dropped characters: all 100 'a' align. 600 (> MAX_TEXT_EDITS = 512): only the common
    # suffix does; the rest is one unaligned stretch (no credit there), found in bounded time.
    assert sum(k for _, _, k in text_blocks("\x16a" * 100, "a" * 100)) == 100
    assert text_blocks("\x16a" * 600, "a" * 600) == [(1199, 599, 1)]


# ----------------------------------------------------------------------------------------------
# Exact chunks on real tokenizers
# ----------------------------------------------------------------------------------------------


def test_a_dropped_control_character_is_one_unmatched_chunk(byte_bpe: Any, smollm2: Any) -> None:
    s_ids = _ids(byte_bpe, ".\x16 602")
    assert byte_bpe.convert_ids_to_tokens(s_ids) == [".", "Ė", "Ġ602"]
    chunks, _, t_ids, teacher_text = _align(byte_bpe, smollm2, s_ids)
    assert teacher_text == ". 602" and smollm2.convert_ids_to_tokens(t_ids) == [".", "Ġ", "6", "0", "2"]
    assert chunks == [
        Chunk(0, 1, 0, 1, 0, 1),  # '.'
        Chunk(1, 2, 1, 1, 1, 2, "unmatched"),  # '\x16': one student token, no teacher token
        Chunk(2, 3, 1, 5, 2, 6),  # ' 602': one student token, four teacher tokens
    ]
    # NUL and ESC are bytes SmolLM2 has: they align like any other character.
    chunks, _, _, teacher_text = _align(byte_bpe, smollm2, _ids(byte_bpe, "a\x00b\x1b[0m\x16c"))
    assert teacher_text == "a\x00b\x1b[0mc"
    assert [c.kind for c in chunks] == ["aligned"] * 7 + ["unmatched", "aligned"]
    assert chunks[7] == Chunk(7, 8, 7, 7, 7, 8, "unmatched")


def test_a_teacher_unknown_token_is_one_unmatched_chunk(byte_bpe: Any, unk_bpe: Any) -> None:
    # The completion: the teacher reads '.\x16 602' as '.<|endoftext|> 602'.
    chunks, _, t_ids, teacher_text = _align(byte_bpe, unk_bpe, _ids(byte_bpe, ".\x16 602"))
    assert teacher_text == ".<|endoftext|> 602"
    assert unk_bpe.convert_ids_to_tokens(t_ids) == ["▁", ".", "<|endoftext|>", "▁", "6", "0", "2"]
    assert chunks == [
        Chunk(0, 1, 0, 2, 0, 1),  # '.' (the teacher's leading '▁' decodes to nothing)
        Chunk(1, 2, 2, 3, 1, 2, "unmatched"),  # '\x16' against '<|endoftext|>'
        Chunk(2, 3, 3, 7, 2, 6),  # ' 602'
    ]
    chunks, _, _, teacher_text = _align(byte_bpe, unk_bpe, _ids(byte_bpe, "the \x16\x16 dog"))
    assert teacher_text == "the <|endoftext|><|endoftext|> dog"
    assert chunks == [
        Chunk(0, 1, 0, 1, 0, 3),  # 'the'
        Chunk(1, 2, 1, 2, 3, 4),  # ' '
        Chunk(2, 4, 2, 4, 4, 6, "unmatched"),  # two '\x16' against two '<|endoftext|>'
        Chunk(4, 5, 4, 7, 6, 10),  # ' dog'
    ]


def test_replacement_characters_of_invalid_utf8(byte_bpe: Any, smollm2: Any, unk_bpe: Any) -> None:
    # The student samples the UTF-8 encoding of a lone surrogate (ED A0 80), invalid UTF-8: its text
    # holds three U+FFFD. SmolLM2 spells U+FFFD exactly, so everything aligns; the character-level
    # teacher has no U+FFFD and reads each as '<|endoftext|>'.
    s_ids = _byte_ids(byte_bpe, b"a\xed\xa0\x80b")
    chunks, text, _, teacher_text = _align(byte_bpe, smollm2, s_ids)
    assert text == teacher_text == "a\ufffd\ufffd\ufffdb"
    assert chunks == [Chunk(k, k + 1, k, k + 1, k, k + 1) for k in range(5)]
    chunks, text, _, teacher_text = _align(byte_bpe, unk_bpe, s_ids)
    assert teacher_text == "a" + "<|endoftext|>" * 3 + "b"
    assert chunks == [Chunk(0, 1, 0, 2, 0, 1), Chunk(1, 4, 2, 5, 1, 4, "unmatched"), Chunk(4, 5, 5, 6, 4, 5)]


def test_a_normalising_teacher(smollm2: Any, normalising_bpe: Any) -> None:
    s_ids = _ids(smollm2, "ﬁne  x\t\ty")
    assert smollm2.convert_ids_to_tokens(s_ids) == ["ï¬ģ", "ne", "Ġ", "Ġx", "ĉ", "ĉ", "y"]
    chunks, _, t_ids, teacher_text = _align(smollm2, normalising_bpe, s_ids)
    assert teacher_text == "fine x y"
    assert normalising_bpe.convert_ids_to_tokens(t_ids) == ["f", "in", "e", "Ġx", "Ġ", "y"]
    assert chunks == [
        Chunk(0, 2, 0, 3, 0, 3, "unmatched"),  # 'ﬁ|ne' against 'f|in|e': no shared boundary before 'e' ends
        Chunk(2, 4, 3, 4, 3, 6, "unmatched"),  # '  x' against ' x'
        Chunk(4, 6, 4, 5, 6, 8, "unmatched"),  # '\t\t' against ' '
        Chunk(6, 7, 5, 6, 8, 9),  # 'y'
    ]
    chunks, _, _, teacher_text = _align(smollm2, normalising_bpe, _ids(smollm2, "①"))
    assert teacher_text == "1" and chunks == [Chunk(0, 3, 0, 1, 0, 1, "unmatched")]


# ----------------------------------------------------------------------------------------------
# Credit around an unmatched chunk
# ----------------------------------------------------------------------------------------------


def test_no_credit_inside_an_unmatched_chunk_full_credit_around_it(byte_bpe: Any, smollm2: Any) -> None:
    # '.' | '\x16' (unmatched) | ' 602' (four teacher tokens) | EOS pair.
    chunks, text, _, _ = _align(byte_bpe, smollm2, _ids(byte_bpe, ".\x16 602"))
    chunks.append(eos_chunk(3, 5, len(text)))
    student = torch.tensor([-1.0, -2.0, -0.5, -0.1], dtype=F64)
    teacher = torch.tensor([-0.5, -0.25, -0.25, -0.5, -1.0, -0.3], dtype=F64)
    credit, stats = dpca_credit(student, teacher, chunks)
    # One student token per aligned chunk: credit = L_T - L_S (' 602': -2.0 - -0.5); the '\x16'
    # token gets none, and the tokens before and after it keep theirs.
    expected = torch.tensor([0.5, 0.0, -1.5, -0.2], dtype=F64)
    torch.testing.assert_close(credit, expected)
    metrics = stats.to_metrics()
    hand = {
        "train/opd_dpca_chunk_count": 3.0,  # 2 text chunks and the EOS pair
        "train/opd_dpca_coverage": 3 / 4,
        "train/opd_dpca_unmatched_chunk_count": 1.0,
        "train/opd_dpca_too_long_chunk_count": 0.0,
        "train/opd_dpca_student_chunk_len": 1.0,
        "train/opd_dpca_teacher_chunk_len": 2.0,
        "train/opd_dpca_student_chunk_logprob": (-1.0 - 0.5 - 0.1) / 3,
        "train/opd_dpca_teacher_chunk_logprob": (-0.5 - 2.0 - 0.3) / 3,
        "train/opd_teacher_credit": (0.5 - 1.5 - 0.2) / 4,
    }
    for name, value in hand.items():
        torch.testing.assert_close(metrics[name], torch.tensor(value, dtype=F64), msg=name)


def test_nothing_of_the_text_reaches_the_teacher(byte_bpe: Any, smollm2: Any) -> None:
    # SmolLM2 drops every character of '\x16\x04': one unmatched chunk, no teacher token at all.
    s_ids = _ids(byte_bpe, "\x16\x04")
    chunks, _, t_ids, teacher_text = _align(byte_bpe, smollm2, s_ids)
    assert t_ids == [] and teacher_text == ""
    assert chunks == [Chunk(0, 2, 0, 0, 0, 2, "unmatched")]
    credit, stats = dpca_credit(torch.tensor([-1.0, -2.0], dtype=F64), torch.zeros(0, dtype=F64), chunks)
    assert credit.tolist() == [0.0, 0.0]
    assert float(stats.to_metrics()["train/opd_dpca_coverage"]) == 0.0


ALPHABET = [
    *"abc xyz 0 1 2 .,!",
    "the ",
    " dog",
    "\x00",
    "\x16",
    "\x04",
    "\x1b[0m",
    "\t",
    "\n\n",
    "  ",
    "é",
    "ﬁ",
    "①",
    "Ａ",
    "\ufffd",
    "😀",
    "中",
]


@pytest.mark.parametrize(
    ("student", "teacher"), [("byte_bpe", "smollm2"), ("byte_bpe", "unk_bpe"), ("smollm2", "normalising_bpe")]
)
def test_random_student_text_aligns_and_credits_only_matching_text(
    student: str, teacher: str, request: pytest.FixtureRequest
) -> None:
    s_tok, t_tok = request.getfixturevalue(student), request.getfixturevalue(teacher)
    rng = random.Random(f"{student}-{teacher}")
    unmatched_seen = 0
    for _ in range(40):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 24)))
        s_ids = list(s_tok.encode(text, add_special_tokens=False))  # what the student decodes is its text
        chunks, text, t_ids, teacher_text = _align(s_tok, t_tok, s_ids, max_chunk_tokens=8)
        s_off, t_off = token_end_offsets(s_tok, s_ids), token_end_offsets(t_tok, t_ids)
        s_at = t_at = 0  # where the previous chunk ended in each text
        s_next = t_next = 0
        for c in chunks:
            # The chunks tile both token sequences, in order.
            assert (c.student_start, c.teacher_start) == (s_next, t_next)
            s_next, t_next = c.student_end, c.teacher_end
            # A chunk's last token ends at the chunk's end (never inside a character).
            s_end = s_off[c.student_end - 1] if c.student_len else s_at
            t_end = t_off[c.teacher_end - 1] if c.teacher_len else t_at
            assert s_end is not None and t_end is not None
            assert (c.text_start, c.text_end) == (s_at, s_end)
            if c.kind != "unmatched":
                assert text[s_at:s_end] == teacher_text[t_at:t_end] != ""
                assert c.student_len and c.teacher_len
            assert (c.kind == "too_long") == (c.kind != "unmatched" and max(c.student_len, c.teacher_len) > 8)
            s_at, t_at = s_end, t_end
            unmatched_seen += c.kind == "unmatched"
        assert (s_next, t_next, s_at, t_at) == (len(s_ids), len(t_ids), len(text), len(teacher_text))
        if text == teacher_text:
            assert all(c.kind != "unmatched" for c in chunks)
        # Credit: the aligned chunks' sums are their gaps, every other token gets 0.
        student_lp = -torch.rand(len(s_ids), generator=torch.Generator().manual_seed(len(text)), dtype=F64) - 0.1
        teacher_lp = torch.full((len(t_ids),), -0.3, dtype=F64)
        credit, stats = dpca_credit(student_lp, teacher_lp, chunks)
        for c in chunks:
            got = credit[c.student_start : c.student_end]
            if c.kind == "aligned":
                gap = -0.3 * c.teacher_len - student_lp[c.student_start : c.student_end].sum()
                torch.testing.assert_close(got.sum(), gap)
            else:
                assert got.eq(0).all()
        aligned = sum(c.student_len for c in chunks if c.kind == "aligned")
        coverage = stats.to_metrics()["train/opd_dpca_coverage"]
        torch.testing.assert_close(coverage, torch.tensor(aligned / len(s_ids), dtype=F64))
    assert unmatched_seen > 0
