"""``model.fused_kernels`` on CUDA (Liger-Kernel's Triton RMSNorm, SwiGLU and RoPE; ``pytest -m gpu`` on
the device machine with liger-kernel installed, ``benchmarks/side_by_side.sh fused``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from posttrain.models.fused_kernels import apply_fused_kernels

sys.path.insert(0, str(Path(__file__).parent))
from call_counts import count_calls

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda_and_liger() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    pytest.importorskip("liger_kernel", reason="model.fused_kernels needs liger-kernel")


def _logits_and_grads(model: nn.Module, ids_BL: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits_BTV = model(input_ids=ids_BL, use_cache=False).logits[:, :-1].float()
    logp_BT = torch.log_softmax(logits_BTV, -1).gather(-1, ids_BL[:, 1:, None]).squeeze(-1)
    (logp_BT * torch.linspace(-1, 1, logp_BT.shape[1], device=ids_BL.device)).mean().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return logits_BTV.detach(), grads


def test_fused_kernels_run_and_are_as_accurate_as_eager_mixed_precision(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from liger_kernel.ops import LigerRMSNormFunction, LigerSiLUMulFunction
    from liger_kernel.transformers import rope as liger_rope
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    from posttrain.models.block_kernels import RMSNormRows

    calls: dict[str, int] = {}
    count_calls(monkeypatch, RMSNormRows, "apply", calls, "rms_norm")  # Liger's modules, on posttrain's kernels
    count_calls(monkeypatch, LigerRMSNormFunction, "apply", calls, "liger_rms_norm")
    count_calls(monkeypatch, LigerSiLUMulFunction, "apply", calls, "swiglu")
    count_calls(monkeypatch, liger_rope, "dispatch", calls, "rope")  # what liger_rotary_pos_emb calls
    original_norm = modeling_llama.LlamaRMSNorm
    # An earlier fused-kernel policy in this process (a GRPO run with model.fused_kernels=auto, in
    # test_cuda_graphs_gpu.py for one) leaves Llama's module-level rotary function dispatching to Liger's on
    # CUDA, by design (models/fused_kernels.py); start this comparison from the plain one
    installed_rope = modeling_llama.apply_rotary_pos_emb
    monkeypatch.setattr(
        modeling_llama, "apply_rotary_pos_emb", getattr(installed_rope, "posttrain_original", installed_rope)
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda()
    ids_BL = torch.randint(100, 40000, (4, 96), generator=torch.Generator().manual_seed(0)).cuda()
    exact_logits, exact_g = _logits_and_grads(model, ids_BL, autocast=False)  # fp32: the yardstick
    eager_logits, eager_g = _logits_and_grads(model, ids_BL, autocast=True)
    assert calls == {}  # nothing fused before the patch
    assert apply_fused_kernels(model) == "llama"
    fused_logits, fused_g = _logits_and_grads(model, ids_BL, autocast=True)

    assert set(calls) == {"rms_norm", "swiglu", "rope"}, calls  # each of the three kernels ran, not Liger's norm
    # The tiny model's logits are small (its logprobs all sit near -log(49152)), so its logits, not
    # its logprobs, show the bf16 rounding; the fused kernels must not add to it beyond noise.
    eager_err = (eager_logits - exact_logits).abs().max().item()
    assert eager_err > 0
    assert (fused_logits - exact_logits).abs().max().item() <= 2 * eager_err
    eager_grad_err = ((eager_g - exact_g).norm() / exact_g.norm()).item()
    assert ((fused_g - exact_g).norm() / exact_g.norm()).item() <= 2 * eager_grad_err + 1e-4

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
    _, run_dir, records = grpo_run(tiny_model_dir, *kl)  # model.fused_kernels=auto, the default
    assert "model.fused_kernels=auto: on (llama on CUDA with Liger-Kernel)" in (run_dir / "train.log").read_text()
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0 for r in records)
    # before the first update the policy is the reference: with the same kernels, the same logprobs
    assert records[0]["train/kl_max"] == 0.0
    assert records[-1]["train/kl_max"] > 0.0


def test_the_kernels_vllm_would_warn_about_are_named() -> None:
    from posttrain.models.fused_kernels import liger_kernel_names

    # the five that vLLM's JIT monitor reported in a colocated run's first update (2026-12-04)
    logged = {"_rms_norm_forward_kernel", "_rms_norm_backward_kernel", "_swiglu_forward_kernel"}
    assert logged | {"_swiglu_backward_kernel", "_triton_rope"} <= liger_kernel_names()
