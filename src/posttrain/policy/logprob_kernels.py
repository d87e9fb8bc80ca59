"""The logprob head's softmax on CUDA as two Triton kernels: the chunk's log-sum-exp forward, its
gradient backward, each one pass over the head's bf16 logits.

``policy/logprobs._chunk_logprobs`` computes ``log p(ids_CJ) = logits[ids] / T - logsumexp(logits / T)``
per chunk of ``[C, V]`` logits. Through torch that is ``log_softmax(logits, dtype=float32)`` and a
gather: the forward writes an fp32 ``[C, V]`` (twice: the chunk is checkpointed and recomputed), the
backward reads it, scatters the gather's gradient into an fp32 ``[C, V]`` of zeros and writes the fp32
gradient, which is then cast to bf16 for the head's matrix products: about six passes over 1.5-3x the
logits' bytes. Here the forward reads the bf16 logits once and writes ``[C]`` fp32 log-sum-exps (the
gather is of ``J`` columns), and the backward reads them once more and writes the bf16 gradient
directly (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", for the one-pass
log-sum-exp):

    d logp_j / d x_v = ([v == ids_j] - p_v) / T   with p = softmax(x / T),  so
    grad_v = (sum_j g_j [v == ids_j] - p_v sum_j g_j) / T

in fp32 per element, rounded once to the logits' dtype, as the torch path's final cast rounds. No
``[C, V]`` fp32 tensor exists on this path. Values agree with the torch path to fp32 rounding; the GPU
tests check both against float64 (``tests/gpu/test_logprob_head_gpu.py``).

``model.triton_logprob_head`` (``auto``: on for a CUDA policy since the twenty-fifth session, when the
update took 11 % less time with it at 0.4B and 4 % less at 1.5B on an H100) marks the policy's head
(``use_triton_head``; the KL reference's too, so the two agree to the bit before the first update), and
``_chunk_logprobs`` takes these kernels for a marked head's CUDA logits (``enabled_for``). Triton comes
with CUDA builds of torch; it is imported only when a CUDA chunk first asks, so CPU installs never
touch it (the preflight refuses the knob off CUDA or without Triton). On the CPU the kernels run in
Triton's interpreter for the tests (``tests/unit/test_logprob_kernels.py``).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from posttrain.models.fused_kernels import drop_vllm_compile_warnings

if TYPE_CHECKING:
    from posttrain.config.schema import ModelConfig

KERNEL_NAMES = frozenset({"logsumexp_rows", "logprob_grad_rows"})
_BLOCK = 4096  # vocabulary columns per iteration: 16 per thread at 8 warps
_WARPS = 8


@functools.cache
def _kernels() -> tuple[Any, Any] | None:
    """The two jitted kernels, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed (CPU torch), or a broken install: the torch path runs
        return None

    @triton.jit
    def logsumexp_rows(logits_ptr, row_stride, lse_ptr, vocab, temperature, BLOCK: tl.constexpr):  # noqa: PLR0917
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        cols = tl.arange(0, BLOCK)
        # online max and sum of exp: one read of the row (Milakov & Gimelshein 2018)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) / temperature
        running_max = tl.max(x, axis=0)
        running_sum = tl.sum(tl.exp(x - running_max), axis=0)
        for start in range(BLOCK, vocab, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
            x = x / temperature
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        tl.store(lse_ptr + row, running_max + tl.log(running_sum))

    @triton.jit
    def logprob_grad_rows(  # noqa: PLR0917  (a Triton kernel takes its arguments by position)
        logits_ptr,
        row_stride,
        lse_ptr,
        ids_ptr,
        grad_out_ptr,
        grad_in_ptr,
        vocab,
        temperature,
        J: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        out_base = grad_in_ptr + row * row_stride
        lse = tl.load(lse_ptr + row)
        grad_sum = 0.0
        for j in tl.static_range(J):
            grad_sum += tl.load(grad_out_ptr + row * J + j)
        cols = tl.arange(0, BLOCK)
        for start in range(0, vocab, BLOCK):
            in_row = start + cols < vocab
            x = tl.load(base + start + cols, mask=in_row, other=0.0).to(tl.float32) / temperature
            grad = -grad_sum * tl.exp(x - lse)
            for j in tl.static_range(J):
                target = tl.load(ids_ptr + row * J + j)
                grad += tl.where(start + cols == target, tl.load(grad_out_ptr + row * J + j), 0.0)
            grad = grad / temperature
            tl.store(out_base + start + cols, grad.to(grad_in_ptr.dtype.element_ty), mask=in_row)

    # colocated vLLM would report their first compile, in the first update, as an inference latency spike
    drop_vllm_compile_warnings(KERNEL_NAMES)
    return logsumexp_rows, logprob_grad_rows


def available(logits: Tensor) -> bool:
    """Whether ``target_logprobs`` runs for these logits: CUDA, a float dtype, and Triton importable."""
    return logits.is_cuda and logits.is_floating_point() and _kernels() is not None


_MARK = "posttrain_triton_logprobs"  # set on a head module whose chunks take these kernels


def mark_head(head: nn.Module, on: bool) -> None:
    """From now on ``head``'s CUDA chunks take these kernels (``on``) or the fp32 ``log_softmax``."""
    setattr(head, _MARK, on)


def use_triton_head(*models: nn.Module | None, model_cfg: ModelConfig, device: torch.device) -> str:
    """``model.triton_logprob_head``: mark (or unmark) each model's LM head for these kernels; returns
    why, for the log. ``true`` and ``false`` are taken as set (the preflight refused a ``true`` that
    cannot run); ``auto`` marks the heads of a CUDA policy when Triton is installed."""
    from posttrain.models.structure import split_body_and_head

    setting = model_cfg.triton_logprob_head
    if setting != "auto":
        on, note = bool(setting), f"model.triton_logprob_head={str(setting).lower()}"
    elif device.type != "cuda":
        on, note = False, f"model.triton_logprob_head=auto: off, the policy is on {device.type}, not CUDA"
    elif importlib.util.find_spec("triton") is None:
        on, note = False, "model.triton_logprob_head=auto: off, Triton is not installed"
    else:
        on, note = True, "model.triton_logprob_head=auto: on (a CUDA policy, Triton installed)"
    for model in models:
        if model is not None:
            mark_head(split_body_and_head(model)[1], on)
    return note


def enabled_for(head: nn.Module, logits: Tensor) -> bool:
    """Whether ``head``'s chunk of ``logits`` goes through these kernels: marked, and ``available``."""
    return bool(getattr(head, _MARK, False)) and available(logits)


def logsumexp_rows(logits_CV: Tensor, temperature: float) -> Tensor:
    """``lse_C = logsumexp(logits_CV.float() / temperature, -1)``, one read of ``logits_CV``."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("the Triton logprob kernels need Triton (it comes with CUDA builds of torch)")
    rows, vocab = logits_CV.shape
    lse_C = torch.empty(rows, dtype=torch.float32, device=logits_CV.device)
    if rows:
        kernels[0][(rows,)](logits_CV, logits_CV.stride(0), lse_C, vocab, temperature, BLOCK=_BLOCK, num_warps=_WARPS)
    return lse_C


def logprob_grad_rows(logits_CV: Tensor, ids_CJ: Tensor, lse_C: Tensor, grad_CJ: Tensor, temperature: float) -> Tensor:
    """The gradient of ``sum(grad_CJ * logprobs_CJ)`` with respect to ``logits_CV``, in its dtype."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("the Triton logprob kernels need Triton (it comes with CUDA builds of torch)")
    rows, vocab = logits_CV.shape
    grad_CV = torch.empty_like(logits_CV)
    if rows:
        kernels[1][(rows,)](
            logits_CV,
            logits_CV.stride(0),
            lse_C,
            ids_CJ.contiguous(),
            grad_CJ.float().contiguous(),
            grad_CV,
            vocab,
            temperature,
            J=ids_CJ.shape[1],
            BLOCK=_BLOCK,
            num_warps=_WARPS,
        )
    return grad_CV


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits_CV: Tensor, ids_CJ: Tensor, temperature: float) -> Tensor:
        logits_CV = logits_CV.contiguous()  # rows of unit column stride, as the kernels index them
        lse_C = logsumexp_rows(logits_CV, temperature)
        picked_CJ = logits_CV.gather(-1, ids_CJ).float()
        if temperature != 1.0:  # x / 1 == x: no pass at the default
            picked_CJ = picked_CJ / temperature
        ctx.save_for_backward(logits_CV, ids_CJ, lse_C)
        ctx.temperature = temperature
        return picked_CJ - lse_C.unsqueeze(-1)

    @staticmethod
    def backward(ctx: Any, grad_CJ: Tensor) -> tuple[Tensor, None, None]:
        logits_CV, ids_CJ, lse_C = ctx.saved_tensors
        return logprob_grad_rows(logits_CV, ids_CJ, lse_C, grad_CJ, ctx.temperature), None, None


def target_logprobs(logits_CV: Tensor, ids_CJ: Tensor, temperature: float) -> Tensor:
    """``logprobs_CJ[c, j] = log softmax(logits_CV[c].float() / temperature)[ids_CJ[c, j]]`` in fp32,
    differentiable in ``logits_CV``, without an fp32 ``[C, V]`` tensor (see the module docstring).
    CUDA tensors only (``available``)."""
    out: Tensor = _TargetLogprobs.apply(logits_CV, ids_CJ, temperature)
    return out
