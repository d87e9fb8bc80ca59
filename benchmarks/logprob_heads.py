"""The policy's logprob head as it was before the twenty-second session, for before/after runs in one
process (``update_precision.py``'s ``_lse`` arms, ``grpo_step.py``'s ``logsumexp_head`` arm key).

``use_logprob_head(earlier)`` installs it in place of ``posttrain.policy.logprobs._chunk_logprobs`` (or
puts the shipped one back): fp32 logits, their logsumexp and a gather, where the shipped head takes one
fp32 ``log_softmax`` over the bf16 logits (docs/benchmarks.md, twenty-second session).
"""

from __future__ import annotations

from typing import Any

import torch

_SHIPPED: dict[str, Any] = {}  # the shipped head, kept before the earlier one replaces it


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


def use_logprob_head(earlier: bool) -> None:
    """From now on the trainer's chunks go through the earlier head (``earlier``) or the shipped one."""
    from posttrain.policy import logprobs

    shipped = _SHIPPED.setdefault("head", logprobs._chunk_logprobs)
    logprobs._chunk_logprobs = chunk_logprobs_logsumexp if earlier else shipped
