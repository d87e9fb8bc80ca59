"""The transformers teacher scorer: one forward pass per batch over the forced sequences.

The model body runs over right-padded rows; the LM head is applied only to the hidden states that
predict scored tokens, ``chunk_tokens`` rows at a time, so the fp32 logits never exceed
``[chunk_tokens, V]``. Each chunk yields the realized token's logprob and the top-k of the
full-vocabulary log-softmax.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from posttrain.models.structure import split_body_and_head
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.logprobs import completion_hidden_states
from posttrain.teacher.base import ScoreRequest, SequenceScores, check_requests


def head_scores(
    hidden_NH: Tensor, ids_N: Tensor, head: nn.Module, *, top_k: int, chunk_tokens: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(logprob_N, topk_ids_NK, topk_logprobs_NK)`` of ``log_softmax(head(hidden))`` in fp32."""
    lps, tids, tlps = [], [], []
    for start in range(0, hidden_NH.shape[0], chunk_tokens):
        logp_CV = torch.log_softmax(head(hidden_NH[start : start + chunk_tokens]).float(), dim=-1)
        lps.append(logp_CV.gather(-1, ids_N[start : start + chunk_tokens, None])[:, 0])
        if top_k:
            values_CK, indices_CK = logp_CV.topk(top_k, dim=-1)
            tids.append(indices_CK)
            tlps.append(values_CK)
    empty = hidden_NH.new_zeros((0, top_k), dtype=torch.float32)
    return (
        torch.cat(lps) if lps else hidden_NH.new_zeros(0, dtype=torch.float32),
        torch.cat(tids) if tids else empty.long(),
        torch.cat(tlps) if tlps else empty,
    )


class HFTeacher:
    """Scores forced sequences with a frozen transformers causal LM."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        batch_size: int = 64,
        chunk_tokens: int = 1024,
        max_model_len: int | None = None,
    ) -> None:
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.chunk_tokens = chunk_tokens
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_model_len = max_model_len
        self.device = next(model.parameters()).device
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad or 0)

    @torch.no_grad()
    def score(self, requests: list[ScoreRequest], top_k: int) -> list[SequenceScores]:
        """Teacher scores of every request (see ``teacher.base``)."""
        check_requests(requests, self.vocab_size, self.max_model_len)
        out: list[SequenceScores] = []
        for start in range(0, len(requests), self.batch_size):
            out.extend(self._score_batch(requests[start : start + self.batch_size], top_k))
        return out

    def _score_batch(self, requests: list[ScoreRequest], top_k: int) -> list[SequenceScores]:
        body, head = split_body_and_head(self.model)
        batch = build_policy_batch(
            [r.token_ids[: r.score_from] for r in requests],
            [r.token_ids[r.score_from :] for r in requests],
            pad_id=self.pad_id,
            device=self.device,
        )
        hidden_NH, b_N, t_N = completion_hidden_states(body, batch)
        ids_N = batch.completion_ids_BT[b_N, t_N]
        lp_N, tid_NK, tlp_NK = head_scores(hidden_NH, ids_N, head, top_k=top_k, chunk_tokens=self.chunk_tokens)
        return split_scores(requests, lp_N, tid_NK, tlp_NK, top_k=top_k)


def split_scores(
    requests: list[ScoreRequest],
    lp_N: Tensor,
    tid_NK: Tensor,
    tlp_NK: Tensor,
    *,
    top_k: int,
    prompt_ids: list[list[int]] | None = None,
) -> list[SequenceScores]:
    """One ``SequenceScores`` per request from a batch's flat scores (``N`` = the requests' scored
    tokens, row-major as ``build_policy_batch`` lays them out, so each request's are contiguous);
    ``prompt_ids``: the prompt each request was scored on, where the engine reports it."""
    # One transfer per batch.
    lp_list, tid_list, tlp_list = lp_N.cpu().tolist(), tid_NK.cpu().tolist(), tlp_NK.cpu().tolist()
    scores, pos = [], 0
    for i, r in enumerate(requests):
        n = len(r.token_ids) - r.score_from
        scores.append(
            SequenceScores(
                logprobs=lp_list[pos : pos + n],
                topk_ids=tid_list[pos : pos + n] if top_k else None,
                topk_logprobs=tlp_list[pos : pos + n] if top_k else None,
                prompt_ids=None if prompt_ids is None else prompt_ids[i],
            )
        )
        pos += n
    return scores
