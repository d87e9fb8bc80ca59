"""Cross-tokenizer teacher credit (DPCA): align two tokenizations of one text into chunks, then share
each chunk's teacher-student logprob gap among the student's tokens.

When the teacher does not share the student's tokenizer, per-token comparison is meaningless: the
two models cut the same text into different tokens. Both sides do agree on *text spans*, so the
student's completion (token ids ``s_1..s_n``, decoded to a text) is re-tokenized by the teacher
(``t_1..t_m``), and the two tokenizations are cut into **chunks**: the minimal spans between
character offsets where both have a token boundary. An *aligned* chunk's text is identical on both
sides, so the two models' log-likelihoods of it are comparable:

    L_S(c) = Σ_{t in c} log p_rollout(s_t)          (student rollout logprobs)
    L_T(c) = Σ_{j in c} log p_teacher(t_j)          (teacher logprobs of its own realized tokens)
    A_DPCA(t) = (L_T(c) / L_S(c) - 1) · log p_rollout(s_t)     for each student token t in c

so the chunk's credit sums to ``L_T(c) - L_S(c)``, shared in proportion to each token's share of
``L_S(c)`` (a token the student found surprising takes more of the credit). Credit is built over
the whole completion, then the first ``n_ignore_prefix_tokens`` student tokens are zeroed. It is an
advantage term (``A_policy = A_reward + kl_penalty_coef · A_DPCA``), never differentiated.

The teacher's decode of its tokens need not reproduce the student's text: a student samples any
text, and a teacher tokenizer may drop a control character it has no token for, spell it as its
unknown token, or normalise the text (NFKC, collapsed whitespace). The two texts are then aligned
by a shortest edit script (Myers, "An O(ND) difference algorithm", 1986) after their common prefix
and suffix, and a chunk that is not text-identical on that alignment is **unmatched**: it gets no
credit, the chunks around it keep theirs, and it lowers ``train/opd_dpca_coverage`` and counts in
``train/opd_dpca_unmatched_chunk_count``. The alignment guard likewise rejects a chunk longer than
``max_chunk_tokens`` on either side (a long run where the two tokenizations never share a
boundary): it is kept whole and gets no credit (``too_long``), never force-closed into pieces.

Contract with the caller (the teacher role):

* Offsets come from :func:`posttrain.teacher.text_offsets.token_end_offsets`: per token, the
  character offset in its side's decoded text where it ends, or ``None`` where it ends inside a
  character (a byte-level token holding part of a UTF-8 sequence) and so is no boundary.
* Special tokens are not text: a trailing EOS is stripped from both id lists before computing
  offsets, and the two EOS tokens are paired as their own final chunk (:func:`eos_chunk`), after
  the text chunks. A special token inside the text decodes to its literal name on each side, and
  where the two names differ it is an unmatched stretch like any other.

Shapes: ``B`` sequences, ``T`` student completion tokens, ``M`` teacher completion tokens, ``C``
chunks (over the whole batch), ``S`` / ``U`` chunked student / teacher tokens.
"""

# Shape-suffixed names (logprobs_BT) are the project convention, not mixedCase.

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor

from posttrain.algorithm.distillation import TeacherPayloadError
from posttrain.errors import PosttrainError

ZERO_CHUNK_LOGPROB = 1e-6
"""``|L_S(c)|`` at or below this (nats) counts as zero: the student gave the chunk probability
above ``1 - 1e-6``, its tokens' shares ``log p / L_S`` are undefined (or rounding noise), and the
chunk's credit ``L_T - L_S`` is spread equally over its student tokens instead."""

MAX_TEXT_EDITS = 512
"""Edits (characters dropped or inserted) the text alignment searches before it gives up; beyond
it, the stretch between the two texts' common prefix and suffix is one unmatched chunk."""

MAX_ALIGNMENT_STEPS = 2_000_000
"""Work bound of the text alignment (diagonal steps and character comparisons), same fallback:
the alignment of one completion never takes much more than a second, whatever the text."""

ChunkKind = Literal["aligned", "unmatched", "too_long"]


class AlignmentError(PosttrainError):
    """Offsets or chunks that do not describe the completion (a caller bug, never the sampled text)."""


@dataclass(frozen=True)
class Chunk:
    """One span of the alignment: student tokens ``[student_start, student_end)`` and teacher tokens
    ``[teacher_start, teacher_end)``, covering the student text's characters ``[text_start, text_end)``.

    ``kind``: ``aligned`` (both sides decode to that same text; the only kind that gets credit),
    ``unmatched`` (the teacher's text differs there; one side may hold no token) or ``too_long``
    (aligned, but over the alignment guard)."""

    student_start: int
    student_end: int
    teacher_start: int
    teacher_end: int
    text_start: int
    text_end: int
    kind: ChunkKind = "aligned"

    @property
    def student_len(self) -> int:
        return self.student_end - self.student_start

    @property
    def teacher_len(self) -> int:
        return self.teacher_end - self.teacher_start


# ----------------------------------------------------------------------------------------------
# Text alignment (only when the teacher's text differs from the student's)
# ----------------------------------------------------------------------------------------------

Block = tuple[int, int, int]
"""``(i, j, n)``: ``a[i:i+n] == b[j:j+n]`` on the alignment."""


def _shortest_edit_blocks(a: str, b: str) -> list[Block] | None:
    """The matched characters of a shortest edit script from ``a`` to ``b`` as length-1 blocks (Myers'
    greedy forward search, its trace kept for the backtrack), or ``None`` past ``MAX_TEXT_EDITS`` /
    ``MAX_ALIGNMENT_STEPS``."""
    n, m = len(a), len(b)
    off = MAX_TEXT_EDITS + 1
    v = [0] * (2 * off + 1)  # v[off + k]: furthest x reached on diagonal k = x - y
    trace: list[list[int]] = []
    steps = 0
    for d in range(MAX_TEXT_EDITS + 1):
        trace.append(v[:])
        for k in range(-d, d + 1, 2):
            down = k == -d or (k != d and v[off + k - 1] < v[off + k + 1])
            x = v[off + k + 1] if down else v[off + k - 1] + 1
            y, x_start = x - k, x
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            steps += 1 + x - x_start
            v[off + k] = x
            if x >= n and y >= m:
                return _backtrack(trace, n, m, off)
        if steps > MAX_ALIGNMENT_STEPS:
            return None
    return None


def _backtrack(trace: list[list[int]], n: int, m: int, off: int) -> list[Block]:
    x, y = n, m
    diagonal: list[Block] = []  # the matched characters, last first
    for d in range(len(trace) - 1, -1, -1):
        v, k = trace[d], x - y
        down = k == -d or (k != d and v[off + k - 1] < v[off + k + 1])
        prev_k = k + 1 if down else k - 1
        prev_x = v[off + prev_k] if d > 0 else 0
        prev_y = prev_x - prev_k if d > 0 else 0
        while x > prev_x and y > prev_y:
            x, y = x - 1, y - 1
            diagonal.append((x, y, 1))
        x, y = prev_x, prev_y
    return diagonal[::-1]  # one block per matched character; the caller merges them


def text_blocks(a: str, b: str) -> list[Block]:
    """Monotone equal blocks aligning text ``a`` to text ``b``, in order, adjacent ones merged: the
    common prefix, a shortest edit script of what lies between, the common suffix. When the middle
    needs more than ``MAX_TEXT_EDITS`` edits, it stays one unaligned stretch."""
    prefix = 0
    limit = min(len(a), len(b))
    while prefix < limit and a[prefix] == b[prefix]:
        prefix += 1
    suffix = 0
    while suffix < limit - prefix and a[-1 - suffix] == b[-1 - suffix]:
        suffix += 1
    end_a, end_b = len(a) - suffix, len(b) - suffix
    middle = _shortest_edit_blocks(a[prefix:end_a], b[prefix:end_b]) or []
    raw = [(0, 0, prefix), *((i + prefix, j + prefix, k) for i, j, k in middle), (end_a, end_b, suffix)]
    blocks: list[Block] = []
    for i, j, k in raw:
        if k == 0:
            continue
        if blocks and blocks[-1][0] + blocks[-1][2] == i and blocks[-1][1] + blocks[-1][2] == j:
            blocks[-1] = (blocks[-1][0], blocks[-1][1], blocks[-1][2] + k)
        else:
            blocks.append((i, j, k))
    return blocks


# ----------------------------------------------------------------------------------------------
# Alignment
# ----------------------------------------------------------------------------------------------


def _cut_points(end_offsets: Sequence[int | None], text_length: int, side: str) -> dict[int, int]:
    """``{character offset: index of the LAST token ending there}`` over the usable boundaries.

    An offset below an earlier token's end is no usable cut (the earlier token's text would cross
    it) and is skipped. The last token must end at the end of the text, else the offsets are not
    of this text.
    """
    cuts: dict[int, int] = {}
    high = 0
    for index, offset in enumerate(end_offsets):
        if offset is None or offset < high:
            continue
        if offset > text_length:
            raise AlignmentError(f"{side} token {index} ends at character {offset}, past the text's end {text_length}")
        cuts[offset] = index
        high = offset
    if end_offsets and end_offsets[-1] != text_length:
        raise AlignmentError(
            f"the last {side} token ends at {end_offsets[-1]}, not at the end of the text ({text_length} characters): "
            "the offsets do not describe this text"
        )
    return cuts


def _anchors(text: str, teacher_text: str) -> tuple[list[tuple[int, int]], list[int]]:
    """Every pair ``(p, q)`` of corresponding positions (student text, teacher text) in order, with
    the block each lies in (``-1``: only the two texts' ends, which always correspond)."""
    if text == teacher_text:
        return [(p, p) for p in range(len(text) + 1)], [0] * (len(text) + 1)
    anchors: list[tuple[int, int]] = []
    block_of: list[int] = []
    for n, (i, j, k) in enumerate(text_blocks(text, teacher_text)):
        for step in range(k + 1):
            anchors.append((i + step, j + step))
            block_of.append(n)
    if not anchors or anchors[-1] != (len(text), len(teacher_text)):
        anchors.append((len(text), len(teacher_text)))
        block_of.append(-1)
    return anchors, block_of


def align_chunks(
    student_end_offsets: Sequence[int | None],
    teacher_end_offsets: Sequence[int | None],
    text: str,
    *,
    max_chunk_tokens: int,
    teacher_text: str | None = None,
) -> list[Chunk]:
    """Cut both tokenizations into minimal chunks; ``teacher_text`` (default: ``text``) is what the
    teacher's tokens decode to, ``text`` the student's.

    Chunk ends are the corresponding positions (:func:`text_blocks`) ``> 0`` where both sides have a
    token boundary, plus the two texts' ends; a chunk runs from the previous one to the next and
    takes, on each side, every token up to and including the LAST one ending there (a token that
    decodes to nothing joins the chunk it ends in; tokens with a ``None`` offset join the chunk
    containing their end). Every token of both sides lands in exactly one chunk, in order. A chunk
    inside one equal block of the alignment is ``aligned`` (``too_long`` past ``max_chunk_tokens``
    on either side), any other ``unmatched``. An empty text gives one chunk holding all tokens when
    both sides have some, else none.

    Raises :class:`AlignmentError` for offsets that do not describe their text (past its end, or
    the last token not ending at its end).
    """
    if max_chunk_tokens < 1:
        raise ValueError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
    teacher_text = text if teacher_text is None else teacher_text
    n_student, n_teacher = len(student_end_offsets), len(teacher_end_offsets)
    if not text and not teacher_text:
        return [Chunk(0, n_student, 0, n_teacher, 0, 0)] if n_student and n_teacher else []
    if (not n_student and text) or (not n_teacher and teacher_text):
        side = "student" if not n_student and text else "teacher"
        raise AlignmentError(f"the {side} side has no tokens for a non-empty text: the offsets do not describe it")
    student_cuts = _cut_points(student_end_offsets, len(text), "student")
    teacher_cuts = _cut_points(teacher_end_offsets, len(teacher_text), "teacher")
    # The start of a text is a boundary of its side even where no (empty) token ends there: a
    # stretch only one text has at its start is then a chunk of its own, not merged with the next.
    student_cuts.setdefault(0, -1)
    teacher_cuts.setdefault(0, -1)
    anchors, block_of = _anchors(text, teacher_text)
    chunks: list[Chunk] = []
    s_start = t_start = x_start = 0
    start_block = block_of[0] if anchors[0] == (0, 0) else -1
    for (p, q), block in zip(anchors, block_of, strict=True):
        if (p, q) == (0, 0) or p not in student_cuts or q not in teacher_cuts:
            continue
        s_end, t_end = student_cuts[p] + 1, teacher_cuts[q] + 1
        kind: ChunkKind = "aligned" if block >= 0 and block == start_block else "unmatched"
        if kind == "aligned" and max(s_end - s_start, t_end - t_start) > max_chunk_tokens:
            kind = "too_long"
        chunks.append(Chunk(s_start, s_end, t_start, t_end, x_start, p, kind))
        s_start, t_start, x_start, start_block = s_end, t_end, p, block
    return chunks


def eos_chunk(student_index: int, teacher_index: int, text_length: int) -> Chunk:
    """The final chunk pairing the student's EOS token (index ``student_index``, just after its
    text tokens) with the teacher's (``teacher_index``); it covers no text. Append it after
    :func:`align_chunks` when the completion ended with EOS."""
    return Chunk(student_index, student_index + 1, teacher_index, teacher_index + 1, text_length, text_length)


# ----------------------------------------------------------------------------------------------
# Credit
# ----------------------------------------------------------------------------------------------


@dataclass
class DpcaStats:
    """Detached 0-dim tensors in SUM form over sequences; add micro-batches / ranks with
    :meth:`merge` (all-reduce SUM across ranks), then :meth:`to_metrics` once."""

    sequences: Tensor
    chunks: Tensor
    """Aligned chunks (the ones that get credit); the ``*_chunk_*`` fields below are over those only."""
    student_tokens: Tensor
    """Student completion tokens (the coverage denominator)."""
    student_chunk_tokens: Tensor
    """Student tokens inside an aligned chunk."""
    teacher_chunk_tokens: Tensor
    student_chunk_logprob_sum: Tensor
    """Σ over chunks of ``L_S(c)``."""
    teacher_chunk_logprob_sum: Tensor
    """Σ over chunks of ``L_T(c)``."""
    chunk_gap_sum: Tensor
    """Σ over chunks of ``L_S(c) - L_T(c)``."""
    zero_logprob_chunks: Tensor
    """Chunks whose ``L_S`` counted as zero (credit spread equally)."""
    credit_sum: Tensor
    """Σ of the final credit (after the prefix is zeroed)."""
    credit_tokens: Tensor
    """Student tokens after the ignored prefix."""
    unmatched_chunks: Tensor
    """Chunks where the teacher's text differs from the student's (no credit)."""
    too_long_chunks: Tensor
    """Chunks rejected by the alignment guard (no credit)."""

    def merge(self, other: DpcaStats) -> DpcaStats:
        return DpcaStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def to_metrics(self) -> dict[str, Tensor]:
        """``train/opd_dpca_*`` means (chunk statistics over every aligned chunk, the ignored prefix
        included; the coverage is the share of student tokens inside one; the rejected-chunk counts
        per sequence) and ``train/opd_teacher_credit`` (mean credit per token after the prefix)."""
        chunks = self.chunks.clamp_min(1.0)
        return {
            "train/opd_dpca_chunk_count": self.chunks / self.sequences.clamp_min(1.0),
            "train/opd_dpca_student_chunk_len": self.student_chunk_tokens / chunks,
            "train/opd_dpca_teacher_chunk_len": self.teacher_chunk_tokens / chunks,
            "train/opd_dpca_coverage": self.student_chunk_tokens / self.student_tokens.clamp_min(1.0),
            "train/opd_dpca_student_chunk_logprob": self.student_chunk_logprob_sum / chunks,
            "train/opd_dpca_teacher_chunk_logprob": self.teacher_chunk_logprob_sum / chunks,
            "train/opd_dpca_chunk_gap": self.chunk_gap_sum / chunks,
            "train/opd_dpca_zero_logprob_chunk_frac": self.zero_logprob_chunks / chunks,
            "train/opd_dpca_unmatched_chunk_count": self.unmatched_chunks / self.sequences.clamp_min(1.0),
            "train/opd_dpca_too_long_chunk_count": self.too_long_chunks / self.sequences.clamp_min(1.0),
            "train/opd_teacher_credit": self.credit_sum / self.credit_tokens.clamp_min(1.0),
        }


def _token_index(chunks_B: Sequence[Sequence[Chunk]], side: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(row_S, col_S, chunk_S, len_C)`` for one side: the (sequence, token) of every chunked token,
    its batch-global chunk index, and each chunk's token count (CPU, built from host integers)."""
    rows, starts, lens = [], [], []
    for b, chunks in enumerate(chunks_B):
        for c in chunks:
            rows.append(b)
            starts.append(c.student_start if side == "student" else c.teacher_start)
            lens.append(c.student_len if side == "student" else c.teacher_len)
    len_C = torch.tensor(lens, dtype=torch.long)
    chunk_S = torch.repeat_interleave(torch.arange(len(lens)), len_C)
    first_S = torch.repeat_interleave(torch.cumsum(len_C, 0) - len_C, len_C)
    col_S = torch.tensor(starts, dtype=torch.long)[chunk_S] + torch.arange(chunk_S.numel()) - first_S
    return torch.tensor(rows, dtype=torch.long)[chunk_S], col_S, chunk_S, len_C


def _check_chunks(chunks_B: Sequence[Sequence[Chunk]], lengths_B: Sequence[int], n_teacher: int) -> None:
    """Chunks must be ordered, disjoint and inside the sequences; an aligned chunk non-empty on both
    sides, any other on at least one."""
    for b, chunks in enumerate(chunks_B):
        s_prev = t_prev = 0
        for i, c in enumerate(chunks):
            ok = s_prev <= c.student_start <= c.student_end <= lengths_B[b]
            ok = ok and t_prev <= c.teacher_start <= c.teacher_end <= n_teacher
            if c.kind == "aligned":
                ok = ok and c.student_len > 0 and c.teacher_len > 0
            else:
                ok = ok and c.student_len + c.teacher_len > 0
            if not ok:
                raise AlignmentError(
                    f"sequence {b}, chunk {i} {c} is empty, out of order or outside the sequence "
                    f"({lengths_B[b]} student tokens, at most {n_teacher} teacher tokens)"
                )
            s_prev, t_prev = c.student_end, c.teacher_end


def _check_finite(values_S: Tensor, row_S: Tensor, col_S: Tensor, side: str) -> None:
    """One host sync per side; on failure, name the first non-finite token."""
    bad_S = ~torch.isfinite(values_S)
    if not bool(bad_S.any()):
        return
    i = int(torch.nonzero(bad_S)[0, 0])
    message = (
        f"non-finite {side} logprob {float(values_S[i])} at sequence {int(row_S[i])}, token {int(col_S[i])} "
        "inside a DPCA chunk"
    )
    raise TeacherPayloadError(message) if side == "teacher" else ValueError(message)


def dpca_credit_batch(
    student_logprobs_BT: Tensor,
    teacher_logprobs_BM: Tensor,
    chunks_B: Sequence[Sequence[Chunk]],
    n_ignore_prefix_tokens: int = 0,
    *,
    student_lengths_B: Sequence[int] | None = None,
) -> tuple[Tensor, DpcaStats]:
    """Per-token DPCA credit ``credit_BT`` for a padded batch, and its stats.

    ``student_logprobs_BT``: rollout logprobs of the student's completion tokens; ``teacher_logprobs_BM``:
    the teacher's logprobs of its own realized completion tokens; ``chunks_B[b]`` the chunks of
    sequence ``b`` (:func:`align_chunks`, plus :func:`eos_chunk`); ``student_lengths_B`` the real
    completion lengths (default: ``T`` each), for coverage. Padding is never read. Tokens outside
    every aligned chunk (in an ``unmatched`` or ``too_long`` one, or in none) and the first
    ``n_ignore_prefix_tokens`` tokens of each sequence get 0; nothing outside the aligned chunks is
    read, so a teacher logprob there may be anything.

    In chunk ``c`` the credit is ``(L_T/L_S - 1)·log p(t)``, computed as the identical
    ``(L_T - L_S)·(log p(t) / L_S)``; when ``|L_S| <= ZERO_CHUNK_LOGPROB`` it is ``(L_T - L_S)/n_c``
    for each of the chunk's ``n_c`` tokens. Either way the chunk's credits sum to ``L_T - L_S``.
    Inputs are detached (credit is an advantage). Raises on a non-finite logprob inside a chunk
    (one host sync per side: this runs once per batch in the loop, not in the backward).
    """
    if n_ignore_prefix_tokens < 0:
        raise ValueError(f"n_ignore_prefix_tokens must be >= 0, got {n_ignore_prefix_tokens}")
    n_seq, n_tok = student_logprobs_BT.shape
    if len(chunks_B) != n_seq or teacher_logprobs_BM.shape[0] != n_seq:
        raise ValueError(
            f"{len(chunks_B)} chunk lists and teacher logprobs {tuple(teacher_logprobs_BM.shape)} for "
            f"{n_seq} student sequences"
        )
    lengths_B = list(student_lengths_B) if student_lengths_B is not None else [n_tok] * n_seq
    _check_chunks(chunks_B, lengths_B, teacher_logprobs_BM.shape[1])
    rejected = {kind: sum(c.kind == kind for chunks in chunks_B for c in chunks) for kind in ("unmatched", "too_long")}
    chunks_B = [[c for c in chunks if c.kind == "aligned"] for chunks in chunks_B]
    device = student_logprobs_BT.device
    dtype = torch.promote_types(student_logprobs_BT.dtype, torch.float32)
    s_row_S, s_col_S, s_chunk_S, s_len_C = (x.to(device) for x in _token_index(chunks_B, "student"))
    t_row_U, t_col_U, t_chunk_U, _ = (x.to(device) for x in _token_index(chunks_B, "teacher"))
    s_S = student_logprobs_BT.detach()[s_row_S, s_col_S].to(dtype)
    t_U = teacher_logprobs_BM.detach()[t_row_U, t_col_U].to(dtype)
    _check_finite(s_S, s_row_S, s_col_S, "student")
    _check_finite(t_U, t_row_U, t_col_U, "teacher")

    n_chunks = s_len_C.numel()
    ls_C = torch.zeros(n_chunks, dtype=dtype, device=device).index_add_(0, s_chunk_S, s_S)
    lt_C = torch.zeros(n_chunks, dtype=dtype, device=device).index_add_(0, t_chunk_U, t_U)
    zero_C = ls_C.abs() <= ZERO_CHUNK_LOGPROB
    safe_ls_C = torch.where(zero_C, torch.ones_like(ls_C), ls_C)
    share_S = torch.where(zero_C[s_chunk_S], 1.0 / s_len_C[s_chunk_S].to(dtype), s_S / safe_ls_C[s_chunk_S])
    credit_S = (lt_C - ls_C)[s_chunk_S] * share_S
    credit_S = torch.where(s_col_S < n_ignore_prefix_tokens, torch.zeros_like(credit_S), credit_S)
    credit_BT = torch.zeros((n_seq, n_tok), dtype=dtype, device=device).index_put_((s_row_S, s_col_S), credit_S)

    def scalar(x: float | Tensor) -> Tensor:
        return torch.as_tensor(x, dtype=dtype, device=device)

    stats = DpcaStats(
        sequences=scalar(n_seq),
        chunks=scalar(n_chunks),
        student_tokens=scalar(sum(lengths_B)),
        student_chunk_tokens=scalar(s_chunk_S.numel()),
        teacher_chunk_tokens=scalar(t_chunk_U.numel()),
        student_chunk_logprob_sum=ls_C.sum(),
        teacher_chunk_logprob_sum=lt_C.sum(),
        chunk_gap_sum=(ls_C - lt_C).sum(),
        zero_logprob_chunks=zero_C.to(dtype).sum(),
        credit_sum=credit_S.sum(),
        credit_tokens=scalar(sum(max(0, n - n_ignore_prefix_tokens) for n in lengths_B)),
        unmatched_chunks=scalar(rejected["unmatched"]),
        too_long_chunks=scalar(rejected["too_long"]),
    )
    return credit_BT, stats


def dpca_credit(
    student_logprobs_T: Tensor,
    teacher_logprobs_M: Tensor,
    chunks: Sequence[Chunk],
    n_ignore_prefix_tokens: int = 0,
) -> tuple[Tensor, DpcaStats]:
    """:func:`dpca_credit_batch` for one sequence: ``credit_T`` and its stats."""
    credit_1T, stats = dpca_credit_batch(
        student_logprobs_T[None], teacher_logprobs_M[None], [chunks], n_ignore_prefix_tokens
    )
    return credit_1T[0], stats
