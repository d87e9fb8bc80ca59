"""Cross-tokenizer teacher credit (DPCA): align two tokenizations of one text into chunks, then share
each chunk's teacher-student logprob gap among the student's tokens.

When the teacher does not share the student's tokenizer, per-token comparison is meaningless: the
two models cut the same text into different tokens. Both sides do agree on *text spans*, so the
student's completion (token ids ``s_1..s_n``, decoded to a text) is re-tokenized by the teacher
(``t_1..t_m``, decoding to the same text), and the two tokenizations are cut into **chunks**: the
minimal spans between character offsets where both have a token boundary. A chunk's text is
identical on both sides, so the two models' log-likelihoods of it are comparable:

    L_S(c) = Σ_{t in c} log p_rollout(s_t)          (student rollout logprobs)
    L_T(c) = Σ_{j in c} log p_teacher(t_j)          (teacher logprobs of its own realized tokens)
    A_DPCA(t) = (L_T(c) / L_S(c) - 1) · log p_rollout(s_t)     for each student token t in c

so the chunk's credit sums to ``L_T(c) - L_S(c)``, shared in proportion to each token's share of
``L_S(c)`` (a token the student found surprising takes more of the credit). Credit is built over
the whole completion, then the first ``n_ignore_prefix_tokens`` student tokens are zeroed. It is an
advantage term (``A_policy = A_reward + kl_penalty_coef · A_DPCA``), never differentiated.

Contract with the caller (the teacher role):

* Offsets come from :func:`posttrain.teacher.text_offsets.token_end_offsets`: per token, the
  character offset in the decoded text where it ends, or ``None`` where it ends inside a character
  (a byte-level token holding part of a UTF-8 sequence) and so is no boundary. Both offset lists
  describe the same text; the caller checks that the two decodes are equal before aligning.
* Special tokens are not text: a trailing EOS is stripped from both id lists before computing
  offsets, and the two EOS tokens are paired as their own final chunk (:func:`eos_chunk`), after
  the text chunks. A special token inside the text would decode to its literal name on each side
  and, unless both write it the same way, end in a guard error.
* The alignment guard: a chunk longer than ``max_chunk_tokens`` on either side (a long run where
  the two tokenizations never share a boundary) raises :class:`AlignmentError` instead of being
  force-closed.

Shapes: ``B`` sequences, ``T`` student completion tokens, ``M`` teacher completion tokens, ``C``
chunks (over the whole batch), ``S`` / ``U`` chunked student / teacher tokens.
"""

# Shape-suffixed names (logprobs_BT) are the project convention, not mixedCase.

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from posttrain.algorithm.distillation import TeacherPayloadError
from posttrain.errors import PosttrainError

ZERO_CHUNK_LOGPROB = 1e-6
"""``|L_S(c)|`` at or below this (nats) counts as zero: the student gave the chunk probability
above ``1 - 1e-6``, its tokens' shares ``log p / L_S`` are undefined (or rounding noise), and the
chunk's credit ``L_T - L_S`` is spread equally over its student tokens instead."""


class AlignmentError(PosttrainError):
    """The student and teacher tokenizations of one completion cannot be aligned into chunks."""


@dataclass(frozen=True)
class Chunk:
    """One aligned span: student tokens ``[student_start, student_end)`` and teacher tokens
    ``[teacher_start, teacher_end)`` decode to the text characters ``[text_start, text_end)``."""

    student_start: int
    student_end: int
    teacher_start: int
    teacher_end: int
    text_start: int
    text_end: int

    @property
    def student_len(self) -> int:
        return self.student_end - self.student_start

    @property
    def teacher_len(self) -> int:
        return self.teacher_end - self.teacher_start


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


def _check_chunk(chunk: Chunk, index: int, text: str, max_chunk_tokens: int) -> None:
    if chunk.student_len <= max_chunk_tokens and chunk.teacher_len <= max_chunk_tokens:
        return
    span = text[chunk.text_start : chunk.text_end]
    shown = repr(span) if len(span) <= 200 else repr(span[:200]) + f"... ({len(span)} characters)"
    raise AlignmentError(
        f"DPCA chunk {index} (characters [{chunk.text_start}, {chunk.text_end}), student tokens "
        f"[{chunk.student_start}, {chunk.student_end}), teacher tokens [{chunk.teacher_start}, {chunk.teacher_end})) "
        f"spans {chunk.student_len} student and {chunk.teacher_len} teacher tokens, more than "
        f"max_chunk_tokens={max_chunk_tokens}: the two tokenizations share no boundary inside {shown}. "
        "Raise rl.teacher.dpca_max_chunk_tokens if such text is expected."
    )


def align_chunks(
    student_end_offsets: Sequence[int | None],
    teacher_end_offsets: Sequence[int | None],
    text: str,
    *,
    max_chunk_tokens: int,
) -> list[Chunk]:
    """Cut both tokenizations of ``text`` into minimal chunks with matching text.

    Chunk ends are the character offsets ``> 0`` where both sides have a token boundary; a chunk
    runs from the previous common boundary to the next and takes, on each side, every token up to
    and including the LAST one ending there (a token that decodes to nothing joins the chunk it
    ends in; tokens with a ``None`` offset join the chunk containing their end). Every token of
    both sides lands in exactly one chunk, and the chunks tile the text. An empty text gives one
    chunk holding all tokens when both sides have some, else no chunk.

    Raises :class:`AlignmentError` for offsets that do not describe ``text`` (past its end, or the
    last token not ending at its end) and, naming the chunk, for a chunk with more than
    ``max_chunk_tokens`` tokens on either side (the alignment guard).
    """
    if max_chunk_tokens < 1:
        raise ValueError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
    n_student, n_teacher = len(student_end_offsets), len(teacher_end_offsets)
    if not text:
        return [Chunk(0, n_student, 0, n_teacher, 0, 0)] if n_student and n_teacher else []
    if not n_student or not n_teacher:
        raise AlignmentError(
            f"{n_student} student and {n_teacher} teacher tokens for a {len(text)}-character text: "
            "one side has no tokens"
        )
    student_cuts = _cut_points(student_end_offsets, len(text), "student")
    teacher_cuts = _cut_points(teacher_end_offsets, len(text), "teacher")
    chunks: list[Chunk] = []
    s_start = t_start = x_start = 0
    for x_end in sorted(student_cuts.keys() & teacher_cuts.keys()):
        if x_end == 0:
            continue  # empty leading tokens join the first chunk with text
        chunk = Chunk(s_start, student_cuts[x_end] + 1, t_start, teacher_cuts[x_end] + 1, x_start, x_end)
        _check_chunk(chunk, len(chunks), text, max_chunk_tokens)
        chunks.append(chunk)
        s_start, t_start, x_start = chunk.student_end, chunk.teacher_end, x_end
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
    student_tokens: Tensor
    """Student completion tokens (the coverage denominator)."""
    student_chunk_tokens: Tensor
    """Student tokens inside a chunk."""
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

    def merge(self, other: DpcaStats) -> DpcaStats:
        return DpcaStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def to_metrics(self) -> dict[str, Tensor]:
        """``train/opd_dpca_*`` means (chunk statistics over every chunk, the ignored prefix included)
        and ``train/opd_teacher_credit`` (mean credit per token after the prefix)."""
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
    """Chunks must be ordered, disjoint, non-empty on both sides and inside the sequences."""
    for b, chunks in enumerate(chunks_B):
        s_prev = t_prev = 0
        for i, c in enumerate(chunks):
            ok = s_prev <= c.student_start < c.student_end <= lengths_B[b]
            ok = ok and t_prev <= c.teacher_start < c.teacher_end <= n_teacher
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
    every chunk and the first ``n_ignore_prefix_tokens`` tokens of each sequence get 0.

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
