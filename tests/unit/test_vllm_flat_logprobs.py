"""Reading vLLM's flat logprobs: the rollout's sampled-token logprobs and top-k heads
(``rollout/vllm_requests.completion_of``) and the vLLM teacher's prompt scores
(``teacher/vllm_teacher._flat_scores``).

vLLM is not imported here (unit tests run without it): ``Flat`` lays the lists out as vLLM's
``FlatLogprobs.append_fast`` does, each position's run the sampled (or realized) token first, then
the top k by rank. ``tests/integration/test_vllm_flat_logprobs_layout.py`` checks that layout
against vLLM's own class and the function its output processor calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from posttrain.errors import TrainingError
from posttrain.rollout.vllm_requests import completion_of
from posttrain.teacher.base import ScoreRequest, TeacherError
from posttrain.teacher.vllm_teacher import _flat_scores


@dataclass
class Flat:
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def add(self, pairs: list[tuple[int, float]]) -> Flat:
        self.start_indices.append(len(self.token_ids))
        self.token_ids += [t for t, _ in pairs]
        self.logprobs += [v for _, v in pairs]
        self.end_indices.append(len(self.token_ids))
        return self

    def __len__(self) -> int:
        return len(self.start_indices)


def _sample(token_ids: list[int], logprobs: object) -> SimpleNamespace:
    return SimpleNamespace(token_ids=token_ids, logprobs=logprobs, finish_reason="length", stop_reason=None, index=0)


def test_sampled_logprobs_are_the_first_entry_of_each_position() -> None:
    flat = Flat().add([(5, -0.5)]).add([(9, -1.25)]).add([(2, -3.0)])
    c = completion_of(3, _sample([5, 9, 2], flat), k=0, record=True)
    assert (c.prompt_index, c.token_ids, c.logprobs, c.extra) == (3, [5, 9, 2], [-0.5, -1.25, -3.0], {})


def test_heads_are_the_top_k_after_the_sampled_token_whether_or_not_it_is_among_them() -> None:
    # position 0: the sampled 7 is outside the top 2; position 1: the sampled 4 is the top 1 (listed twice)
    flat = Flat().add([(7, -4.0), (1, -0.1), (2, -0.9)]).add([(4, -0.2), (4, -0.2), (8, -2.5)])
    c = completion_of(0, _sample([7, 4], flat), k=2, record=True)
    assert c.logprobs == [-4.0, -0.2]
    assert c.extra == {"head_ids": [[1, 2], [4, 8]], "head_logprobs": [[-0.1, -0.9], [-0.2, -2.5]]}


def test_logprobs_of_other_tokens_than_the_sampled_ones_are_refused() -> None:
    flat = Flat().add([(5, -0.5)]).add([(6, -1.0)])
    with pytest.raises(TrainingError, match="other tokens than the ones it sampled"):
        completion_of(0, _sample([5, 9], flat), k=0, record=True)
    head = Flat().add([(5, -0.5), (5, -0.5)]).add([(6, -1.0), (3, -0.3)])
    with pytest.raises(TrainingError, match="other tokens than the ones it sampled"):
        completion_of(0, _sample([5, 9], head), k=1, record=True)


def test_a_head_of_the_wrong_width_and_dict_logprobs_are_refused() -> None:
    short = Flat().add([(5, -0.5), (1, -0.1)]).add([(6, -1.0)])
    with pytest.raises(TrainingError, match="head of other than 1 tokens"):
        completion_of(0, _sample([5, 6], short), k=1, record=True)
    dicts = [{5: SimpleNamespace(logprob=-0.5, rank=1)}]
    with pytest.raises(TrainingError, match="list logprobs, not the flat ones"):
        completion_of(0, _sample([5], dicts), k=0, record=True)


def test_an_unrecorded_sample_has_no_logprobs() -> None:
    c = completion_of(1, _sample([5, 9], None), k=0, record=False)
    assert c.logprobs is None and c.token_ids == [5, 9]


def _prompt_flat(runs: list[list[tuple[int, float]]]) -> Flat:
    flat = Flat()
    flat.start_indices.append(0)  # position 0 has no logprob (vLLM appends None first)
    flat.end_indices.append(0)
    for run in runs:
        flat.add(run)
    return flat


def test_teacher_scores_read_the_realized_tokens_and_heads_from_score_from_on() -> None:
    req = ScoreRequest(token_ids=[11, 12, 13, 14], score_from=2)
    flat = _prompt_flat(
        [
            [(12, -9.0), (3, -0.1), (4, -0.2)],  # position 1, before score_from: not read
            [(13, -0.7), (13, -0.7), (5, -1.1)],
            [(14, -2.0), (6, -0.3), (7, -0.4)],
        ]
    )
    s = _flat_scores(flat, req, top_k=2, n=0)
    assert s.logprobs == [-0.7, -2.0]
    assert s.topk_ids == [[13, 5], [6, 7]] and s.topk_logprobs == [[-0.7, -1.1], [-0.3, -0.4]]
    bare = _flat_scores(_prompt_flat([[(12, -9.0)], [(13, -0.7)], [(14, -2.0)]]), req, top_k=0, n=0)
    assert bare.logprobs == [-0.7, -2.0] and bare.topk_ids is None and bare.topk_logprobs is None


def test_teacher_scores_of_other_tokens_or_widths_are_refused() -> None:
    req = ScoreRequest(token_ids=[11, 12, 13], score_from=1)
    with pytest.raises(TeacherError, match="request 4: vLLM's prompt logprobs name other tokens"):
        _flat_scores(_prompt_flat([[(12, -1.0)], [(99, -1.0)]]), req, top_k=0, n=4)
    with pytest.raises(TeacherError, match="request 4: vLLM returned other than 2 prompt logprobs"):
        _flat_scores(_prompt_flat([[(12, -1.0), (1, -0.5)], [(13, -1.0)]]), req, top_k=1, n=4)
    with pytest.raises(TeacherError, match="request 4: vLLM returned list prompt logprobs, not flat ones"):
        _flat_scores([None, {}, {}], req, top_k=0, n=4)
