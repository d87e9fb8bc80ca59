"""``models/cpu_decode_layout.py``: inside ``column_major_linears`` every fp32 CPU linear weight reads
as a column-major copy of itself (tied weights one copy), the model computes the same logits up to
rounding, and the parameters themselves come back untouched, also after an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn


def _tiny_tied_llama(tokenizer_dir: str, tmp_path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from posttrain.models.tiny import make_tiny_model

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(str(tmp_path), tokenizer_dir))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the embedded default ties them too
    return model.eval()


def _linear_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: m.weight for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_inside_every_linear_weight_is_a_column_major_copy(smollm2_tokenizer_dir: str, tmp_path: Path) -> None:
    from posttrain.models.cpu_decode_layout import column_major_linears

    model = _tiny_tied_llama(smollm2_tokenizer_dir, tmp_path)
    params = _linear_weights(model)
    ids = torch.tensor([[5, 9, 2, 7], [3, 3, 8, 1]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        with column_major_linears(model):
            inside = _linear_weights(model)
            after_swap = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert len(inside) == 15  # 7 per layer and the head
    for name, weight in inside.items():
        original = params[name]
        assert weight is not original, name
        assert weight.stride() == (1, original.shape[0]), name  # [in, out] row-major, seen as [out, in]
        assert torch.equal(weight, original), name
    # the tied head's copy is its own: the embedding still reads the parameter (a row gather)
    assert model.model.embed_tokens.weight is params["lm_head"]
    torch.testing.assert_close(after_swap, before, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, before)
    assert _linear_weights(model) == params  # the same Parameter objects back
    assert all(p.is_contiguous() for p in model.parameters())


def test_tied_linears_share_one_copy_and_other_dtypes_stay() -> None:
    from posttrain.models.cpu_decode_layout import column_major_linears

    shared = nn.Linear(6, 4, bias=False)
    model = nn.Sequential(shared, nn.ReLU(), nn.Linear(4, 6).to(torch.bfloat16))
    twin = nn.Linear(6, 4, bias=False)
    twin.weight = shared.weight  # tied: one Parameter in two modules
    model.append(twin)
    param = shared.weight
    with torch.no_grad(), column_major_linears(model):
        assert model[0].weight is model[3].weight
        assert model[0].weight is not param and model[0].weight.stride() == (1, 4)
        assert model[2].weight.dtype == torch.bfloat16 and model[2].weight.is_contiguous()  # left alone
    assert model[0].weight is param and model[3].weight is param


def test_an_error_inside_still_puts_the_parameters_back() -> None:
    from posttrain.models.cpu_decode_layout import column_major_linears

    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    params = [m.weight for m in model]
    with pytest.raises(RuntimeError, match="mid-decode"), torch.no_grad(), column_major_linears(model):
        assert model[0].weight is not params[0]
        raise RuntimeError("mid-decode")
    assert [m.weight for m in model] == params


@pytest.mark.parametrize("rows", [1, 255, 256, 600])
def test_the_blockwise_copy_holds_every_value_column_major(rows: int) -> None:
    from posttrain.models.cpu_decode_layout import column_major_copy

    weight = torch.randn(rows, 7)
    copy = column_major_copy(weight)
    assert copy.shape == weight.shape and copy.stride() == (1, rows)
    assert torch.equal(copy, weight)
    assert copy.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()


def test_auto_decodes_column_major_on_an_intel_cpu_with_mkl_only() -> None:
    from posttrain.models.cpu_decode_layout import column_major_choice

    assert column_major_choice("auto", vendor="GenuineIntel", mkl=True) == (
        True,
        "rollout.cpu_weight_layout=auto: column_major (an Intel CPU with MKL)",
    )
    assert column_major_choice("auto", vendor="AuthenticAMD", mkl=True) == (
        False,
        "rollout.cpu_weight_layout=auto: row_major (the CPU is AuthenticAMD, not Intel)",
    )
    assert column_major_choice("auto", vendor="GenuineIntel", mkl=False) == (
        False,
        "rollout.cpu_weight_layout=auto: row_major (torch has no MKL)",
    )
    for vendor in ("GenuineIntel", "AuthenticAMD"):  # a setting other than auto is taken as set
        assert column_major_choice("column_major", vendor=vendor, mkl=True)[0] is True
        assert column_major_choice("row_major", vendor=vendor, mkl=True)[0] is False
    with pytest.raises(ValueError, match="got 'colum_major'"):  # a typo is not taken for row_major
        column_major_choice("colum_major", vendor="GenuineIntel", mkl=True)


def test_this_machines_vendor_is_read_from_cpuinfo() -> None:
    from posttrain.models.cpu_decode_layout import cpu_vendor

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo here")
    vendor_lines = [line for line in cpuinfo.read_text().splitlines() if line.startswith("vendor_id")]
    if not vendor_lines:
        pytest.skip("this CPU's /proc/cpuinfo names no vendor_id (not x86)")
    assert cpu_vendor() == vendor_lines[0].split(":", 1)[1].strip()


@pytest.mark.parametrize("layout", ["row_major", "column_major"])
def test_the_engine_decodes_with_the_weights_in_the_layout_set(
    layout: str, smollm2_tokenizer_dir: str, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf_engine import HFRolloutEngine

    model = _tiny_tied_llama(smollm2_tokenizer_dir, tmp_path)
    head = model.lm_head.weight
    strides: list[tuple[int, ...]] = []
    model.lm_head.register_forward_pre_hook(lambda module, args: strides.append(module.weight.stride()))
    engine = HFRolloutEngine(model, AutoTokenizer.from_pretrained(smollm2_tokenizer_dir), cpu_weight_layout=layout)
    assert engine.weight_layout_note == f"rollout.cpu_weight_layout={layout}"
    engine.generate([[5, 9, 2], [7, 3]], 2, SamplingParams(max_tokens=3, seed=0))
    expected = (1, head.shape[0]) if layout == "column_major" else head.stride()
    assert strides and set(strides) == {expected}  # the prefill and every decode step
    assert model.lm_head.weight is head
