"""The chunked logprob head on CUDA (``policy/logprobs.chunked_head_logprobs``): per chunk, two Triton
kernels over the head's bf16 logits (``policy/logprob_kernels.py``), and the fp32 ``log_softmax`` they
replace there (CUDA's kernel upcasts inside, ``half_to_float``), paths the CPU tests never take.
``pytest -m gpu`` on the device machine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from posttrain.policy import logprob_kernels
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


@pytest.mark.parametrize(("vocab", "temperature", "columns"), [(49152, 1.0, 1), (50257, 0.7, 3), (1000, 1.3, 2)])
def test_triton_head_matches_the_torch_path(vocab: int, temperature: float, columns: int) -> None:
    """A head marked for ``model.triton_logprob_head`` takes the Triton kernels on CUDA
    (``policy/logprob_kernels.py``): the same logprobs as the fp32 log_softmax to fp32 rounding,
    gradients to bf16 rounding, for a vocabulary that is a multiple of the kernels' block, one that is
    not, and one smaller than a block."""
    torch.manual_seed(1)
    head = torch.nn.Linear(HIDDEN, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(vocab, (TOKENS, columns), device="cuda")
    ids[:, -1] = ids[:, 0]  # a column repeated: both its gradients land on one logit
    weights = torch.randn(TOKENS, columns, device="cuda")
    outs, grads = [], []
    for triton in (True, False):
        logprob_kernels.mark_head(head, triton)
        assert logprob_kernels.enabled_for(head, head(hidden[:2])) is triton
        out = chunked_head_logprobs(hidden, ids, head, temperature=temperature, softcap=None, chunk_tokens=1024)
        outs.append(out)
        grads.append(torch.autograd.grad((out * weights).sum(), [hidden, head.weight]))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5
    for got, want in zip(*grads, strict=True):
        assert got.dtype == want.dtype == torch.bfloat16
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < 1e-2, err


def _peak_bytes_of_one_chunk(head: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = chunked_head_logprobs(hidden, ids, head, temperature=1.0, softcap=None, chunk_tokens=hidden.shape[0])
    out.sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_triton_head_holds_no_fp32_logits() -> None:
    """The Triton path's peak over one chunk is its bf16 logits and their bf16 gradient (4 bytes per
    logit, and the head's own weight gradient); the torch path adds fp32 log-probabilities and an fp32
    gradient (at least 8 more)."""
    torch.manual_seed(2)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(1024, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(VOCAB, (1024, 1), device="cuda")
    logits_bytes = 1024 * VOCAB
    peaks = {}
    for triton in (True, False):
        logprob_kernels.mark_head(head, triton)
        head.weight.grad = hidden.grad = None
        peaks[triton] = _peak_bytes_of_one_chunk(head, hidden, ids)
    assert peaks[True] <= 5 * logits_bytes + head.weight.numel() * 2, (peaks, logits_bytes)
    assert peaks[False] >= 10 * logits_bytes, (peaks, logits_bytes)


def test_a_run_with_the_triton_head_trains_and_its_reference_agrees(
    tiny_model_dir: str, grpo_run: Callable[..., Any]
) -> None:
    """``model.triton_logprob_head=true`` in a whole run: it trains, and the KL reference's head takes the
    same kernels, so before the first update the two agree exactly."""
    kl = ["rl.kl_beta=0.1", "rl.ref.build_ref=true", "rl.kl_coeff_clamp=5"]
    # fused kernels off: Liger's patch of the llama module cannot be undone, and would reach the other
    # GPU test files in this process (test_fused_kernels_gpu.py counts its kernels from an unpatched start)
    head = ["model.triton_logprob_head=true", "model.fused_kernels=false"]
    _, _, records = grpo_run(tiny_model_dir, *head, *kl)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0 for r in records)
    assert records[0]["train/kl_max"] == 0.0
    assert records[-1]["train/kl_max"] > 0.0
