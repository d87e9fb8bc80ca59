"""Would merging a decoder layer's sibling projections pay in the update? A probe, not a feature.

    python benchmarks/merged_projections.py [--shapes 0.4b,1.5b] [--out merged.json]

In a Llama-type layer q, k and v read the same normed input, and so do gate and up. Computed as
separate products (as transformers' modules do), each backward gives its own input gradient and
autograd adds them: two bf16 adds of the micro-batch's ``[rows, hidden]`` for q/k/v and one for
gate/up, and the narrow k and v products run at a poor share of the GPU's peak (split-K kernels in
the update's profile, ``docs/benchmarks.md``, twenty-eighth session). Merged, one product of the
concatenated weight does the forward, one the input gradient and one the weight gradient; autograd's
split backward then concatenates the output gradients (one copy of ``[rows, q + 2 kv]``).

Each arm runs forward and backward of exactly that with autograd, bf16, on one micro-batch's rows
(W: 64 x 300 = 19,200 rows, hidden 896, 14 query and 2 key/value heads of 64, intermediate 4,864;
1.5B: 32 x 300 rows, hidden 1,536, 12 and 2 heads of 128, intermediate 8,960):

- ``qkv_separate`` / ``qkv_merged``: the attention's three input products;
- ``qkv_merged_contig``: merged, with q and k made contiguous after the split (what a rotary kernel
  that needs contiguous inputs, Liger's, would copy), and their gradients' copies back;
- ``gateup_separate`` / ``gateup_merged``: the MLP's two input products.

Times are CUDA-event medians per call; the saving, times layers and micro-batches, is what a whole
update could gain from the merge at most (the rest of the layer unchanged).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {  # rows of one micro-batch, hidden, query width, key/value width, intermediate, layers, micro-batches
    "0.4b": (19200, 896, 896, 128, 4864, 24, 4),
    "1.5b": (9600, 1536, 1536, 256, 8960, 28, 8),
}


def time_ms(fn: Callable[[], None], reps: int, device: str) -> float:
    """Median per call over five rounds of ``reps`` calls (CUDA events on a GPU, wall time on a CPU)."""
    import time

    for _ in range(3):
        fn()
    rounds = []
    for _ in range(5):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            rounds.append(start.elapsed_time(end) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            rounds.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(rounds)


def arms(rows: int, dims: tuple[int, ...], *, device: str, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    """Each arm's forward + backward over ``rows`` rows of a layer of ``dims`` (hidden, query, key/value and
    intermediate widths), the weights' gradients accumulating as in an update's micro-batches."""
    hidden, q, kv, inter = dims

    def rand(*shape: int, grad: bool = False) -> torch.Tensor:
        return (torch.randn(*shape, device=device, dtype=dtype) * 0.02).requires_grad_(grad)

    x = rand(rows, hidden, grad=True)
    wq, wk, wv = rand(q, hidden, grad=True), rand(kv, hidden, grad=True), rand(kv, hidden, grad=True)
    wqkv = rand(q + 2 * kv, hidden, grad=True)
    wg, wu, wgu = rand(inter, hidden, grad=True), rand(inter, hidden, grad=True), rand(2 * inter, hidden, grad=True)
    gq, gk, gv = rand(rows, q), rand(rows, kv), rand(rows, kv)
    gg, gu = rand(rows, inter), rand(rows, inter)

    def backward(outs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        torch.autograd.backward(outs, grads)
        x.grad = None  # the input's gradient is made afresh each micro-batch

    def qkv_separate() -> None:
        backward([F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)], [gq, gk, gv])

    def qkv_merged() -> None:
        backward(list(F.linear(x, wqkv).split([q, kv, kv], dim=-1)), [gq, gk, gv])

    def qkv_merged_contig() -> None:
        a, b, c = F.linear(x, wqkv).split([q, kv, kv], dim=-1)
        backward([a.contiguous(), b.contiguous(), c], [gq, gk, gv])

    def gateup_separate() -> None:
        backward([F.linear(x, wg), F.linear(x, wu)], [gg, gu])

    def gateup_merged() -> None:
        backward(list(F.linear(x, wgu).split([inter, inter], dim=-1)), [gg, gu])

    return {
        "qkv_separate": qkv_separate,
        "qkv_merged": qkv_merged,
        "qkv_merged_contig": qkv_merged_contig,
        "gateup_separate": gateup_separate,
        "gateup_merged": gateup_merged,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="0.4b,1.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rows", type=int, default=0, help="override the rows (a CPU smoke run: e.g. 256)")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    results = []
    for name in args.shapes.split(","):
        rows, *dims, layers, micro = SHAPES[name]
        rows = args.rows or rows
        timed = arms(rows, tuple(dims), device=device, dtype=dtype)
        times = {arm: time_ms(fn, args.reps, device) for arm, fn in timed.items()}
        per_update = layers * micro
        saved = {
            "qkv_ms_per_update": (times["qkv_separate"] - times["qkv_merged"]) * per_update,
            "qkv_contig_ms_per_update": (times["qkv_separate"] - times["qkv_merged_contig"]) * per_update,
            "gateup_ms_per_update": (times["gateup_separate"] - times["gateup_merged"]) * per_update,
        }
        row = {"shape": name, "rows": rows, "device": device, "ms_per_call": times, "saved": saved}
        results.append(row)
        print(
            f"{name} ({rows} rows, {device}): "
            + ", ".join(f"{arm} {ms:.3f} ms" for arm, ms in times.items())
            + f" | saved per update: q/k/v {saved['qkv_ms_per_update']:.1f} ms "
            f"({saved['qkv_contig_ms_per_update']:.1f} with the contiguous copies), "
            f"gate/up {saved['gateup_ms_per_update']:.1f} ms"
        )
    if args.out:
        with open(args.out, "w") as f:
            where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
            json.dump({"device": where, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
