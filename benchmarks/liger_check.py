"""Liger-Kernel's fused RMSNorm, SwiGLU and RoPE (Triton, CUDA only) against the transformers
modules they replace, in posttrain's GPU precision (fp32 weights, bf16 autocast): the same random
0.4B Llama and tokens through both, per-token logprobs and the parameters' gradients compared.

    python benchmarks/liger_check.py [--shape 0.5b] [--out r.json]

Liger is an opt-in experiment here (issue 18: the eager update spends most of its time outside the
matrix products); this script answers "does it compute the same thing" before any timing counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from update_precision import make_model


def logprobs_and_grads(
    model: torch.nn.Module, ids_BL: torch.Tensor, autocast: bool = True
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids_BL, use_cache=False).logits[:, :-1].float()
    logp_BT = torch.log_softmax(logits, -1).gather(-1, ids_BL[:, 1:, None]).squeeze(-1)
    logp_BT.mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp_BT.detach(), grads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=300)
    p.add_argument("--out")
    args = p.parse_args()
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    model = make_model(args.shape, torch.float32, "cuda")
    ids_BL = torch.randint(100, 40000, (args.batch, args.length), generator=torch.Generator().manual_seed(0)).cuda()
    fp32_lp, fp32_g = logprobs_and_grads(model, ids_BL, autocast=False)  # the yardstick of both
    ref_lp, ref_g = logprobs_and_grads(model, ids_BL)
    # a second eager pass: bf16 autocast's own run-to-run spread, the yardstick for Liger's
    again_lp, again_g = logprobs_and_grads(model, ids_BL)
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=False, model=model)
    lig_lp, lig_g = logprobs_and_grads(model, ids_BL)

    def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)).item() for n in b)

    result = {
        "shape": args.shape,
        "tokens": args.batch * args.length,
        "logprob_max_abs_diff_liger": (lig_lp - ref_lp).abs().max().item(),
        "logprob_max_abs_diff_eager_again": (again_lp - ref_lp).abs().max().item(),
        "grad_max_rel_diff_liger": rel(lig_g, ref_g),
        "grad_max_rel_diff_eager_again": rel(again_g, ref_g),
        "logprob_max_abs_err_eager_vs_fp32": (ref_lp - fp32_lp).abs().max().item(),
        "logprob_max_abs_err_liger_vs_fp32": (lig_lp - fp32_lp).abs().max().item(),
        "grad_max_rel_err_eager_vs_fp32": rel(ref_g, fp32_g),
        "grad_max_rel_err_liger_vs_fp32": rel(lig_g, fp32_g),
        "params_with_grad": [len(ref_g), len(lig_g)],
    }
    print("LIGERCHECK " + json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
