"""The weight sync's copy plan (rollout/vllm_copy_plan.py) on a small model whose ``load_weights``
lays tensors out as vLLM's dense models do: q/k/v stacked into one parameter, gate/up into another,
a tied head skipped, the vocabulary padded with zero rows. The plan must write exactly what the
loaders write, refuse loaders it cannot stand in for, and the vLLM engine must use it only after it
passed its check. vLLM's own Llama class is checked the same way in tests/integration/
test_vllm_copy_plan.py (vLLM's CPU build)."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch import nn

from posttrain.rollout.vllm_copy_plan import CopyPlan, WeightWriter, checked_copy_plan, learn_copy_plan
from posttrain.rollout.vllm_engine import VLLMRolloutEngine
from posttrain.rollout.vllm_shared_weights import SharedWeightsSender, ViewSync

VOCAB, PADDED, D, Q, KV, FF = 10, 12, 4, 4, 2, 6
STACKED = {"q": ("qkv", 0), "k": ("qkv", Q), "v": ("qkv", Q + KV), "gate": ("gate_up", 0), "up": ("gate_up", FF)}


class Stacked(nn.Module):
    """Stacks and pads as vLLM's Llama does; ``transform`` / ``permute`` make a loader the plan
    cannot stand in for."""

    def __init__(
        self, dtype: torch.dtype = torch.float32, transform: bool = False, permute: bool = False, buffer: bool = False
    ) -> None:
        super().__init__()
        self.register_buffer("norm_copy", torch.full((D,), 3.0, dtype=dtype))
        self.buffer = buffer
        self.embed = nn.Parameter(torch.full((PADDED, D), 7.0, dtype=dtype), requires_grad=False)
        self.qkv = nn.Parameter(torch.zeros(Q + 2 * KV, D, dtype=dtype), requires_grad=False)
        self.gate_up = nn.Parameter(torch.zeros(2 * FF, D, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.zeros(D, FF, dtype=dtype), requires_grad=False)
        self.norm = nn.Parameter(torch.zeros(D, dtype=dtype), requires_grad=False)
        self.transform, self.permute = transform, permute
        self.loads = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.loads += 1
        written = set()
        for name, w in weights:
            key = name.removesuffix(".weight")
            if key == "lm_head":  # tied to the embedding: vLLM skips it
                continue
            if key == "embed":
                self.embed.data[: w.shape[0]].copy_(w)
                self.embed.data[w.shape[0] :].fill_(0)
            elif key in STACKED:
                param, offset = STACKED[key]
                getattr(self, param).data.narrow(0, offset, w.shape[0]).copy_(w.flip(0) if self.permute else w)
            else:
                getattr(self, key).data.copy_(w * 2 if self.transform else w)
                if key == "norm" and self.buffer:  # a loader that also fills a buffer from a tensor
                    self.norm_copy.copy_(w)
            written.add({"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up"}.get(key, key))
        return written


def transfer(seed: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed": (VOCAB, D), "q": (Q, D), "k": (KV, D), "v": (KV, D), "gate": (FF, D), "up": (FF, D)}
    shapes |= {"down": (D, FF), "norm": (D,)}
    named = [(f"{k}.weight", torch.randn(s, generator=g, dtype=dtype)) for k, s in shapes.items()]
    return [*named, ("lm_head.weight", named[0][1])]


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_the_plan_writes_exactly_what_the_loaders_write() -> None:
    by_loaders, by_plan = Stacked(), Stacked()
    plan = learn_copy_plan(by_plan, transfer(0))
    assert isinstance(plan, CopyPlan)
    assert plan.nowhere == {"lm_head.weight"} and len(plan.names) == 8
    by_loaders.load_weights(transfer(1))
    by_plan.load_weights(transfer(0))  # as the engine does: the loaders' first load, then the plan
    plan.copy_(transfer(1))
    for name, value in params(by_loaders).items():
        assert torch.equal(value, params(by_plan)[name]), name
    assert torch.equal(by_plan.embed[VOCAB:], torch.zeros(PADDED - VOCAB, D))  # the padding the loader zeroed
    assert plan.mismatches(transfer(1)) == [] and plan.mismatches(transfer(2)) == list(plan.names)


def test_the_plan_casts_fp32_master_weights_as_the_loaders_do() -> None:
    by_loaders, by_plan = Stacked(torch.bfloat16), Stacked(torch.bfloat16)
    plan = learn_copy_plan(by_plan, transfer(0))
    assert isinstance(plan, CopyPlan)
    by_loaders.load_weights(transfer(3))
    by_plan.load_weights(transfer(0))
    plan.copy_(transfer(3))
    for name, value in params(by_loaders).items():
        assert torch.equal(value, params(by_plan)[name]), name


def test_learning_leaves_every_parameter_its_storage_and_values() -> None:
    model = Stacked()
    model.load_weights(transfer(4))
    before = {name: (p.data_ptr(), p.dtype, p.shape, p.detach().clone()) for name, p in model.named_parameters()}
    assert isinstance(learn_copy_plan(model, transfer(5)), CopyPlan)
    for name, p in model.named_parameters():
        ptr, dtype, shape, value = before[name]
        assert (p.data_ptr(), p.dtype, p.shape) == (ptr, dtype, shape) and torch.equal(p, value), name


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (Stacked(transform=True), "holds values its loader computed"),
        (Stacked(permute=True), "does not land as one run of whole rows in order"),
    ],
)
def test_loaders_the_plan_cannot_stand_in_for_leave_no_plan(model: Stacked, reason: str) -> None:
    plan = learn_copy_plan(model, transfer(0))
    assert isinstance(plan, str) and reason in plan


def test_a_loader_that_writes_a_buffer_leaves_no_plan_and_the_buffer_as_it_was() -> None:
    model = Stacked(buffer=True)
    plan = learn_copy_plan(model, transfer(0))
    assert isinstance(plan, str) and "buffer norm_copy" in plan
    assert torch.equal(model.norm_copy, torch.full((D,), 3.0))  # not the probe's ids


def test_a_loader_that_refuses_the_probe_leaves_no_plan_and_the_storage_back() -> None:
    model = Stacked()
    ptr = model.qkv.data_ptr()

    def refuse(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        raise TypeError("needs a bf16 tensor")

    model.load_weights = refuse  # type: ignore[method-assign]
    plan = learn_copy_plan(model, transfer(0))
    assert isinstance(plan, str) and "needs a bf16 tensor" in plan
    assert model.qkv.data_ptr() == ptr and model.qkv.shape == (Q + 2 * KV, D)


class InProcess:
    """What ``LLM.apply_model`` does with an engine core in this process: the function runs on the
    model itself and its result comes back unserialized. ``copies=True`` hands back what a worker
    in another process would (a copy)."""

    def __init__(self, model: nn.Module, copies: bool = False) -> None:
        self.model, self.copies = model, copies

    def apply_model(self, fn: Any) -> list[Any]:
        out = fn(self.model)
        return [copy.deepcopy(out) if self.copies else out]

    def collective_rpc(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the in-place path must not fall back to vLLM's reload here")

    def reset_prefix_cache(self) -> None:
        pass


def test_checked_plan_needs_the_live_model_and_what_the_loaders_wrote() -> None:
    model = Stacked()
    unwritten = checked_copy_plan(InProcess(model), transfer(0))  # the loaders have not written transfer(0)
    assert isinstance(unwritten, str) and "differ from what the loaders wrote" in unwritten
    model.load_weights(transfer(0))
    copied = checked_copy_plan(InProcess(model, copies=True), transfer(0))  # views of a copy
    assert isinstance(copied, str) and "not in the live model's memory" in copied
    assert isinstance(checked_copy_plan(InProcess(model), transfer(0)), CopyPlan)


def engine_on(model: Stacked) -> VLLMRolloutEngine:
    """The engine's weight-writing state around ``model`` (what ``__init__`` sets for an in-process
    dense model on CUDA; the constructor itself needs vLLM)."""
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    engine._llm = InProcess(model)
    engine.weight_dtype = None
    engine._writer = WeightWriter(in_place=True)
    engine._weights_dropped = False
    engine._engine_thread_count = contextlib.nullcontext  # type: ignore[method-assign]
    return engine


def test_the_engine_loads_with_the_loaders_once_then_by_the_plan() -> None:
    model, reference = Stacked(), Stacked()
    engine = engine_on(model)
    engine._write_in_process(transfer(0))
    assert model.loads == 2 and isinstance(engine._writer.plan, CopyPlan)  # the loaders' load, then the probe
    engine._write_in_process(transfer(1))
    assert model.loads == 2  # the plan wrote it
    reference.load_weights(transfer(1))
    assert all(torch.equal(v, params(model)[k]) for k, v in params(reference).items())
    engine._weights_dropped = True  # a level-2 sleep: the loaders refill everything again
    engine._write_in_process(transfer(2))
    assert model.loads == 3


def test_the_engine_keeps_the_loaders_where_no_plan_passes(caplog: pytest.LogCaptureFixture) -> None:
    model = Stacked(permute=True)
    engine = engine_on(model)
    with caplog.at_level(logging.WARNING, logger="posttrain.rollout"):
        engine._write_in_process(transfer(0))
    assert "keeps vLLM's weight loaders" in caplog.text and "does not land as one run" in caplog.text
    engine._write_in_process(transfer(1))
    assert engine._writer.plan is None and model.loads == 3  # loaded, probed once (refused), loaded


def test_the_engine_reloads_this_transfer_and_later_ones_where_the_loaders_leave_parameters_unwritten(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, reloads = Stacked(), []
    model.load_weights = lambda weights: set()  # type: ignore[method-assign,assignment]
    engine = engine_on(model)
    engine._reload = lambda pairs: reloads.append([name for name, _ in pairs])  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="posttrain.rollout"):
        engine._write_in_process(transfer(0))
    assert "left 5 parameter(s) unwritten" in caplog.text and engine._writer.in_place is False
    engine._write_in_process(transfer(1))
    assert reloads == [[name for name, _ in transfer(0)]] * 2 and engine._writer.plan is None


def refill_views(views: list[tuple[str, torch.Tensor]], seed: int) -> None:
    """What the trainer's ``SharedWeightsSender.push`` does to the mapped buffer: new values, same tensors."""
    for (_, view), (_, new) in zip(views, transfer(seed)):
        view.copy_(new)


def test_the_engine_process_loads_the_views_with_the_loaders_once_then_by_the_plan() -> None:
    model, reference, reloads = Stacked(), Stacked(), []
    views = transfer(0)
    sync = ViewSync(views, in_place=True)
    path, note = sync.sync(model, lambda: reloads.append(1))
    assert path == "loaders" and note is not None and note[0] == logging.INFO and "one foreach copy of 8" in note[1]
    assert model.loads == 2 and isinstance(sync.writer.plan, CopyPlan)  # the loaders' load, then the probe
    refill_views(views, 1)
    assert sync.sync(model, lambda: reloads.append(1)) == ("plan", None) and model.loads == 2
    reference.load_weights(transfer(1))
    assert all(torch.equal(v, params(model)[k]) for k, v in params(reference).items())
    assert sync.sync(model, lambda: reloads.append(1), refill=True) == ("loaders", None)  # after a level-2 sleep
    assert model.loads == 3 and reloads == []


def test_the_engine_process_reloads_where_the_loaders_leave_parameters_unwritten() -> None:
    model, reloads = Stacked(), []
    model.load_weights = lambda weights: set()  # type: ignore[method-assign,assignment]
    sync = ViewSync(transfer(0), in_place=True)
    path, note = sync.sync(model, lambda: reloads.append(1))
    assert path == "reload" and reloads == [1] and note is not None and note[0] == logging.WARNING
    assert "left 5 parameter(s) unwritten" in note[1] and not sync.writer.in_place
    assert sync.sync(model, lambda: reloads.append(1)) == ("reload", None) and reloads == [1, 1]


def test_the_engine_process_keeps_the_loaders_where_no_plan_passes_and_reloads_off_cuda() -> None:
    model = Stacked(permute=True)
    sync = ViewSync(transfer(0), in_place=True)
    path, note = sync.sync(model, lambda: None)
    assert path == "loaders" and note is not None and "does not land as one run" in note[1]
    assert sync.sync(model, lambda: None) == ("loaders", None) and model.loads == 3  # no second probe
    cpu, reloads = Stacked(), []
    plain = ViewSync(transfer(0), in_place=False)  # vLLM's CPU build, or a model that is not plain
    assert [plain.sync(cpu, lambda: reloads.append(1))[0] for _ in range(2)] == ["reload", "reload"]
    assert cpu.loads == 0 and reloads == [1, 1]


def test_the_sender_logs_a_workers_note_once_as_it_comes_through_vllms_msgpack(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine core's reply crosses vLLM's msgpack (``vllm.v1.serial_utils``, built on msgspec), which
    gives the worker's tuples back as lists: on one H100 (2026-12-05) the first path change's note made
    the sender fail (unhashable type: 'list') and the sync with it."""
    msgpack = pytest.importorskip("msgspec").msgpack
    outcome = ViewSync(transfer(0), in_place=True).sync(Stacked(), lambda: None)  # the loaders, and a note
    wire = msgpack.decode(msgpack.encode([outcome, outcome]))  # two workers' replies
    assert wire[0][1] == list(outcome[1])  # lists, not tuples

    class EngineCore:  # the RPC boundary only: what collective_rpc hands back
        def collective_rpc(self, method: str, args: tuple[Any, ...]) -> Any:
            return wire if method == "posttrain_reload_shared" else [None, None]

    with caplog.at_level(logging.INFO):
        assert SharedWeightsSender(EngineCore()).push(transfer(1)) == ["loaders", "loaders"]
    assert caplog.text.count("one foreach copy of 8") == 1
