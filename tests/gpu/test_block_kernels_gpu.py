"""``models/block_kernels.py``'s RMSNorm kernels compiled on CUDA (``pytest -m gpu`` on the device
machine, ``benchmarks/side_by_side.sh norm28``): against float64 next to Liger-Kernel's kernels and the
eager module, at the update's shapes, and in a Liger-patched model's update."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from posttrain.models.block_kernels import RMSNormRows, rms_norm

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from block_kernels_interpreted import EPS, eager_rms_norm, outputs  # the CPU check's reference and driver
from call_counts import count_calls

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")


@pytest.mark.parametrize(
    ("rows", "hidden"), [(19200, 896), (9600, 1536), (4097, 3584), (3, 5000), (1000, 100), (38400, 128)]
)
def test_the_kernels_are_as_close_to_float64_as_liger_and_eager(rows: int, hidden: int) -> None:
    """W's and the 1.5B shape's micro-batches, Qwen2.5-7B's width with a partial last tile, a width
    above the tile, a width that is not a power of two, Qwen3's per-head query/key norm (8 heads of 128 over
    a 4,800-token micro-batch): output, input and weight gradients no further
    from float64 than the eager module's bf16 (and Liger's, when installed) by more than one rounding."""
    g = torch.Generator(device="cuda").manual_seed(rows + hidden)
    x = (2 * torch.randn(rows, hidden, device="cuda", generator=g)).bfloat16()
    w = (1 + 0.2 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    dy = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    exact = outputs(eager_rms_norm, x.double(), w.double(), dy.double())
    others = {"eager": outputs(eager_rms_norm, x, w, dy)}
    try:
        from liger_kernel.ops import LigerRMSNormFunction

        others["liger"] = outputs(lambda a, b: LigerRMSNormFunction.apply(a, b, EPS, 0.0, "llama", False), x, w, dy)
    except ImportError:
        pass
    ours = outputs(lambda a, b: rms_norm(a, b, EPS), x, w, dy)
    for i, name in enumerate(("y", "dx", "dw")):
        scale = exact[i].abs().max().item()
        err = (ours[i].double() - exact[i]).abs().max().item()
        best = min((o[i].double() - exact[i]).abs().max().item() for o in others.values())
        assert ours[i].dtype == torch.bfloat16 and ours[i].shape == exact[i].shape
        assert err <= best + 2**-7 * scale, (name, err, best, scale)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_fused_kernel_policy_updates_through_the_row_kernels(
    family: str, smollm2_tokenizer_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny policy of each type ``model.fused_kernels`` patches, patched as it patches a policy: every
    RMSNorm runs these kernels (Qwen3's per-head query and key norms, 128 wide as in the real models, too),
    and its logits and gradients match the same model on Liger's RMSNorm to bf16 noise."""
    pytest.importorskip("liger_kernel", reason="model.fused_kernels needs liger-kernel")
    import importlib

    from transformers import AutoModelForCausalLM

    from posttrain.models.block_kernels import use_liger_rms_norm, use_rows_rms_norm
    from posttrain.models.fused_kernels import FUSED_MODEL_TYPES, apply_fused_kernels
    from posttrain.models.tiny import make_tiny_model

    # the patch leaves the type's module-level rotary function dispatching to Liger's on CUDA, by design
    # (models/fused_kernels.py); put it back after this test, as test_fused_kernels_gpu.py starts unpatched
    modeling = importlib.import_module(FUSED_MODEL_TYPES[family][0])
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)
    model_dir = make_tiny_model(
        str(tmp_path), smollm2_tokenizer_dir, family=family, hidden_size=256, num_heads=2, num_kv_heads=1
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    rms_norms = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
    apply_fused_kernels(model)
    norms = use_rows_rms_norm(model)
    per_layer = 4 if family == "qwen3" else 2
    assert norms == rms_norms == per_layer * model.config.num_hidden_layers + 1
    ids = torch.randint(100, 40000, (4, 96), generator=torch.Generator().manual_seed(0)).cuda()

    def logits_and_grads() -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits.float()
        logits.logsumexp(-1).mean().backward()
        return logits.detach(), torch.cat([p.grad.float().flatten() for p in model.parameters()])

    calls: dict[str, int] = {}
    count_calls(monkeypatch, RMSNormRows, "apply", calls, "rows")
    rows_logits, rows_grads = logits_and_grads()
    assert calls == {"rows": norms}
    use_liger_rms_norm(model)
    liger_logits, liger_grads = logits_and_grads()
    assert (rows_logits - liger_logits).abs().max().item() <= 0.05 * liger_logits.abs().max().item()
    assert ((rows_grads - liger_grads).norm() / liger_grads.norm()).item() < 0.02
