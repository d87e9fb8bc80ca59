"""The policy's logprob heads, for before/after runs in one process (``update_precision.py``'s ``_trt``
and ``_lse`` arms, ``grpo_step.py``'s ``head`` arm key and ``--head``).

``use_logprob_head(name)`` makes the trainer's chunks (``posttrain.policy.logprobs._chunk_logprobs``)
go through one of ``HEADS`` from then on, whatever ``model.triton_logprob_head`` says, but for ``shipped``:

- ``shipped``: as the run's config says (``model.triton_logprob_head=auto``: the Triton kernels on CUDA
  since the twenty-fifth session, ``log_softmax`` elsewhere);
- ``log_softmax``: one fp32 ``log_softmax`` over the bf16 logits and a gather (the default from the
  twenty-second to the twenty-fourth session, and on the CPU);
- ``triton``: on CUDA the two Triton kernels of ``policy/logprob_kernels.py`` (``model.triton_logprob_head``,
  twenty-third session; elsewhere the same as ``log_softmax``);
- ``logsumexp``: fp32 logits, their logsumexp and a gather (the head before the twenty-second session).
"""

from __future__ import annotations

from typing import Any

import torch

HEADS = ("shipped", "log_softmax", "triton", "logsumexp")
_SHIPPED: dict[str, Any] = {}  # the shipped chunk function and head test, kept before they are replaced


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
    shipped_test = _SHIPPED.setdefault("enabled_for", logprob_kernels.enabled_for)
    logprobs._chunk_logprobs = chunk_logprobs_logsumexp if name == "logsumexp" else shipped

    def triton_if_available(head: Any, logits: torch.Tensor) -> bool:
        return name == "triton" and logprob_kernels.available(logits)

    logprob_kernels.enabled_for = shipped_test if name == "shipped" else triton_if_available
