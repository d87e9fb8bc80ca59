"""Per-token completion logprobs without a full fp32 [tokens, vocabulary] logits tensor.

The model's body runs once over the batch (padded or packed, ``policy/batching.py``); only the
hidden states that predict completion tokens are kept, and the LM head is applied to them
``chunk_tokens`` rows at a time. Each chunk computes an fp32 log-softmax of its logits and a gather
(or, with ``model.triton_logprob_head`` on CUDA, two Triton kernels), and is wrapped in activation
checkpointing so that backward recomputes that chunk's logits instead of keeping them: peak memory
holds one chunk's ``[chunk_tokens, V]`` tensors (and their gradient), never ``[B, L, V]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from posttrain.models.structure import body_hidden_states, split_body_and_head
from posttrain.policy import logprob_kernels
from posttrain.policy.batching import PolicyBatch


def _chunk_logprobs(
    hidden_CH: Tensor, ids_CJ: Tensor, head: nn.Module, temperature: float, softcap: float | None
) -> Tensor:
    """log p(ids_CJ[c, j]) under ``softmax(head(hidden_CH[c]) / temperature)``, in fp32.

    One ``log_softmax`` that reads the head's (bf16) logits and computes and writes in fp32, then a
    gather: one kernel over ``[C, V]`` each way plus the gather's scatter, and the fp32 gradient cast
    back. ``gather(logits) - logsumexp(logits.float())``, the same value, took about five passes over
    the chunk's fp32 logits forward and seven backward: about a quarter of the GPU time of W's update
    on an H100 (docs/benchmarks.md, twenty-second session). With ``model.triton_logprob_head`` a CUDA
    chunk takes two Triton kernels instead (``policy/logprob_kernels.py``): the forward reads the
    logits once for their log-sum-exp, the backward once more for their gradient, with no fp32
    ``[C, V]`` tensor."""
    logits_CV = head(hidden_CH)
    if softcap is None and logprob_kernels.enabled_for(head, logits_CV):
        return logprob_kernels.target_logprobs(logits_CV, ids_CJ, temperature)
    if softcap is None and temperature == 1.0:
        logprobs_CV = torch.log_softmax(logits_CV, dim=-1, dtype=torch.float32)  # upcasts, then computes
    else:
        logits_CV = logits_CV.float()
        if softcap is not None:
            logits_CV = softcap * torch.tanh(logits_CV / softcap)
        if temperature != 1.0:  # x / 1 == x exactly: skip a [C, V] pass (and its backward) at the default
            logits_CV = logits_CV / temperature
        logprobs_CV = torch.log_softmax(logits_CV, dim=-1)
    return logprobs_CV.gather(-1, ids_CJ)


def chunked_head_logprobs(
    hidden_NH: Tensor,
    ids_NJ: Tensor,
    head: nn.Module,
    *,
    temperature: float,
    softcap: float | None,
    chunk_tokens: int,
) -> Tensor:
    """``out_NJ[n, j] = log p(ids_NJ[n, j])`` under the head applied to ``hidden_NH[n]``, ``chunk_tokens``
    rows at a time; under autograd each chunk is checkpointed, so backward recomputes its logits.
    A single chunk is kept instead: backward would recompute it right where memory peaks anyway
    (its logits and their gradient), so keeping it costs no peak and saves one head forward."""
    needs_grad = hidden_NH.requires_grad or any(p.requires_grad for p in head.parameters())
    recompute = torch.is_grad_enabled() and needs_grad and hidden_NH.shape[0] > chunk_tokens
    pieces = []
    for start in range(0, hidden_NH.shape[0], chunk_tokens):
        args = (
            hidden_NH[start : start + chunk_tokens],
            ids_NJ[start : start + chunk_tokens],
            head,
            temperature,
            softcap,
        )
        if recompute:
            pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(*args))
    if not pieces:
        return hidden_NH.new_zeros((0, ids_NJ.shape[1]), dtype=torch.float32)
    return torch.cat(pieces)


BodyForward = Callable[[Tensor], Tensor]
"""``input_ids_RL -> hidden_RLH`` for right-padded rows: the body run another way (its CUDA graphs,
``models/cuda_graphs.GraphedBody.hidden_states``)."""


def _hidden_states(body: nn.Module, batch: PolicyBatch, body_forward: BodyForward | None = None) -> Tensor:
    if body_forward is not None:
        if batch.position_ids_RL is not None:
            raise ValueError("a replacement body forward takes padded rows only, not packed ones")
        return body_forward(batch.input_ids_RL)
    # Padded rows are right-padded, so the causal mask alone keeps every real token from seeing
    # padding; skipping the padding mask lets SDPA use its plain causal kernel (padded positions'
    # outputs are never read). Packed rows pass their restarting position ids instead, from which
    # transformers builds the block-diagonal causal mask.
    return body_hidden_states(body, batch.input_ids_RL, batch.position_ids_RL)


def completion_hidden_states(
    body: nn.Module, batch: PolicyBatch, body_forward: BodyForward | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(hidden_NH, b_N, t_N)``: the body's hidden state that predicts each completion token (the one
    at the position before it), with the token's row and column, row-major over the batch.
    ``body_forward`` runs the body instead of calling it (padded rows only)."""
    hidden_RLH = _hidden_states(body, batch, body_forward)
    return hidden_RLH.flatten(0, 1)[batch.source_N], batch.row_N, batch.col_N


def completion_logprobs(
    model: Any,
    batch: PolicyBatch,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    head_ids_BTK: Tensor | None = None,
    body_forward: BodyForward | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``logprobs_BT[b, t] = log p(completion token t of row b | everything before it)``.

    Computed from ``logits / temperature`` in fp32; 0 where ``completion_mask_BT`` is 0.
    With ``head_ids_BTK`` also returns ``head_logprobs_BTK``: the policy's logprobs at those ids
    (the sampler's top-k head, for score centering), 0 where masked. ``body_forward``: the body run
    another way (its CUDA graphs), padded rows only.
    """
    if temperature <= 0:
        raise ValueError(f"rl.temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"model.logprob_chunk_tokens must be >= 1, got {chunk_tokens}")
    body, head = split_body_and_head(model)
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    rows, width = batch.completion_ids_BT.shape
    hidden_NH, b_N, t_N = completion_hidden_states(body, batch, body_forward)
    ids_NJ = batch.completion_ids_BT[b_N, t_N].unsqueeze(-1)
    if head_ids_BTK is not None:
        ids_NJ = torch.cat([ids_NJ, head_ids_BTK[b_N, t_N].long()], dim=-1)

    out_NJ = chunked_head_logprobs(
        hidden_NH, ids_NJ, head, temperature=temperature, softcap=softcap, chunk_tokens=chunk_tokens
    )

    logprobs_BT = out_NJ.new_zeros((rows, width)).index_put((b_N, t_N), out_NJ[:, 0])
    if head_ids_BTK is None:
        return logprobs_BT
    head_BTK = out_NJ.new_zeros((rows, width, ids_NJ.shape[1] - 1)).index_put((b_N, t_N), out_NJ[:, 1:])
    return logprobs_BT, head_BTK


@torch.no_grad()
def check_packing_isolates(model: Any, *, tolerance: float = 1e-4) -> None:
    """Fail loudly unless packed sequences stay apart in ``model`` (``model.sequence_packing``).

    transformers isolates packed sequences by their restarting position ids, but only in models
    whose attention mask is built from them; a model that ignores them would let each sequence
    attend to the ones packed before it, silently. Probe: pack a short sequence behind a neighbour
    twice, with two different neighbours; isolated, its logprobs do not depend on the neighbour."""
    from posttrain.errors import ConfigError
    from posttrain.policy.batching import build_policy_batch

    vocab = int(model.get_input_embeddings().num_embeddings)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    follower = torch.randint(vocab, (6,), generator=gen).tolist()
    wide = torch.randint(vocab, (12,), generator=gen).tolist()  # fills a row, so the others share one
    seen = []
    was_training = model.training
    model.eval()  # no dropout: the follower's logprobs may differ only through its neighbour
    try:
        for neighbour_seed in (1, 2):
            neighbour = torch.randint(vocab, (6,), generator=torch.Generator().manual_seed(neighbour_seed)).tolist()
            # first-fit decreasing puts `wide` alone in row 0 and `neighbour` (first, as listed) then
            # `follower` in row 1
            batch = build_policy_batch(
                [wide[:6], neighbour[:3], follower[:3]],
                [wide[6:], neighbour[3:], follower[3:]],
                pad_id=0,
                device=device,
                pack_capacity=12,
            )
            logprobs = completion_logprobs(model, batch)
            seen.append((logprobs if isinstance(logprobs, Tensor) else logprobs[0])[2].float())
    finally:
        model.train(was_training)
    gap = float((seen[0] - seen[1]).abs().max())
    if not gap <= tolerance:
        raise ConfigError(
            [
                f"model.sequence_packing=true: {type(model).__name__} lets packed sequences attend to each "
                f"other (a sequence's logprobs moved by {gap:.3g} when the one packed before it changed); "
                "this model does not build its attention mask from position ids. Set "
                "model.sequence_packing=false."
            ]
        )
