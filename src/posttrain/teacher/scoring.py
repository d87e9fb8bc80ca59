"""From a collected batch to the teacher's training signal: requests, bounded retries, credit.

One call of ``TeacherSignals.score`` turns the student's completions into teacher requests (the
student's own ids for a same-vocabulary teacher; the teacher's rendering of the prompt plus its own
tokenization of the completion text for a cross-tokenizer one), scores them all-or-nothing with a
bounded number of attempts (an engine error or an invalid payload fails the attempt, never one
sequence), and returns per completion either the teacher's top-k (direct mode) or a per-token
credit (advantage mode), with the spec's ``train/opd_*`` metrics. Nothing reaches the trainer
until the whole batch is valid. In the ``*_multimodal`` modes the teacher's prefix is its own
rendering of the prompt with its images (``teacher/multimodal.py``), and the prompt the engine
scored is checked against it before any signal exists.

The student's text is whatever it sampled (control characters, replacement characters for invalid
UTF-8), and a cross-tokenizer teacher need not reproduce it: its tokenizer may drop a character,
spell it as its unknown token or normalise the text. That is no failure (a retry would meet the
same text): DPCA aligns the two texts and gives no credit where they differ
(:mod:`posttrain.algorithm.dpca`), which the ``train/opd_dpca_*`` coverage metrics count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.algorithm.distillation import TeacherPayloadError, validate_teacher_topk
from posttrain.algorithm.dpca import Chunk, DpcaStats, align_chunks, dpca_credit, eos_chunk
from posttrain.config.opd import OPDConfig
from posttrain.distributed.world import any_rank
from posttrain.rollout.base import Completion, RolloutBatch
from posttrain.teacher.base import ScoreRequest, SequenceScores, Teacher, TeacherError
from posttrain.teacher.multimodal import media_renderer, verify_media_scores
from posttrain.teacher.render import render_teacher_prefix
from posttrain.teacher.text_offsets import token_end_offsets

_log = logging.getLogger("posttrain.teacher")
# What fails one scoring attempt (never one sequence): an engine error or an invalid payload.
_ATTEMPT_ERRORS = (TeacherError, TeacherPayloadError, RuntimeError, ValueError)


@dataclass
class CrossTokenView:
    """One completion as the cross-tokenizer teacher sees it."""

    student_body: list[int]
    """The student's completion ids without a trailing EOS."""
    teacher_body: list[int]
    """The teacher's tokenization of the same text."""
    text: str
    """The student's decode of ``student_body``."""
    teacher_text: str
    """The teacher's decode of ``teacher_body``: ``text`` unless its tokenizer changed something."""
    has_eos: bool
    """The student's completion ended with its EOS."""
    teacher_eos: bool = False
    """The teacher's EOS follows ``teacher_body`` in the request (paired with the student's)."""
    request_index: int | None = None
    """Its request in the batch; ``None`` when the teacher had no token of it to score."""


@dataclass
class TeacherSignal:
    """The teacher's contribution to one collected batch."""

    topk_ids: list[list[list[int]]] | None = None
    topk_logprobs: list[list[list[float]]] | None = None
    credit: list[list[float]] | None = None
    """Per completion, per student token, the teacher credit before ``kl_penalty_coef``."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ScoreCounters:
    """Teacher attempts of one step (the spec's request / success / failure counts)."""

    request: int = 0
    success: int = 0
    failure: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "train/opd_teacher_score_request_count": float(self.request),
            "train/opd_teacher_score_success_count": float(self.success),
            "train/opd_teacher_score_failure_count": float(self.failure),
        }


class TeacherSignals:
    """Builds the teacher signal of each collected batch for one configured teacher."""

    def __init__(self, cfg: OPDConfig, teacher: Teacher, student_tokenizer: Any, student_vocab_size: int) -> None:
        self.cfg = cfg
        self.teacher = teacher
        self.student_tokenizer = student_tokenizer
        self.student_vocab_size = student_vocab_size
        self.cross = cfg.rl.teacher.input_mode in ("cross_token_text", "cross_token_multimodal")
        # the *_multimodal modes: the teacher renders its own image prefix (teacher/multimodal.py)
        self.media = media_renderer(cfg, teacher, student_tokenizer)
        teacher_eos = _eos_ids(teacher.tokenizer)
        self.teacher_eos = teacher_eos[0] if teacher_eos else None
        self._reported: set[str] = set()

    # -- requests ---------------------------------------------------------------------------------
    def _cross_view(self, completion: Completion) -> CrossTokenView:
        ids = list(completion.token_ids)
        # The engines end a stopped completion with the EOS id that stopped it (rollout.base contract).
        has_eos = bool(ids) and completion.finish_reason == "stop"
        body = ids[:-1] if has_eos else ids
        text = str(self.student_tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        # Invalid UTF-8 the student sampled is already U+FFFD in `text` (tokenizers decode lossily).
        teacher_body = list(self.teacher.tokenizer(text, add_special_tokens=False)["input_ids"])
        back = self.teacher.tokenizer.decode(
            teacher_body, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return CrossTokenView(body, teacher_body, text, str(back), has_eos)

    def _requests(
        self, rollout: RolloutBatch, prompts: list[Any]
    ) -> tuple[list[ScoreRequest], list[CrossTokenView] | None]:
        if not self.cross and self.media is not None:
            return self.media.same_vocab_requests(rollout.prompt_token_ids, prompts, rollout.completions), None
        if not self.cross:
            reqs = []
            for c in rollout.completions:
                prompt_ids = rollout.prompt_token_ids[c.prompt_index]
                reqs.append(ScoreRequest(list(prompt_ids) + list(c.token_ids), len(prompt_ids)))
            return reqs, None
        t = self.cfg.rl.teacher
        media = self.media.prefixes(rollout.prompt_token_ids, prompts) if self.media is not None else []
        prefixes = [
            list(
                self.teacher.tokenizer(
                    render_teacher_prefix(
                        self.teacher.tokenizer,
                        p,
                        use_chat_template=t.use_chat_template,
                        think_prefix=t.conditional_think_prefix,
                    ),
                    add_special_tokens=False,
                )["input_ids"]
            )
            for p in prompts
            if self.media is None  # a multimodal teacher's prefixes are `media`
        ]
        views = [self._cross_view(c) for c in rollout.completions]
        reqs = []
        for c, view in zip(rollout.completions, views, strict=True):
            view.teacher_eos = view.has_eos and self.teacher_eos is not None
            tail = [self.teacher_eos] if view.teacher_eos else []
            if not view.teacher_body and not tail:
                continue  # the teacher's tokenizer kept nothing of this text: no credit, nothing to score
            view.request_index = len(reqs)
            if media:
                reqs.append(media[c.prompt_index].request(view.teacher_body + [t for t in tail if t is not None]))
                continue
            prefix = prefixes[c.prompt_index]
            reqs.append(ScoreRequest(prefix + view.teacher_body + tail, len(prefix)))
        return reqs, views

    # -- scoring ----------------------------------------------------------------------------------
    def score(self, rollout: RolloutBatch, prompts: list[Any]) -> TeacherSignal:
        """The teacher signal of one collected batch; raises ``TeacherError`` after the last attempt."""
        counters = ScoreCounters()
        t = self.cfg.rl.teacher
        last: Exception | None = None
        # a pool shared by every policy rank (teacher/remote.py): each attempt is a collective
        attempt = self._attempt_together if getattr(self.teacher, "collective", False) else self._attempt
        for _ in range(t.max_score_attempts):
            counters.request += 1
            try:
                requests, scores, signal = attempt(rollout, prompts)
            except _ATTEMPT_ERRORS as exc:
                counters.failure += 1
                last = exc
                continue
            counters.success += 1
            signal.metrics.update(counters.metrics())
            signal.metrics["train/opd_teacher_scored_sequences"] = float(len(requests))
            signal.metrics["train/opd_teacher_scored_tokens"] = float(sum(len(s.logprobs) for s in scores))
            return signal
        raise TeacherError(
            f"teacher scoring failed {counters.failure} time(s) in a row (rl.teacher.max_score_attempts="
            f"{t.max_score_attempts}); nothing of this batch was trained on. Last error: {last}"
        )

    def _top_k(self) -> int:
        t = self.cfg.rl.teacher
        return t.top_k if t.signal_mode == "topk" else 0

    def _attempt(
        self, rollout: RolloutBatch, prompts: list[Any]
    ) -> tuple[list[ScoreRequest], list[SequenceScores], TeacherSignal]:
        """One attempt of an in-process teacher: this rank's requests, scores and signal."""
        requests, views = self._requests(rollout, prompts)
        # Every text of the batch may have tokenized to nothing (cross-tokenizer mode): nothing to score.
        scores = self.teacher.score(requests, self._top_k()) if requests else []
        return requests, scores, self._signal(rollout, requests, scores, views)

    def _attempt_together(
        self, rollout: RolloutBatch, prompts: list[Any]
    ) -> tuple[list[ScoreRequest], list[SequenceScores], TeacherSignal]:
        """One attempt on every policy rank at once (a pooled teacher): the proxy's ``score`` is a
        collective, so a rank that could not build its requests still joins it (with ``None``), and the
        outcome is agreed, so one rank's invalid payload fails the attempt everywhere and the ranks'
        retries stay in step."""
        built: tuple[list[ScoreRequest], list[CrossTokenView] | None] | None = None
        error: Exception | None = None
        try:
            built = self._requests(rollout, prompts)
        except _ATTEMPT_ERRORS as exc:
            error = exc
        scores: list[SequenceScores] = []
        signal: TeacherSignal | None = None
        try:
            scores = self.teacher.score(built[0] if built is not None else None, self._top_k())  # type: ignore[arg-type]
            if built is not None:
                signal = self._signal(rollout, built[0], scores, built[1])
        except _ATTEMPT_ERRORS as exc:
            error = error or exc
        if any_rank(error is not None) or built is None or signal is None:
            raise error or TeacherError("another policy rank's part of the teacher batch failed; the whole batch fails")
        return built[0], scores, signal

    def _signal(
        self,
        rollout: RolloutBatch,
        requests: list[ScoreRequest],
        scores: list[SequenceScores],
        views: list[CrossTokenView] | None,
    ) -> TeacherSignal:
        if len(scores) != len(requests):
            raise TeacherError(f"the teacher returned {len(scores)} scores for {len(requests)} requests")
        for n, (req, s) in enumerate(zip(requests, scores, strict=True)):
            if len(s.logprobs) != len(req.token_ids) - req.score_from:
                raise TeacherError(f"teacher request {n}: {len(s.logprobs)} scores for {len(req.token_ids)} tokens")
        if self.media is not None:  # before any signal exists: the engine scored the expected prefixes
            verify_media_scores(requests, scores, self.media.image_pad_id)
        if self.cfg.rl.distillation_mode == "direct":
            return self._direct(scores)
        if views is not None:
            return self._dpca(rollout, scores, views)
        return self._same_token_credit(rollout, scores)

    def _direct(self, scores: list[SequenceScores]) -> TeacherSignal:
        ids, lps = [], []
        for s in scores:
            if s.topk_ids is None or s.topk_logprobs is None:
                raise TeacherError("direct mode needs the teacher's top-k per position, and the scorer returned none")
            if s.topk_ids:
                validate_teacher_topk(
                    torch.tensor(s.topk_ids, dtype=torch.long),
                    torch.tensor(s.topk_logprobs, dtype=torch.float64),
                    self.student_vocab_size,
                )
            ids.append(s.topk_ids)
            lps.append(s.topk_logprobs)
        return TeacherSignal(topk_ids=ids, topk_logprobs=lps, metrics={})

    def _same_token_credit(self, rollout: RolloutBatch, scores: list[SequenceScores]) -> TeacherSignal:
        """Legacy same-token advantage: per token, teacher minus rollout logprob of the realized token
        (a one-sample estimate of the negative reverse KL)."""
        credit = []
        for c, s in zip(rollout.completions, scores, strict=True):
            t_lp = torch.tensor(s.logprobs, dtype=torch.float64)
            if not torch.isfinite(t_lp).all():
                raise TeacherError("the teacher returned a non-finite logprob for a realized token")
            credit.append((t_lp - torch.tensor(c.logprobs, dtype=torch.float64)).tolist())
        return TeacherSignal(credit=credit)

    def _dpca(self, rollout: RolloutBatch, scores: list[SequenceScores], views: list[CrossTokenView]) -> TeacherSignal:
        rl = self.cfg.rl
        credits: list[list[float]] = []
        totals: DpcaStats | None = None
        for n, (c, view) in enumerate(zip(rollout.completions, views, strict=True)):
            chunks = self._chunks(view)
            self._report_rejected(n, view, chunks)
            teacher_logprobs = scores[view.request_index].logprobs if view.request_index is not None else []
            credit, stats = dpca_credit(
                torch.tensor(c.logprobs, dtype=torch.float64),
                torch.tensor(teacher_logprobs, dtype=torch.float64),
                chunks,
                n_ignore_prefix_tokens=rl.n_ignore_prefix_tokens,
            )
            credits.append(credit.tolist())
            totals = stats if totals is None else totals.merge(stats)
        metrics = {k: float(v) for k, v in totals.to_metrics().items()} if totals is not None else {}
        return TeacherSignal(credit=credits, metrics=metrics)

    def _chunks(self, view: CrossTokenView) -> list[Chunk]:
        """The alignment of one completion, its EOS pair last (unmatched when the teacher has no EOS)."""
        chunks = align_chunks(
            token_end_offsets(self.student_tokenizer, view.student_body),
            token_end_offsets(self.teacher.tokenizer, view.teacher_body),
            view.text,
            teacher_text=view.teacher_text,
            max_chunk_tokens=self.cfg.rl.teacher.dpca_max_chunk_tokens,
        )
        n_s, n_t, n_x = len(view.student_body), len(view.teacher_body), len(view.text)
        if view.teacher_eos:
            chunks.append(eos_chunk(n_s, n_t, n_x))
        elif view.has_eos:
            chunks.append(Chunk(n_s, n_s + 1, n_t, n_t, n_x, n_x, "unmatched"))
        return chunks

    def _report_rejected(self, n: int, view: CrossTokenView, chunks: list[Chunk]) -> None:
        """Log the first chunk of each rejected kind this run meets (the metrics count every one)."""
        for c in chunks:
            if c.kind == "aligned" or c.kind in self._reported:
                continue
            self._reported.add(c.kind)
            span = view.text[c.text_start : c.text_end]
            if c.kind == "too_long":
                _log.warning(
                    "DPCA: completion %d, characters [%d, %d) %r span %d student and %d teacher tokens with no "
                    "shared boundary, more than rl.teacher.dpca_max_chunk_tokens=%d: no credit there (counted in "
                    "train/opd_dpca_too_long_chunk_count; logged once per run)",
                    n,
                    c.text_start,
                    c.text_end,
                    span[:200],
                    c.student_len,
                    c.teacher_len,
                    self.cfg.rl.teacher.dpca_max_chunk_tokens,
                )
            else:
                teacher_span = self.teacher.tokenizer.decode(
                    view.teacher_body[c.teacher_start : c.teacher_end],
                    skip_special_tokens=False,
                    clean_up_tokenization_spaces=False,
                )
                _log.warning(
                    "DPCA: completion %d, the teacher tokenizer reads the student's %r as %r: no credit there "
                    "(counted in train/opd_dpca_unmatched_chunk_count and train/opd_dpca_coverage; "
                    "logged once per run)",
                    n,
                    span[:200],
                    str(teacher_span)[:200],
                )


def _eos_ids(tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
