"""RMSNorm forward and backward alone, Liger-Kernel's kernels against posttrain's
(``models/block_kernels.py``) and torch's eager module, at the update's shapes (CUDA).

    python benchmarks/block_kernels.py [--reps 50] [--out r.json]

For each shape (W's micro-batch of 64 rows x 300 tokens at the 0.4B width; 32 rows at the 1.5B),
each implementation runs forward then backward ``--reps`` times after a warm-up, timed with CUDA
events around each half while the GPU is kept busy as the host queues them (so launches do not count);
the line gives the median microseconds, the bandwidth that implies from the bytes each half must
move, and the largest difference of output and gradients from a float64 reference on the same bf16
inputs, relative to that tensor's largest value. Nothing else runs in the process.
``--norm-sweep`` adds posttrain arms with other tilings. (The twenty-eighth session also timed a flat
SwiGLU kernel here: no faster than Liger's, which runs at the memory's bandwidth, so it was dropped;
``results/norm28_h100_2026-12-06/``.)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from posttrain.models import block_kernels
from posttrain.models.block_kernels import rms_norm

NORM_SHAPES = {"0.5b": (19200, 896), "1.5b": (9600, 1536)}
EPS = 1e-6


def _eager_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _liger() -> dict:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # in_place as Liger's Llama patch sets it (dx written over dy)
    return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", True)


def _time(fn, make_inputs, grad_out, reps: int) -> tuple[float, float]:
    fwd, bwd = [], []
    for i in range(reps + 3):
        inputs = make_inputs()
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        # keep the GPU busy while the host queues both halves, so the events time the GPU's work and not
        # the host's launches (a launch-bound half would otherwise read as slow as its Python)
        torch.cuda._sleep(20_000_000)
        e0.record()
        out = fn(*inputs)
        e1.record()
        torch.autograd.grad(out, inputs, grad_out)  # no accumulation into .grad: only the op's backward
        e2.record()
        torch.cuda.synchronize()
        if i >= 3:
            fwd.append(e0.elapsed_time(e1) * 1e3)
            bwd.append(e1.elapsed_time(e2) * 1e3)
    return statistics.median(fwd), statistics.median(bwd)


def _errors(fn, leaves, grad_out, reference) -> float:
    clones = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*clones)
    out.backward(grad_out)
    got = [out.detach(), *(c.grad for c in clones)]
    # relative to each tensor's largest value: the weight's gradient sums thousands of rows
    return max(float((g.double() - r).abs().max() / r.abs().max()) for g, r in zip(got, reference, strict=True))


def _reference(fn, leaves, grad_out) -> list[torch.Tensor]:
    doubles = [t.detach().double().requires_grad_() for t in leaves]
    out = fn(*doubles)
    out.backward(grad_out.double())
    return [out.detach(), *(d.grad for d in doubles)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--norm-sweep",
        default="",
        help="extra posttrain RMSNorm arms, TILE:PROGRAMS_PER_SM,... (elements per tile, backward programs per SM)",
    )
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    impls: dict[str, dict] = {"eager": {"norm": _eager_norm}, "posttrain": {"norm": lambda x, w: rms_norm(x, w, EPS)}}
    for spec in filter(None, args.norm_sweep.split(",")):
        tile, per_sm = (int(v) for v in spec.split(":"))
        impls[f"pt_{tile}_{per_sm}"] = {"norm": impls["posttrain"]["norm"], "tiling": (tile, per_sm)}
    try:
        impls["liger"] = {"norm": _liger()}
    except ImportError as exc:
        print(f"liger-kernel not here ({exc}); timing eager and posttrain only")
    default_tiling = (block_kernels._TILE, block_kernels._PROGRAMS_PER_SM)
    rows = []
    for shape_name, (n, h) in NORM_SHAPES.items():
        x0 = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
        w0 = (1 + 0.1 * torch.randn(h, device=dev)).to(torch.bfloat16)
        grad_out = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
        # bytes each half must move: forward reads x and writes y; backward reads dy and x, writes dx
        fwd_bytes, bwd_bytes = 2 * x0.nbytes, 3 * x0.nbytes
        reference = _reference(_eager_norm, [x0, w0], grad_out)
        for impl_name, impl in impls.items():
            block_kernels._TILE, block_kernels._PROGRAMS_PER_SM = impl.get("tiling", default_tiling)
            fn = impl["norm"]

            def make_inputs(x0=x0, w0=w0):
                return [x0.clone().requires_grad_(), w0.clone().requires_grad_()]

            # a copy of dy: Liger's backward writes dx over it
            fwd_us, bwd_us = _time(fn, make_inputs, grad_out.clone(), args.reps)
            err = _errors(fn, [x0, w0], grad_out.clone(), reference)
            row = {
                "shape": shape_name,
                "rows": n,
                "cols": h,
                "impl": impl_name,
                "forward_us": round(fwd_us, 1),
                "backward_us": round(bwd_us, 1),
                "forward_tb_s": round(fwd_bytes / fwd_us / 1e6, 2),
                "backward_tb_s": round(bwd_bytes / bwd_us / 1e6, 2),
                "max_rel_error": err,
            }
            rows.append(row)
            print(
                f"rms_norm {shape_name:4s} {n}x{h}  {impl_name:11s}  fwd {fwd_us:6.1f} us ({row['forward_tb_s']} TB/s)"
                f"  bwd {bwd_us:6.1f} us ({row['backward_tb_s']} TB/s)  max |err| / max |ref| {err:.3g}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
