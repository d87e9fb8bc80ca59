"""Per-token completion logprobs without a full fp32 [tokens, vocabulary] logits tensor.

The model's body runs once over the packed batch; only the hidden states that predict completion
tokens are kept, and the LM head is applied to them ``chunk_tokens`` rows at a time. Each chunk
computes its fp32 logits, a logsumexp and a gather, and is wrapped in activation checkpointing so
that backward recomputes that chunk's logits instead of keeping them: peak memory holds one
chunk's ``[chunk_tokens, V]`` logits (and their gradient), never ``[B, L, V]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from posttrain.errors import PosttrainError
from posttrain.policy.batching import PolicyBatch


def split_body_and_head(model: Any) -> tuple[nn.Module, nn.Module]:
    """The decoder body (returns hidden states) and the LM head of a Hugging Face causal LM."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if head is None or body is None:
        raise PosttrainError(
            f"{type(model).__name__} does not expose its decoder body and LM head (get_decoder / "
            "get_output_embeddings); posttrain needs a Hugging Face *ForCausalLM model"
        )
    config = getattr(model, "config", None)
    for knob in ("logit_scale", "logits_scaling"):
        value = getattr(config, knob, None)
        if value is not None and value != 1:
            # These models rescale logits inside forward(); the chunked head would silently miss it.
            raise PosttrainError(f"model config sets {knob}={value}, which the chunked logprob path does not apply")
    return body, head


def _chunk_logprobs(
    hidden_CH: Tensor, ids_CJ: Tensor, head: nn.Module, temperature: float, softcap: float | None
) -> Tensor:
    """log p(ids_CJ[c, j]) under ``softmax(head(hidden_CH[c]) / temperature)``, in fp32."""
    logits_CV = head(hidden_CH).float()
    if softcap is not None:
        logits_CV = softcap * torch.tanh(logits_CV / softcap)
    logits_CV = logits_CV / temperature
    lse_C1 = torch.logsumexp(logits_CV, dim=-1, keepdim=True)
    return logits_CV.gather(-1, ids_CJ) - lse_C1


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
    rows at a time; under autograd each chunk is checkpointed, so backward recomputes its logits."""
    needs_grad = hidden_NH.requires_grad or any(p.requires_grad for p in head.parameters())
    recompute = torch.is_grad_enabled() and needs_grad
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


def _hidden_states(body: nn.Module, batch: PolicyBatch) -> Tensor:
    # Rows are right-padded, so the causal mask alone keeps every real token from seeing padding;
    # skipping the padding mask lets SDPA use its plain causal kernel (padded rows' outputs are
    # never read).
    out = body(input_ids=batch.input_ids_BL, use_cache=False)
    hidden: Tensor = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden


def completion_hidden_states(body: nn.Module, batch: PolicyBatch) -> tuple[Tensor, Tensor, Tensor]:
    """``(hidden_NH, b_N, t_N)``: the body's hidden state that predicts each completion token (the one
    at the position before it), with the token's row and column, row-major over the batch."""
    hidden_BLH = _hidden_states(body, batch)
    b_N, t_N = (batch.completion_mask_BT > 0).nonzero(as_tuple=True)
    return hidden_BLH[b_N, batch.completion_start_B[b_N] + t_N - 1], b_N, t_N


def completion_logprobs(
    model: Any,
    batch: PolicyBatch,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    head_ids_BTK: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``logprobs_BT[b, t] = log p(completion token t of row b | everything before it)``.

    Computed from ``logits / temperature`` in fp32; 0 where ``completion_mask_BT`` is 0.
    With ``head_ids_BTK`` also returns ``head_logprobs_BTK``: the policy's logprobs at those ids
    (the sampler's top-k head, for score centering), 0 where masked.
    """
    if temperature <= 0:
        raise ValueError(f"rl.temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"model.logprob_chunk_tokens must be >= 1, got {chunk_tokens}")
    body, head = split_body_and_head(model)
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    rows, width = batch.completion_ids_BT.shape
    hidden_NH, b_N, t_N = completion_hidden_states(body, batch)
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
