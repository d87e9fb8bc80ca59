"""The CPU decode's small matrix products: ``x @ W.T`` (what ``F.linear`` computes) against ``W @ x.T``
(the same product with the operands in the other order, transposed back) at each row count.

Why: the transformers rollout engine's decode multiplies at most one row per running sequence (32 in
the default recipe) by each weight, and on the 2026-12-06 development machine (Intel Xeon, 2 cores,
MKL 2024.2) those products ran at about 70 GFLOP/s where large ones reach 259 (docs/benchmarks.md,
thirty-second session). Prints, per row count, ``linear time / other-order time`` for SmolLM2-135M's five
weight shapes (above 1: the other order is faster), and the large-product rate for scale.

    python benchmarks/cpu_small_products.py [--rows 1,4,8,16,32,64,96,128,256] [--repeats 60]

With ``--layouts`` it times ``F.linear`` itself over each weight stored row-major (as ``nn.Linear``
keeps it) and column-major (what the transformers engine decodes with on an Intel CPU since the
thirty-third session, ``models/cpu_decode_layout.py``), and oneDNN's linear over the weight packed in its
blocked layout (``rollout.cpu_weight_layout=onednn_packed``, where this torch packs): microseconds per
call, then row-major's time over each of the other two.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from posttrain.models.cpu_decode_layout import column_major_copy, onednn_packing, pack_weight, packed_linear

# SmolLM2-135M's weights as (in, out): the MLP's up/gate, its down, attention's query/output, key/value, the head
SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 192), (576, 49152)]


def seconds_per_call(fn: Callable[..., torch.Tensor], repeats: int, *inputs: torch.Tensor) -> float:
    for _ in range(5):
        fn(*inputs)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*inputs)
    return (time.perf_counter() - start) / repeats


def other_order(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` computed as ``(weight @ x.T).T`` (a transposed view, as the probe measured it)."""
    return (weight @ x.t()).t()


def layouts(rows_list: list[int], repeats: int) -> None:
    """Per row count and shape: F.linear's microseconds over a row-major and a column-major weight, and
    oneDNN's over a packed one (where this torch packs), then row-major's time over each of theirs."""
    packs = onednn_packing()
    columns = "row col pack  col x pack x" if packs else "row-major col-major x"
    width = len(columns) + 6
    print("rows  " + "  ".join(f"{k}x{n}".center(width) for k, n in SHAPES))
    print("      " + "  ".join(columns.center(width) for _ in SHAPES))
    linear = torch.nn.functional.linear
    for rows in rows_list:
        cells = []
        for k, n in SHAPES:
            weight, x = torch.randn(n, k), torch.randn(rows, k)
            row_us = seconds_per_call(linear, repeats, x, weight) * 1e6
            col_us = seconds_per_call(linear, repeats, x, column_major_copy(weight)) * 1e6
            if not packs:
                cells.append(f"{row_us:8.0f} {col_us:8.0f} {row_us / col_us:4.1f}".center(width))
                continue
            product = functools.partial(packed_linear, packed=pack_weight(weight))
            pack_us = seconds_per_call(product, repeats, x) * 1e6
            cell = f"{row_us:6.0f} {col_us:6.0f} {pack_us:6.0f} {row_us / col_us:4.1f} {row_us / pack_us:4.1f}"
            cells.append(cell.center(width))
        print(f"{rows:<5} " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64,96,128,256", help="row counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--layouts", action="store_true", help="F.linear over row- and column-major weights; oneDNN over packed ones"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    big = torch.randn(1024, 1024)
    rate = 2 * 1024**3 / seconds_per_call(torch.mm, 10, big, big) / 1e9
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; 1024^3 product: {rate:.0f} GFLOP/s")
    if args.layouts:
        layouts([int(r) for r in args.rows.split(",")], args.repeats)
        return
    print("rows  " + "  ".join(f"{k}x{n}" for k, n in SHAPES) + "   (linear time / other-order time)")
    for rows in (int(r) for r in args.rows.split(",")):
        ratios = []
        for k, n in SHAPES:
            weight, x = torch.randn(n, k), torch.randn(rows, k)
            linear = seconds_per_call(torch.nn.functional.linear, args.repeats, x, weight)
            other = seconds_per_call(other_order, args.repeats, x, weight)
            ratios.append(f"{linear / other:.2f}".rjust(len(f"{k}x{n}")))
        print(f"{rows:<5} " + "  ".join(ratios))


if __name__ == "__main__":
    main()
