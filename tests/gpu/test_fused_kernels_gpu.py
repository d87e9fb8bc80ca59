"""``model.fused_kernels`` on CUDA (Liger-Kernel's Triton RMSNorm, SwiGLU and RoPE; ``pytest -m gpu`` on
the device machine with liger-kernel installed, ``benchmarks/side_by_side.sh fused``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from posttrain.models.fused_kernels import apply_fused_kernels

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda_and_liger() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    pytest.importorskip("liger_kernel", reason="model.fused_kernels needs liger-kernel")


def _logprobs_and_grads(model: nn.Module, ids_BL: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids_BL, use_cache=False).logits[:, :-1].float()
    logp_BT = torch.log_softmax(logits, -1).gather(-1, ids_BL[:, 1:, None]).squeeze(-1)
    (logp_BT * torch.linspace(-1, 1, logp_BT.shape[1], device=ids_BL.device)).mean().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return logp_BT.detach(), grads


def test_fused_kernels_are_as_accurate_as_eager_mixed_precision(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    original_norm = modeling_llama.LlamaRMSNorm
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda()
    ids_BL = torch.randint(100, 40000, (4, 96), generator=torch.Generator().manual_seed(0)).cuda()
    exact_lp, exact_g = _logprobs_and_grads(model, ids_BL, autocast=False)  # fp32: the yardstick
    eager_lp, eager_g = _logprobs_and_grads(model, ids_BL, autocast=True)
    assert apply_fused_kernels(model) == "llama"
    fused_lp, fused_g = _logprobs_and_grads(model, ids_BL, autocast=True)

    assert model.model.layers[0].mlp._get_name() == "LigerSwiGLUMLP"  # the instance is patched
    assert not torch.equal(fused_lp, eager_lp)  # the fused kernels ran (they round differently)
    eager_err = (eager_lp - exact_lp).abs().max().item()
    assert (fused_lp - exact_lp).abs().max().item() <= 1.5 * eager_err + 1e-3
    eager_grad_err = ((eager_g - exact_g).norm() / exact_g.norm()).item()
    assert ((fused_g - exact_g).norm() / exact_g.norm()).item() <= 1.5 * eager_grad_err + 1e-3

    # Liger's module-wide half is undone: a model built afterwards is plain, and runs on the CPU
    # (the rotary function there takes the original path; Triton cannot run on a CPU)
    assert modeling_llama.LlamaRMSNorm is original_norm
    cpu_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert type(cpu_model.model.norm) is original_norm
    with torch.no_grad():
        cpu_model(input_ids=ids_BL.cpu(), use_cache=False)


def test_a_run_with_fused_kernels_trains_and_its_reference_is_patched_alike(
    tiny_model_dir: str, grpo_run: Callable[..., Any]
) -> None:
    kl = ["rl.kl_beta=0.1", "rl.ref.build_ref=true", "rl.kl_coeff_clamp=5"]
    _, run_dir, records = grpo_run(tiny_model_dir, "model.fused_kernels=true", *kl)
    assert "run Liger-Kernel's Triton kernels" in (run_dir / "train.log").read_text()
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0 for r in records)
    # before the first update the policy is the reference: with the same kernels, the same logprobs
    assert records[0]["train/kl_max"] == 0.0
    assert records[-1]["train/kl_max"] > 0.0
