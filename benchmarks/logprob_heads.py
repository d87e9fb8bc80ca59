"""The policy's earlier logprob heads, for before/after runs in one process (``update_precision.py``'s
``_lse`` and ``_lsm`` arms, ``grpo_step.py``'s ``head`` arm key and ``--logprob-head``).

``use_logprob_head(name)`` makes the trainer's chunks (``posttrain.policy.logprobs._chunk_logprobs``)
go through one of ``HEADS`` from then on:

- ``shipped``: as a run computes them (on CUDA the Triton kernels of ``policy/logprob_kernels.py``,
  since the twenty-third session);
- ``log_softmax``: one fp32 ``log_softmax`` over the bf16 logits and a gather (the twenty-second
  session's head; the shipped path off CUDA): the Triton kernels reported unavailable;
- ``logsumexp``: fp32 logits, their logsumexp and a gather (the head before the twenty-second session).
"""

from __future__ import annotations

from typing import Any

import torch

HEADS = ("shipped", "log_softmax", "logsumexp")
_SHIPPED: dict[str, Any] = {}  # the shipped functions, kept before an earlier head replaces them


def chunk_logprobs_logsumexp(
    hidden_CH: torch.Tensor, ids_CJ: torch.Tensor, head: Any, temperature: float, softcap: float | None
) -> torch.Tensor:
    """log p(ids_CJ[c, j]) as the head computed it before: ``gather(x) - logsumexp(x)``, x the fp32 logits."""
    logits_CV = head(hidden_CH).float()
    if softcap is not None:
        logits_CV = softcap * torch.tanh(logits_CV / softcap)
    if temperature != 1.0:
        logits_CV = logits_CV / temperature
    return logits_CV.gather(-1, ids_CJ) - torch.logsumexp(logits_CV, dim=-1, keepdim=True)


def _never(logits: torch.Tensor) -> bool:
    return False


def use_logprob_head(name: str) -> None:
    """From now on the trainer's chunks go through the head ``name`` (one of ``HEADS``)."""
    from posttrain.policy import logprob_kernels, logprobs

    if name not in HEADS:
        raise SystemExit(f"unknown logprob head {name!r} (known: {', '.join(HEADS)})")
    shipped = _SHIPPED.setdefault("head", logprobs._chunk_logprobs)
    available = _SHIPPED.setdefault("available", logprob_kernels.available)
    logprobs._chunk_logprobs = chunk_logprobs_logsumexp if name == "logsumexp" else shipped
    logprob_kernels.available = _never if name == "log_softmax" else available
