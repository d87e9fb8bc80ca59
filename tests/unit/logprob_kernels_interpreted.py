"""The logprob head's Triton kernels (``policy/logprob_kernels.py``) against float64, in Triton's
interpreter: run by ``tests/unit/test_logprob_kernels.py`` as a process of its own with
``TRITON_INTERPRET=1``, which must be set before Triton is first imported (its standard library, such
as ``tl.max``, is jitted at import). Prints ``ok <case>`` per case; an assertion fails the process."""

from __future__ import annotations

import os

import torch

from posttrain.policy import logprob_kernels

# (vocabulary, ids per row, temperature): a multiple of the kernels' block, a partial last block,
# one block exactly, two blocks and 7 columns, less than a block
CASES = [(5000, 1, 1.0), (5000, 3, 0.7), (4096, 2, 1.0), (8192 + 7, 1, 1.0), (100, 1, 1.3)]


def float64_logprobs(logits_CV: torch.Tensor, ids_CJ: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits_CV.double() / temperature, dim=-1).gather(-1, ids_CJ)


def check_case(vocab: int, columns: int, temperature: float) -> None:
    torch.manual_seed(vocab + columns)
    rows = 6
    logits_CV = (torch.randn(rows, vocab) * 3).to(torch.bfloat16).requires_grad_(True)
    ids_CJ = torch.randint(vocab, (rows, columns))
    ids_CJ[0] = ids_CJ[0, 0]  # one row's ids all the same logit: their gradients add up there
    ids_CJ[1, 0] = vocab - 1  # the last column, in the last (partial) block
    out_CJ = logprob_kernels.target_logprobs(logits_CV, ids_CJ, temperature)
    want_CJ = float64_logprobs(logits_CV, ids_CJ, temperature)
    assert out_CJ.dtype == torch.float32
    value_err = (out_CJ.double() - want_CJ).abs().max().item()
    assert value_err < 1e-5, value_err

    weights_CJ = torch.randn(rows, columns)
    (grad_CV,) = torch.autograd.grad((out_CJ * weights_CJ).sum(), [logits_CV])
    logits64_CV = logits_CV.detach().double().requires_grad_(True)  # the gradient before any rounding
    (want_grad_CV,) = torch.autograd.grad(
        (float64_logprobs(logits64_CV, ids_CJ, temperature) * weights_CJ.double()).sum(), [logits64_CV]
    )
    assert grad_CV.dtype == torch.bfloat16
    # the fp32 gradient cast once to bf16: within one bf16 ulp of each element (at most 2^-7 of it), and
    # a hair more for fp32's own rounding. One ulp, not half: the interpreter truncates an fp32 -> bf16
    # cast where the GPU rounds it to nearest (triton.language.semantic.cast's default, RTNE)
    err_CV = (grad_CV.double() - want_grad_CV).abs()
    bound_CV = want_grad_CV.abs() * 2**-7 * 1.001 + 1e-12
    assert (err_CV <= bound_CV).all(), (err_CV / bound_CV).max().item()


def check_large_range() -> None:
    """The online log-sum-exp rescales its running sum as the maximum grows from block to block: a row
    whose logits climb to 1e4 and one that holds its maximum in the first block both stay finite."""
    vocab = 3 * 4096
    logits_CV = torch.stack([torch.linspace(-1e4, 1e4, vocab), torch.linspace(1e4, -1e4, vocab)]).to(torch.bfloat16)
    ids_CJ = torch.tensor([[vocab - 1], [0]])
    out_CJ = logprob_kernels.target_logprobs(logits_CV, ids_CJ, 1.0)
    assert torch.isfinite(out_CJ).all(), out_CJ
    assert (out_CJ.double() - float64_logprobs(logits_CV, ids_CJ, 1.0)).abs().max().item() < 1e-3


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for case in CASES:
        check_case(*case)
        print(f"ok vocab={case[0]} ids={case[1]} temperature={case[2]}", flush=True)
    check_large_range()
    print("ok large range", flush=True)


if __name__ == "__main__":
    main()
