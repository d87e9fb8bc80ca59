"""What the policy update of issue 9's workload could reach if only its matrix products took time.

    python benchmarks/gemm_bound.py [--tokens 19200] [--layers 24] [--out gemm_bound.json]

The update's 6N FLOPs are almost all matrix products: per decoder layer q, k, v, o, gate, up and down
projections, and the LM head. This script times exactly those products, at the shapes one
micro-batch of the workload gives them (64 sequences x 300 tokens = 19,200 rows by default;
hidden 896, intermediate 4,864, 14 query and 2 key/value heads of 64, vocabulary 49,152), each with
its forward product and its two backward products (input and weight gradients), in bf16 on the GPU.
The head runs in chunks of ``--head-chunk`` rows, as posttrain's chunked logprob head does.

The result is the ceiling on update MFU (6N per trained token, against 989 TFLOP/s) set by the matrix
products alone at these shapes: attention, norms, activations, the optimizer and every launch are
free in it. The measured update can only be slower.
"""

from __future__ import annotations

import argparse
import json

import torch

PEAK_BF16_FLOPS = 989e12


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def linear_fwd_bwd_ms(rows: int, d_in: int, d_out: int) -> float:
    """Forward ``x @ w.T`` plus the two backward products, [rows, d_in] x [d_out, d_in]."""
    x = torch.randn(rows, d_in, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(rows, d_out, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        torch.mm(x, w.t())
        torch.mm(dy, w)
        torch.mm(dy.t(), x)

    return time_ms(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=19200, help="rows of one micro-batch")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per update (256 / 64)")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--head-chunk", type=int, default=1024)
    p.add_argument("--params", type=float, default=401.9e6, help="N of the 6N count")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    h, q, kv = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
    shapes = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, a.intermediate),
              "up": (h, a.intermediate), "down": (a.intermediate, h)}  # fmt: skip
    per_layer = {name: linear_fwd_bwd_ms(a.tokens, *shape) for name, shape in shapes.items()}
    chunks = -(-a.tokens // a.head_chunk)
    head_ms = linear_fwd_bwd_ms(a.head_chunk, h, a.vocab) * chunks
    body_ms = sum(per_layer.values()) * a.layers
    update_s = (body_ms + head_ms) * a.micro_batches / 1e3
    trained = a.tokens * a.micro_batches
    flops = 6 * a.params * trained
    gemm_flops = 6 * trained * (a.layers * sum(i * o for i, o in shapes.values()) + h * a.vocab)
    result = {
        "device": torch.cuda.get_device_name(),
        "rows_per_micro_batch": a.tokens,
        "micro_batches": a.micro_batches,
        "per_layer_ms": {k: round(v, 3) for k, v in per_layer.items()},
        "head_ms_per_micro_batch": round(head_ms, 3),
        "matmul_only_update_s": round(update_s, 4),
        "matmul_tflops_achieved": round(gemm_flops / update_s / 1e12, 1),
        "mfu_ceiling_6N": round(flops / update_s / PEAK_BF16_FLOPS, 3),
    }
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
