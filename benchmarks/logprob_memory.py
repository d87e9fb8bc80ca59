"""Peak memory of per-token logprobs: posttrain's chunked LM head against the naive log_softmax.

    python benchmarks/logprob_memory.py [--rows 16] [--tokens 1024] [--vocab 151936] [--hidden 896]
                                        [--chunk 1024] [--dtype bfloat16] [--out results.json]

Forward and backward of ``sum(logprob of the realized token)`` with respect to the hidden states
and the LM-head weight, for ``rows x tokens`` positions. The naive path materialises the
``[rows*tokens, vocab]`` logits, upcasts them to fp32 and takes a full log_softmax (what a plain
``model(...).logits.float().log_softmax(-1)`` does); the chunked path is
``posttrain.policy.logprobs.chunked_head_logprobs`` (fp32 logits of one chunk at a time, recomputed
in backward). On CUDA the figure is ``torch.cuda.max_memory_allocated`` above the inputs, and the
script also checks that both paths give the same logprobs. On a CPU each path runs in a fresh
subprocess and the figure is the growth of its peak resident memory (``ru_maxrss``) over the inputs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from posttrain.policy.logprobs import chunked_head_logprobs


def naive(hidden_NH: Tensor, ids_N: Tensor, head: nn.Module) -> Tensor:
    logp_NV = head(hidden_NH).float().log_softmax(dim=-1)
    return logp_NV.gather(-1, ids_N[:, None])[:, 0]


def chunked(chunk: int) -> Callable[[Tensor, Tensor, nn.Module], Tensor]:
    def run(hidden_NH: Tensor, ids_N: Tensor, head: nn.Module) -> Tensor:
        return chunked_head_logprobs(
            hidden_NH, ids_N[:, None], head, temperature=1.0, softcap=None, chunk_tokens=chunk
        )[:, 0]

    return run


def _rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_isolated(args: argparse.Namespace) -> dict[str, int]:
    """Each path's peak RSS growth over its inputs, measured in a subprocess of its own."""
    import subprocess
    import sys

    out = {}
    for name in ("chunked", "naive"):
        cmd = [sys.executable, __file__, "--only", name, *sys.argv[1:]]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[name] = int(res.stdout.strip().splitlines()[-1])
    return out


def measure(
    fn: Callable[[Tensor, Tensor, nn.Module], Tensor], hidden_NH: Tensor, ids_N: Tensor, head: nn.Module
) -> dict[str, object]:
    """Peak bytes above the inputs, seconds, and the outputs for the equality check."""
    cuda = hidden_NH.device.type == "cuda"
    hidden = hidden_NH.detach().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    logprobs = fn(hidden, ids_N, head)
    logprobs.sum().backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if cuda else _rss_bytes()
    grad_w = next(head.parameters()).grad
    assert hidden.grad is not None and grad_w is not None
    return {
        "peak_bytes": peak,
        "seconds": seconds,
        "logprobs": logprobs.detach(),
        "grad_hidden": hidden.grad.detach(),
        "grad_weight": grad_w.detach().clone(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    n = args.rows * args.tokens
    head = nn.Linear(args.hidden, args.vocab, bias=False).to(device=device, dtype=dtype)
    hidden_NH = torch.randn(n, args.hidden, device=device, dtype=dtype)
    ids_N = torch.randint(0, args.vocab, (n,), device=device)
    if args.only:  # CPU child: one path, print its peak RSS growth over the inputs
        base = _rss_bytes()
        fn = chunked(args.chunk) if args.only == "chunked" else naive
        measure(fn, hidden_NH, ids_N, head)
        print(_rss_bytes() - base)
        return
    if device.type == "cpu":
        peaks = cpu_isolated(args)
        report_cpu = {"device": "cpu", "rows": args.rows, "tokens": args.tokens, "vocab": args.vocab}
        report_cpu |= {f"{k}_peak_gib": round(v / 2**30, 3) for k, v in peaks.items()}
        report_cpu["chunked_over_naive"] = round(peaks["chunked"] / max(1, peaks["naive"]), 3)
        print(json.dumps(report_cpu, indent=2))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report_cpu, f, indent=2)
        return
    results = {}
    for name, fn in (("chunked", chunked(args.chunk)), ("naive", naive)):
        measure(fn, hidden_NH, ids_N, head)  # warm-up (kernels, allocator)
        results[name] = measure(fn, hidden_NH, ids_N, head)
    same_lp = torch.allclose(results["chunked"]["logprobs"], results["naive"]["logprobs"], atol=1e-3)  # type: ignore[arg-type]
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "rows": args.rows,
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "chunk": args.chunk,
        "dtype": args.dtype,
        "same_logprobs": same_lp,
        **{f"{k}_peak_gib": round(int(v["peak_bytes"]) / 2**30, 3) for k, v in results.items()},  # type: ignore[call-overload]
        **{f"{k}_seconds": round(float(v["seconds"]), 4) for k, v in results.items()},  # type: ignore[arg-type]
    }
    if device.type == "cuda":
        report["chunked_over_naive"] = round(report["chunked_peak_gib"] / max(1e-9, report["naive_peak_gib"]), 3)  # type: ignore[operator]
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
