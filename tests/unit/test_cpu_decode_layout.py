"""``models/cpu_decode_layout.py``: inside ``column_major_linears`` every fp32 CPU linear weight reads
as a column-major copy of itself (tied weights one copy); inside ``onednn_packed_linears`` every such
linear computes over one packed copy; either way the model computes the same logits up to rounding, the
parameters and modules come back untouched, also after an error, and ``auto`` picks by the machine."""

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


NO_ONEDNN = "this torch has no oneDNN packing"


@pytest.mark.parametrize(
    ("vendor", "mkl", "onednn", "layout", "why"),
    [
        ("GenuineIntel", True, True, "column_major", "an Intel CPU with MKL"),
        ("AuthenticAMD", True, True, "onednn_packed", "the CPU is AuthenticAMD, not Intel"),
        ("GenuineIntel", False, True, "onednn_packed", "torch has no MKL"),
        ("AuthenticAMD", True, False, "row_major", "the CPU is AuthenticAMD, not Intel; " + NO_ONEDNN),
    ],
)
def test_auto_decodes_column_major_on_intel_with_mkl_and_packed_where_torch_packs(
    vendor: str, mkl: bool, onednn: bool, layout: str, why: str
) -> None:
    from posttrain.models.cpu_decode_layout import decode_layout_choice

    assert decode_layout_choice("auto", vendor=vendor, mkl=mkl, onednn=onednn) == (
        layout,
        f"rollout.cpu_weight_layout=auto: {layout} ({why})",
    )


def test_a_layout_other_than_auto_is_taken_as_set_and_a_typo_refused() -> None:
    from posttrain.models.cpu_decode_layout import decode_layout_choice

    for vendor in ("GenuineIntel", "AuthenticAMD"):  # a setting other than auto is taken as set
        for layout in ("row_major", "column_major", "onednn_packed"):
            assert decode_layout_choice(layout, vendor=vendor, mkl=True, onednn=True)[0] == layout
    with pytest.raises(ValueError, match="no oneDNN linear packing"):  # not quietly row_major
        decode_layout_choice("onednn_packed", vendor="AuthenticAMD", mkl=True, onednn=False)
    with pytest.raises(ValueError, match="got 'colum_major'"):  # a typo is not taken for row_major
        decode_layout_choice("colum_major", vendor="GenuineIntel", mkl=True, onednn=True)


def _patched(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if "forward" in m.__dict__]


def test_inside_every_linear_computes_over_one_packed_weight(smollm2_tokenizer_dir: str, tmp_path: Path) -> None:
    from posttrain.models.cpu_decode_layout import onednn_packed_linears, onednn_packing

    if not onednn_packing():
        pytest.skip("this torch has no oneDNN linear packing")
    model = _tiny_tied_llama(smollm2_tokenizer_dir, tmp_path)
    params = {name: p.clone() for name, p in model.named_parameters()}
    packed_weights: list[int] = []
    products: list[torch.Tensor] = []
    reorder, product = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise

    def counting_reorder(weight: torch.Tensor, *args: object) -> torch.Tensor:
        packed_weights.append(id(weight))
        return reorder(weight, *args)

    def counting_product(x: torch.Tensor, weight: torch.Tensor, *args: object) -> torch.Tensor:
        products.append(weight)
        return product(x, weight, *args)

    ids = torch.tensor([[5, 9, 2, 7], [3, 3, 8, 1]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", counting_reorder)
            patch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting_product)
            with onednn_packed_linears(model):
                patched = _patched(model)
                inside = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 15 and patched == linears  # 7 per layer and the head, each with a forward of its own
    assert len(packed_weights) == 15  # the tied head packed once, with the embedding's Parameter
    assert len(products) == 15 and len({id(w) for w in products}) == 15  # the forward's products, all packed
    assert not _patched(model)  # plain modules again
    torch.testing.assert_close(inside, before, rtol=1e-4, atol=1e-4)  # the same products, up to rounding
    assert torch.equal(after, before)
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), name


def test_packing_skips_what_it_cannot_pack_and_an_error_undoes_it() -> None:
    from posttrain.models.cpu_decode_layout import onednn_packed_linears, onednn_packing

    if not onednn_packing():
        pytest.skip("this torch has no oneDNN linear packing")
    own = nn.Linear(6, 6)
    own.forward = lambda x: x  # type: ignore[method-assign]  # a forward set by someone else stays theirs
    twin = nn.Linear(6, 4)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 6).to(torch.bfloat16), own, twin)
    twin.weight = model[0].weight  # tied: one Parameter, one packed copy
    x = torch.randn(3, 6)
    with pytest.raises(RuntimeError, match="mid-decode"), torch.no_grad(), onednn_packed_linears(model):
        assert _patched(model) == [model[0], own, twin]
        assert model[0].forward.keywords["packed"] is twin.forward.keywords["packed"]  # type: ignore[attr-defined]
        assert "forward" not in model[2].__dict__  # the bf16 linear keeps F.linear
        torch.testing.assert_close(model[0](x), nn.functional.linear(x, model[0].weight, model[0].bias))
        torch.testing.assert_close(twin(x), nn.functional.linear(x, twin.weight, twin.bias))  # its own bias
        raise RuntimeError("mid-decode")
    assert _patched(model) == [own]


def test_this_machines_vendor_is_read_from_cpuinfo() -> None:
    from posttrain.models.cpu_decode_layout import cpu_vendor

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo here")
    vendor_lines = [line for line in cpuinfo.read_text().splitlines() if line.startswith("vendor_id")]
    if not vendor_lines:
        pytest.skip("this CPU's /proc/cpuinfo names no vendor_id (not x86)")
    assert cpu_vendor() == vendor_lines[0].split(":", 1)[1].strip()


@pytest.mark.parametrize("layout", ["row_major", "column_major", "onednn_packed"])
def test_the_engine_decodes_with_the_weights_in_the_layout_set(
    layout: str, smollm2_tokenizer_dir: str, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from posttrain.models.cpu_decode_layout import onednn_packing
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf_engine import HFRolloutEngine

    if layout == "onednn_packed" and not onednn_packing():
        pytest.skip("this torch has no oneDNN linear packing")
    model = _tiny_tied_llama(smollm2_tokenizer_dir, tmp_path)
    head = model.lm_head.weight
    seen: list[tuple[tuple[int, ...], bool]] = []  # the head's weight strides, and whether it has a packed forward
    model.lm_head.register_forward_pre_hook(
        lambda module, args: seen.append((module.weight.stride(), "forward" in module.__dict__))
    )
    engine = HFRolloutEngine(model, AutoTokenizer.from_pretrained(smollm2_tokenizer_dir), cpu_weight_layout=layout)
    assert engine.weight_layout_note == f"rollout.cpu_weight_layout={layout}"
    engine.generate([[5, 9, 2], [7, 3]], 2, SamplingParams(max_tokens=3, seed=0))
    expected = (1, head.shape[0]) if layout == "column_major" else head.stride()
    assert seen and set(seen) == {(expected, layout == "onednn_packed")}  # the prefill and every decode step
    assert model.lm_head.weight is head and "forward" not in model.lm_head.__dict__


def test_onednn_packed_is_refused_before_any_model_loads_where_torch_cannot_pack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from posttrain.config.loading import build_config
    from posttrain.models import cpu_decode_layout
    from posttrain.preflight.grpo import grpo_preflight

    def layout_errors(setting: str) -> list[str]:
        cfg = build_config(None, [f"rollout.cpu_weight_layout={setting}"])
        return [e for e in grpo_preflight(cfg).errors if "cpu_weight_layout" in e]

    monkeypatch.setattr(cpu_decode_layout, "onednn_packing", lambda: False)
    (error,) = layout_errors("onednn_packed")
    assert "no oneDNN linear packing" in error and "set auto, row_major or column_major" in error
    assert layout_errors("auto") == []  # auto falls back by itself
    monkeypatch.setattr(cpu_decode_layout, "onednn_packing", lambda: True)
    assert layout_errors("onednn_packed") == []
