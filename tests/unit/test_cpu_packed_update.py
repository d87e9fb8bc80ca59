"""``model.cpu_packed_update`` (``models/cpu_decode_layout.py``): ``PackedLinear``'s gradients are ``F.linear``'s;
inside ``packed_update_linears`` a model's loss and every gradient match the plain model's up to rounding, the
modules come back (also after an error, and a nested entry leaves the outer one's forwards alone); the trainer's
optimizer steps match the plain trainer's; ``auto`` packs where the decode does; ``true`` is refused before any
model loads where it cannot pack or beside ``model.compile``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from posttrain.models.cpu_decode_layout import onednn_packing

needs_packing = pytest.mark.skipif(not onednn_packing(), reason="this torch has no oneDNN linear packing")


@needs_packing
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 12), (2, 7, 12)])
def test_packed_linear_gradients_are_f_linears(bias: bool, shape: tuple[int, ...]) -> None:
    from posttrain.models.cpu_decode_layout import PackedLinear, pack_weight

    numbers = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=numbers, requires_grad=True)
    weight = torch.randn(9, 12, generator=numbers, requires_grad=True)
    b = torch.randn(9, generator=numbers, requires_grad=True) if bias else None
    grad_out = torch.randn(*shape[:-1], 9, generator=numbers)

    plain = nn.functional.linear(x, weight, b)
    plain_grads = torch.autograd.grad(plain, [x, weight, *([b] if bias else [])], grad_out)
    packed = PackedLinear.apply(x, weight, b, pack_weight(weight.detach()))
    packed_grads = torch.autograd.grad(packed, [x, weight, *([b] if bias else [])], grad_out)

    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    for got, want in zip(packed_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_packing
def test_a_frozen_weight_gets_no_gradient_and_the_input_still_does() -> None:
    from posttrain.models.cpu_decode_layout import packed_update_linears

    frozen = nn.Linear(6, 4)
    frozen.requires_grad_(False)  # LoRA's base layer
    x = torch.randn(3, 6, requires_grad=True)
    with packed_update_linears(frozen):
        assert "forward" in frozen.__dict__
        frozen(x).sum().backward()
    assert frozen.weight.grad is None and frozen.bias.grad is None
    assert x.grad is not None
    torch.testing.assert_close(x.grad, frozen.weight.sum(0).expand(3, 6), rtol=1e-5, atol=1e-5)


def _tiny_tied_llama(tokenizer_dir: str, tmp_path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from posttrain.models.tiny import make_tiny_model

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(str(tmp_path), tokenizer_dir))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.train()


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@needs_packing
def test_inside_a_models_loss_and_every_gradient_match_the_plain_ones(
    smollm2_tokenizer_dir: str, tmp_path: Path
) -> None:
    from posttrain.models.cpu_decode_layout import packed_update_linears

    model = _tiny_tied_llama(smollm2_tokenizer_dir, tmp_path)
    ids = torch.tensor([[5, 9, 2, 7, 11, 3], [3, 3, 8, 1, 4, 4]])
    plain_loss, plain_grads = _loss_and_grads(model, ids)
    reorder = torch.ops.mkldnn._reorder_linear_weight
    packed: list[int] = []

    def counting_reorder(weight: torch.Tensor, *args: object) -> torch.Tensor:
        packed.append(id(weight))
        return reorder(weight, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", counting_reorder)
        with packed_update_linears(model):
            linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
            assert all("forward" in m.__dict__ for m in linears)
            with packed_update_linears(model):  # nested (the trainer's logprob pass inside its mini-batch)
                pass
            assert all("forward" in m.__dict__ for m in linears)  # the inner exit left the outer's alone
            packed_loss, packed_grads = _loss_and_grads(model, ids)
    assert len(packed) == 15  # 7 per layer and the tied head, once: the nested entry packed nothing
    assert not any("forward" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(packed_loss, plain_loss, rtol=1e-5, atol=1e-5)
    assert packed_grads.keys() == plain_grads.keys() and "model.embed_tokens.weight" in packed_grads
    for name, grad in packed_grads.items():  # the tied weight's gradient sums the head's and the embedding's
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@needs_packing
def test_an_error_inside_puts_the_modules_back() -> None:
    from posttrain.models.cpu_decode_layout import packed_update_linears

    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 6).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="mid-update"), packed_update_linears(model):
        assert "forward" in model[0].__dict__ and "forward" not in model[2].__dict__  # bf16 stays plain
        raise RuntimeError("mid-update")
    assert not any("forward" in m.__dict__ for m in model.modules())


def _two_groups(numbers: torch.Generator) -> Any:
    """A batch of two groups of four random completions, every one learning."""
    from posttrain.policy.train_batch import TrainBatch

    completions = [torch.randint(30, 900, (n,), generator=numbers).tolist() for n in (3, 5, 2, 4, 6, 1, 2, 3)]
    return TrainBatch(
        prompt_ids=[[5, 6, 7, 8, 9]] * 4 + [[10, 11, 12]] * 4,
        completion_ids=completions,
        advantages_B=torch.randn(8, generator=numbers),
        in_loss_B=torch.ones(8, dtype=torch.bool),
        sampler_logprobs=[[-1.0] * len(c) for c in completions],
        group_size=4,
    )


def _trained(model_dir: str, setting: str) -> tuple[list[float], dict[str, torch.Tensor], bool]:
    from transformers import AutoModelForCausalLM

    from posttrain.config.loading import build_config
    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer

    torch.manual_seed(0)
    cfg = build_config(None, ["rl.batch_per_replica=8", "rl.group_size=4", f"model.cpu_packed_update={setting}"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=2)
    numbers = torch.Generator().manual_seed(1)
    losses = []
    for step in (1, 2, 3):  # three optimizer steps: each mini-batch packs the weights it trains
        losses.append(trainer.train_on(_two_groups(numbers), step)["train/loss_avg"])
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, trainer.packed_update


@needs_packing
def test_the_trainers_steps_match_the_plain_trainers(tiny_model_dir: str) -> None:
    plain_losses, plain_params, plain_on = _trained(tiny_model_dir, "false")
    packed_losses, packed_params, packed_on = _trained(tiny_model_dir, "true")
    assert packed_on and not plain_on
    assert packed_losses == pytest.approx(plain_losses, rel=1e-4, abs=1e-5)
    moved = 0
    for name, p in packed_params.items():
        torch.testing.assert_close(p, plain_params[name], rtol=1e-4, atol=1e-6, msg=name)
        moved += not torch.equal(p, plain_params[name])
    assert moved  # the packed products really ran: the same steps up to rounding, not bitwise


NO_ONEDNN = "this torch has no oneDNN packing"


@pytest.mark.parametrize(
    "case",  # setting, an fp32 CPU policy?, compiled?, vendor, torch packs?; then the choice and why
    [
        ("auto", True, False, "AuthenticAMD", True, True, "on (the CPU is AuthenticAMD, not Intel)"),
        ("auto", True, False, "GenuineIntel", True, False, "off (an Intel CPU with MKL)"),
        ("auto", True, False, "AuthenticAMD", False, False, f"off (the CPU is AuthenticAMD, not Intel; {NO_ONEDNN})"),
        ("auto", True, True, "AuthenticAMD", True, False, "off (model.compile)"),
        ("auto", False, False, "AuthenticAMD", True, False, "off (not an fp32 CPU policy)"),
        (True, True, False, "GenuineIntel", True, True, "on"),
        (True, False, False, "AuthenticAMD", True, False, "off (not an fp32 CPU policy)"),  # a GPU run ignores it
        (False, True, False, "AuthenticAMD", True, False, "off"),
    ],
)
def test_auto_packs_where_the_decode_packs(case: tuple[bool | str, bool, bool, str, bool, bool, str]) -> None:
    from posttrain.models.cpu_decode_layout import update_packing_choice

    setting, cpu_fp32, compiled, vendor, onednn, on, why = case

    got = update_packing_choice(setting, cpu_fp32=cpu_fp32, compiled=compiled, vendor=vendor, mkl=True, onednn=onednn)
    assert got == (on, f"model.cpu_packed_update={str(setting).lower()}: {why}")
    if cpu_fp32 and setting is not False:  # an FSDP-sharded policy never packs, whatever else holds
        sharded = update_packing_choice(
            setting, cpu_fp32=True, compiled=False, sharded=True, vendor=vendor, mkl=True, onednn=onednn
        )
        assert sharded == (False, f"model.cpu_packed_update={str(setting).lower()}: off (an FSDP-sharded policy)")


def test_true_is_refused_before_any_model_loads_without_packing_or_beside_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from posttrain.config.loading import build_config
    from posttrain.models import cpu_decode_layout
    from posttrain.preflight.grpo import grpo_preflight

    def errors(*overrides: str) -> list[str]:
        return [e for e in grpo_preflight(build_config(None, list(overrides))).errors if "cpu_packed_update" in e]

    monkeypatch.setattr(cpu_decode_layout, "onednn_packing", lambda: False)
    (error,) = errors("model.cpu_packed_update=true")
    assert "no oneDNN linear packing" in error and "set auto or false" in error
    assert errors("model.cpu_packed_update=auto") == []  # auto falls back by itself
    monkeypatch.setattr(cpu_decode_layout, "onednn_packing", lambda: True)
    assert errors("model.cpu_packed_update=true") == []
    (error,) = errors("model.cpu_packed_update=true", "model.compile=true")
    assert "not with model.compile" in error
    assert errors("model.cpu_packed_update=auto", "model.compile=true") == []
    monkeypatch.setattr(cpu_decode_layout, "onednn_packing", lambda: False)
    with pytest.raises(ValueError, match="no oneDNN linear packing"):  # and the trainer's own choice, after it
        cpu_decode_layout.update_packing_choice(True, cpu_fp32=True, compiled=False)


@needs_packing
def test_a_packed_copy_is_kept_until_its_weight_changes_or_dies() -> None:
    from torch.autograd.graph import increment_version

    from posttrain.models import cpu_decode_layout
    from posttrain.models.cpu_decode_layout import packed_copy

    weight = nn.Parameter(torch.randn(8, 6))
    first = packed_copy(weight)
    assert packed_copy(weight) is first  # unchanged: the same copy
    with torch.no_grad():
        weight.mul_(2.0)  # an in-place write bumps the version counter
    second = packed_copy(weight)
    assert second is not first
    x = torch.randn(3, 6)
    torch.testing.assert_close(cpu_decode_layout.packed_linear(x, packed=second), x @ weight.detach().T)
    increment_version(weight)  # what the trainer does after a fused AdamW step, which writes without a bump
    assert packed_copy(weight) is not second
    key = id(weight)
    assert key in cpu_decode_layout._PACKED
    del weight  # a freed weight takes its copy with it
    assert key not in cpu_decode_layout._PACKED


def _decode_then_train(model_dir: str, monkeypatch: pytest.MonkeyPatch, *, cached: bool) -> tuple[dict, int]:
    """Three steps of a decode-like forward (inference mode, packed) then ``train_on``, as the CPU loop runs them."""
    from transformers import AutoModelForCausalLM

    from posttrain.config.loading import build_config
    from posttrain.models import cpu_decode_layout
    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer

    packs = []
    fresh = cpu_decode_layout.pack_weight
    monkeypatch.setattr(cpu_decode_layout, "pack_weight", lambda w: packs.append(1) or fresh(w))
    if not cached:
        monkeypatch.setattr(cpu_decode_layout, "packed_copy", lambda w: cpu_decode_layout.pack_weight(w.detach()))
    torch.manual_seed(0)
    cfg = build_config(None, ["rl.batch_per_replica=8", "rl.group_size=4", "model.cpu_packed_update=true"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=2)
    numbers = torch.Generator().manual_seed(1)
    for step in (1, 2, 3):
        with torch.inference_mode(), cpu_decode_layout.onednn_packed_linears(model):
            model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]))
        trainer.train_on(_two_groups(numbers), step)
    monkeypatch.undo()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, len(packs)


@needs_packing
def test_the_update_reuses_the_decodes_copies_and_never_a_stale_one(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached, cached_packs = _decode_then_train(tiny_model_dir, monkeypatch, cached=True)
    fresh, fresh_packs = _decode_then_train(tiny_model_dir, monkeypatch, cached=False)
    assert cached_packs * 2 == fresh_packs  # each step's update took the decode's copies: half the packing
    for name, p in cached.items():  # bitwise: a copy of an older weight would have changed a product
        assert torch.equal(p, fresh[name]), name


@needs_packing
def test_the_policys_choice_reads_its_parameters_and_the_run() -> None:
    from types import SimpleNamespace

    from posttrain.models.cpu_decode_layout import packed_update_choice

    on = SimpleNamespace(cpu_packed_update=True, compile=False)
    assert packed_update_choice(nn.Linear(4, 4), on, mixed=False) == (True, "model.cpu_packed_update=true: on")
    off = (False, "model.cpu_packed_update=true: off (not an fp32 CPU policy)")
    assert packed_update_choice(nn.Linear(4, 4), on, mixed=True) == off  # bf16 compute copies instead
    assert packed_update_choice(nn.Linear(4, 4).to(torch.bfloat16), on, mixed=False) == off
    assert packed_update_choice(nn.Linear(4, 4, device="meta"), on, mixed=False) == off
