"""The policy's logprob heads, for before/after runs in one process (``update_precision.py``'s ``_trt``
and ``_lse`` arms, ``grpo_step.py``'s ``head`` arm key and ``--head``).

``use_logprob_head(name)`` makes the trainer's chunks (``posttrain.policy.logprobs._chunk_logprobs``)
go through one of ``HEADS`` from then on, whatever ``model.triton_logprob_head`` says:

- ``log_softmax``: one fp32 ``log_softmax`` over the bf16 logits and a gather (the default since the
  twenty-second session);
- ``triton``: on CUDA the two Triton kernels of ``policy/logprob_kernels.py`` (``model.triton_logprob_head``,
  twenty-third session; elsewhere the same as ``log_softmax``);
- ``logsumexp``: fp32 logits, their logsumexp and a gather (the head before the twenty-second session).
"""

from __future__ import annotations

from typing import Any

import torch

HEADS = ("log_softmax", "triton", "logsumexp")
_SHIPPED: dict[str, Any] = {}  # the shipped chunk function, kept before the logsumexp head replaces it


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


def use_logprob_head(name: str) -> None:
    """From now on the trainer's chunks go through the head ``name`` (one of ``HEADS``)."""
    from posttrain.policy import logprob_kernels, logprobs

    if name not in HEADS:
        raise SystemExit(f"unknown logprob head {name!r} (known: {', '.join(HEADS)})")
    shipped = _SHIPPED.setdefault("head", logprobs._chunk_logprobs)
    logprobs._chunk_logprobs = chunk_logprobs_logsumexp if name == "logsumexp" else shipped

    def triton_if_available(head: Any, logits: torch.Tensor) -> bool:
        return name == "triton" and logprob_kernels.available(logits)

    logprob_kernels.enabled_for = triton_if_available
