"""The chunked logprob head on CUDA (``policy/logprobs.chunked_head_logprobs``): one fp32
``log_softmax`` over the head's bf16 logits per chunk, where CUDA's kernel upcasts inside
(``half_to_float``), a path the CPU tests never take. ``pytest -m gpu`` on the device machine."""

from __future__ import annotations

import pytest
import torch

from posttrain.policy.logprobs import chunked_head_logprobs

pytestmark = pytest.mark.gpu

HIDDEN, VOCAB, TOKENS = 896, 49152, 3000  # W's head (the 0.4B shape on SmolLM2's vocabulary)


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")


def _reference(hidden: torch.Tensor, ids: torch.Tensor, head: torch.nn.Module, temperature: float) -> torch.Tensor:
    """The same logprobs in float64 from the same bf16 logits: gather minus logsumexp."""
    logits = head(hidden).double() / temperature
    return logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_head_matches_float64(temperature: float) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(VOCAB, (TOKENS, 3), device="cuda")  # the sampled token and two head ids
    out = chunked_head_logprobs(hidden, ids, head, temperature=temperature, softcap=None, chunk_tokens=1024)
    ref = _reference(hidden, ids, head, temperature)
    assert out.dtype == torch.float32 and out.shape == (TOKENS, 3)
    assert (out.double() - ref).abs().max().item() < 2e-5

    weights = torch.randn(TOKENS, 3, device="cuda", dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weights).sum(), [hidden, head.weight])
    grads_ref = torch.autograd.grad((ref * weights).sum(), [hidden, head.weight])
    for got, want in zip(grads, grads_ref, strict=True):
        assert got.dtype == torch.bfloat16
        # both end in bf16 (the head's matrix products); a relative error of a few bf16 ulps
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < 2e-2, err
