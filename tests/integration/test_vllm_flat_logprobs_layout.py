"""vLLM's own ``FlatLogprobs`` read as the per-token dicts it replaces: the rollout's sampled
logprobs and heads (``completion_of``) and the teacher's prompt scores (``_flat_scores``) from a
flat container that vLLM's ``append_logprobs_for_next_position`` (what its output processor calls
for every position) filled, against the same positions in vLLM's dict-of-``Logprob`` form read the
way posttrain read it before (the sampled id's entry; the head by rank)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from posttrain.rollout.vllm_requests import completion_of
from posttrain.teacher.base import ScoreRequest
from posttrain.teacher.vllm_teacher import _flat_scores

pytestmark = pytest.mark.vllm

VOCAB, K = 40, 3


def _positions(rng: random.Random, n: int) -> list[tuple[int, list[int], list[float], int]]:
    """Per position: (token, [token, top-K ids], their logprobs, the token's rank), as vLLM's sampler
    lays a row out; every other position's token is drawn from the top K, so both cases occur."""
    rows = []
    for i in range(n):
        values = [rng.uniform(-12.0, 0.0) for _ in range(VOCAB)]
        order = sorted(range(VOCAB), key=lambda t: -values[t])
        token = order[rng.randrange(K)] if i % 2 else order[rng.randrange(K, VOCAB)]
        rank = 1 + sum(v > values[token] for v in values)
        ids = [token, *order[:K]]
        rows.append((token, ids, [values[t] for t in ids], rank))
    return rows


def _fill(container, rows) -> None:  # type: ignore[no-untyped-def]
    from vllm.logprobs import append_logprobs_for_next_position

    for _, ids, values, rank in rows:
        append_logprobs_for_next_position(container, ids, values, iter(lambda: None, 0), rank, K)


def _dict_reading(entries, tokens):  # type: ignore[no-untyped-def]
    sampled = [entry[t].logprob for t, entry in zip(tokens, entries)]
    heads = [sorted(entry.items(), key=lambda item: item[1].rank)[:K] for entry in entries]
    return sampled, [[t for t, _ in h] for h in heads], [[lp.logprob for _, lp in h] for h in heads]


def test_rollout_reads_vllms_flat_logprobs_as_the_dicts_said() -> None:
    from vllm.logprobs import create_sample_logprobs

    rows = _positions(random.Random(0), 12)
    tokens = [r[0] for r in rows]
    flat, dicts = create_sample_logprobs(True), create_sample_logprobs(False)
    _fill(flat, rows)
    _fill(dicts, rows)
    assert type(flat).__name__ == "FlatLogprobs" and isinstance(dicts, list)
    sample = SimpleNamespace(token_ids=tokens, logprobs=flat, finish_reason="stop", stop_reason=None, index=0)
    c = completion_of(0, sample, k=K, record=True)
    sampled, head_ids, head_logprobs = _dict_reading(dicts, tokens)
    assert c.logprobs == sampled
    assert c.extra["head_ids"] == head_ids and c.extra["head_logprobs"] == head_logprobs


def test_teacher_reads_vllms_flat_prompt_logprobs_as_the_dicts_said() -> None:
    from vllm.logprobs import create_prompt_logprobs

    rows = _positions(random.Random(1), 9)
    tokens = [5] + [r[0] for r in rows]  # position 0 (the first prompt token) has no logprob
    flat, dicts = create_prompt_logprobs(True), create_prompt_logprobs(False)
    _fill(flat, rows)
    _fill(dicts, rows)
    req = ScoreRequest(token_ids=tokens, score_from=3)
    scores = _flat_scores(flat, req, top_k=K, n=0)
    sampled, head_ids, head_logprobs = _dict_reading(dicts[3:], tokens[3:])
    assert scores.logprobs == sampled
    assert scores.topk_ids == head_ids and scores.topk_logprobs == head_logprobs
