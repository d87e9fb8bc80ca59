"""The frozen teacher's scoring contract, shared by the transformers and vLLM scorers.

A teacher scores sequences it is given; it never generates and never receives policy weights.
For each request (a full token sequence and the index where scoring starts) it returns, for every
scored position ``i``: the logprob of the realized token ``token_ids[i]`` given ``token_ids[:i]``,
and, when ``top_k > 0``, the ``top_k`` most likely ids at that position with their logprobs, all
from the full-vocabulary softmax at temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from posttrain.errors import PosttrainError


class TeacherError(PosttrainError):
    """Teacher scoring failed for a whole batch (after its bounded retries)."""


@dataclass(frozen=True)
class ScoreRequest:
    """One sequence to score: positions ``score_from .. len(token_ids) - 1`` are scored."""

    token_ids: list[int]
    score_from: int


@dataclass
class SequenceScores:
    """Teacher scores of one request's scored positions (one entry per scored token)."""

    logprobs: list[float]
    """Teacher logprob of each realized token."""
    topk_ids: list[list[int]] | None = None
    """Per scored position, the teacher's ``top_k`` most likely ids (best first)."""
    topk_logprobs: list[list[float]] | None = None
    """Their logprobs."""
    prompt_ids: list[int] | None = None
    """The prompt the engine actually scored, image placeholders expanded (a multimodal request,
    ``teacher/multimodal.py``, is checked against it); None for a text request."""


class Teacher(Protocol):
    """A frozen scorer."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int | None

    def score(self, requests: list[ScoreRequest], top_k: int) -> list[SequenceScores]:
        """Scores of every request, in order; raises on any failure (the caller retries the batch)."""
        ...


def check_requests(requests: list[ScoreRequest], vocab_size: int, max_model_len: int | None) -> None:
    """Refuse requests no scorer can answer: nothing to score, ids outside the vocabulary, too long."""
    for n, req in enumerate(requests):
        if not 0 < req.score_from < len(req.token_ids):
            raise TeacherError(
                f"teacher request {n}: score_from={req.score_from} must lie inside its {len(req.token_ids)} tokens "
                "(a non-empty prompt and at least one completion token)"
            )
        if max_model_len is not None and len(req.token_ids) > max_model_len:
            raise TeacherError(
                f"teacher request {n} has {len(req.token_ids)} tokens > rl.teacher.max_model_len={max_model_len}"
            )
        bad = [t for t in req.token_ids if not 0 <= t < vocab_size]
        if bad:
            raise TeacherError(
                f"teacher request {n} holds ids outside the teacher vocabulary ({vocab_size}): {bad[:4]}"
            )
