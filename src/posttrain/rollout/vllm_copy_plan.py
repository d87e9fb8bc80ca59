"""Weight sync as one foreach copy into views of an in-process vLLM model's parameters.

Where weights go in place (``vllm_weight_load.loads_in_place``), the model's own ``load_weights``
still runs Python per tensor at every sync: it matches each Hugging Face name against the model's
stacked-parameter table (``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``, ``gate_proj``/
``up_proj`` into ``gate_up_proj``), looks the parameter up and calls its weight loader, which
narrows the parameter and copies. Where each tensor lands never changes between syncs, so this
module learns it once and every later sync is one ``torch._foreach_copy_`` (which also casts fp32
master weights to the engine's dtype) from the policy's tensors into those destinations.

How the destinations are learned, without knowing any model's loading code: ``learn_copy_plan``
points every parameter at a small float64 stand-in with one column (``Parameter.data`` swapped, so
the weight-loader attributes vLLM keeps on the parameter object stay), sends the model's own
``load_weights`` one probe per tensor whose rows carry ids unique over the whole transfer (n + 1/2,
so that arithmetic on them shows), and puts the real storage back. A tensor whose ids arrive as one
run of consecutive rows, in order and complete, has a destination: that run of rows of that
parameter. Anything else (rows permuted or split, values transformed, a buffer written, a loader
that refuses the stand-in) leaves no plan, and the engine keeps the loaders; buffers the probe
wrote are put back. The plan is then checked once against
a real load by those same loaders, which also catches anything a row probe cannot see (a transform
within rows): every destination must hold exactly what the loaders wrote.

``WeightWriter`` keeps, from one sync to the next, which way a transfer is written (the plan, the
loaders, or vLLM's reload), for the in-process engine and for an engine core's worker alike.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

SyncPath = Literal["plan", "loaders", "reload"]
# what a sync did, and a log line (level, text) when its path changed
SyncOutcome = tuple[SyncPath, tuple[int, str] | None]

_UNWRITTEN = math.nan  # a stand-in row no loader wrote (0.0 is a row a loader filled with zeros)
# Row ids are n + 1/2: a loader that scales, adds or averages the probe leaves values off that grid.
_HALF = 0.5


@dataclass(frozen=True)
class CopyPlan:
    """Where each Hugging Face tensor of a transfer lands in the model's parameters.

    ``names[i]`` is copied into ``views[i]`` (a tensor may land in several places); ``nowhere``
    holds the names the model's loaders skip (a tied ``lm_head.weight``)."""

    names: tuple[str, ...]
    views: tuple[torch.Tensor, ...]
    nowhere: frozenset[str]

    def copy_(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Write a transfer (the same names as the plan was learned on) into the parameters; casts
        to each parameter's dtype as ``Tensor.copy_`` does, as vLLM's loaders do."""
        by_name = dict(named)
        with torch.no_grad():
            torch._foreach_copy_(list(self.views), [by_name[name] for name in self.names])

    def mismatches(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
        """The names whose destination does not hold exactly ``named``'s tensor, as the parameter's
        dtype rounds it (after a load of ``named`` by the model's own loaders: none)."""
        by_name = dict(named)
        return [
            name
            for name, view in zip(self.names, self.views)
            if not torch.equal(view, by_name[name].to(device=view.device, dtype=view.dtype))
        ]


def learn_copy_plan(model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]]) -> CopyPlan | str:
    """Learn where ``model.load_weights`` puts each of ``named``'s tensors (only their names and
    shapes are read); a plan, or why there is none. The parameters keep their storage throughout."""
    params = dict(model.named_parameters())
    for name, param in params.items():
        if param.dim() == 0:
            return f"parameter {name} is a scalar"
    for name, tensor in named:
        if tensor.dim() == 0:
            return f"tensor {name} is a scalar"
    starts, probes, next_id = {}, [], 1
    for name, tensor in named:
        rows = tensor.shape[0]
        starts[name] = next_id
        ids = torch.arange(next_id, next_id + rows, dtype=torch.float64) + _HALF
        probes.append((name, ids.view(rows, *[1] * (tensor.dim() - 1))))
        next_id += rows
    saved = {name: param.data for name, param in params.items()}
    stand_ins = {
        name: torch.full((p.shape[0], *[1] * (p.dim() - 1)), _UNWRITTEN, dtype=torch.float64)
        for name, p in params.items()
    }
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # a loader writing one is no parameter's
    try:
        for name, param in params.items():
            param.data = stand_ins[name]
        loader = model.load_weights
        with torch.no_grad():
            loader(iter(probes))  # type: ignore[operator]
    except Exception as err:  # a loader that cannot take the stand-in: no plan, the loaders stay
        return f"the model's load_weights did not take the probe ({type(err).__name__}: {err})"
    finally:
        for name, param in params.items():
            param.data = saved[name]
            if param.data_ptr() != saved[name].data_ptr():  # vLLM's graphs read that memory: poison
                raise RuntimeError(f"parameter {name} did not get its storage back after the copy plan's probe")
        written = _restore_buffers(model, buffers)
    if written:
        return f"the loaders write buffer {written[0]}, which a copy plan does not cover"
    return _read_plan(saved, stand_ins, dict(named), starts)


def _restore_buffers(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """Put back every buffer the probe changed; their names."""
    changed = []
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in before and not torch.equal(buffer, before[name]):
                buffer.copy_(before[name])
                changed.append(name)
    return changed


def _read_plan(
    saved: dict[str, torch.Tensor],
    stand_ins: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    starts: dict[str, int],
) -> CopyPlan | str:
    """The plan the probe's ids spell out, or why they spell none."""
    order = sorted(starts, key=starts.__getitem__)
    first_ids = torch.tensor([starts[n] for n in order], dtype=torch.float64)
    landed: set[str] = set()
    names: list[str] = []
    views: list[torch.Tensor] = []
    for pname, stand_in in stand_ins.items():
        ids = stand_in.reshape(stand_in.shape[0])
        carried = ~torch.isnan(ids) & (ids != 0)  # 0.0: rows a loader filled with zeros (vocabulary padding)
        if not carried.any():
            continue
        values = ids[carried] - _HALF
        if not torch.equal(values, values.round()) or values.min() < 1:
            return f"parameter {pname} holds values its loader computed, not copied"
        owner = torch.searchsorted(first_ids, values, right=True) - 1
        rows_at = carried.nonzero().squeeze(1)
        for k in owner.unique().tolist():
            name = order[k]
            mine = owner == k
            rows, first = rows_at[mine], int(first_ids[k])
            length = tensors[name].shape[0]
            offset = int(rows[0])
            run = torch.arange(offset, offset + length)
            if (
                rows.numel() != length
                or not torch.equal(rows, run)
                or not torch.equal(values[mine], torch.arange(first, first + length, dtype=torch.float64))
            ):
                return f"{name} does not land as one run of whole rows in order (parameter {pname})"
            view = saved[pname].narrow(0, offset, length)
            if view.shape != tensors[name].shape:
                return f"{name} {tuple(tensors[name].shape)} lands in rows of shape {tuple(view.shape)} ({pname})"
            names.append(name)
            views.append(view)
            landed.add(name)
    return CopyPlan(tuple(names), tuple(views), frozenset(set(tensors) - landed))


class WeightWriter:
    """Which way a weight sync writes a transfer into vLLM's model, kept from one sync to the next:
    one state machine for the in-process engine (``vllm_engine.py``) and for an engine core's worker
    (``vllm_shared_weights.py``), which differ only in how they reach the model.

    The copy plan once there is one (not on a ``refill``: after a level-2 sleep the loaders run
    again, as they also refill what no tensor carries); else the model's own loaders where they go
    in place (``in_place``, ``vllm_weight_load.loads_in_place``), learning the plan after the first
    such load; else vLLM's reload. Should the loaders report parameters they did not write, the
    writer takes vLLM's reload from then on, and the reload writes every tensor of this transfer
    again, so no transfer is ever partial."""

    def __init__(self, *, in_place: bool) -> None:
        self.in_place = in_place
        self.plan: CopyPlan | None = None
        self.plan_tried = False

    def write(
        self,
        sources: Sequence[tuple[str, torch.Tensor]],
        *,
        load: Callable[[], list[str]],
        reload: Callable[[], None],
        learn: Callable[[], CopyPlan | str],
        where: str,
        refill: bool = False,
    ) -> SyncOutcome:
        """Write ``sources`` (the plan casts them); ``load`` runs the model's loaders and returns the
        parameters they left unwritten, ``reload`` runs vLLM's reload, ``learn`` learns and checks a
        plan (or says why none) right after a load; ``where`` the plan copies, for its log line. The
        path taken, and a log line (level, text) where the path changed."""
        if self.plan is not None and not refill:
            self.plan.copy_(sources)
            return "plan", None
        if not self.in_place:
            reload()
            return "reload", None
        unwritten = load()
        if unwritten:
            self.in_place = False
            reload()
            note = f"vLLM's load_weights left {len(unwritten)} parameter(s) unwritten (first: {unwritten[0]}); "
            return "reload", (logging.WARNING, note + "using vLLM's reload_weights for this and every later sync")
        if self.plan_tried:
            return "loaders", None
        self.plan_tried = True
        start = time.perf_counter()
        plan = learn()
        self.plan = None if isinstance(plan, str) else plan
        return "loaders", plan_note(plan, time.perf_counter() - start, where=where)


def plan_note(plan: CopyPlan | str, took_s: float, *, where: str) -> tuple[int, str]:
    """The log line (level, text) for a plan learned ``where`` in ``took_s``, or for the reason
    there is none: a plain dense model whose loaders a plan should stand in for says why not."""
    if isinstance(plan, str):
        return logging.WARNING, f"weight sync keeps vLLM's weight loaders (a Python call per tensor): {plan}"
    copies = f"one foreach copy of {len(plan.names)} tensors {where}"
    return logging.INFO, f"weight sync: {copies} from now on (learned in {took_s:.2f} s)"


def checked_copy_plan(llm: Any, pairs: Sequence[tuple[str, torch.Tensor]]) -> CopyPlan | str:
    """The copy plan of the vLLM ``LLM``'s model, learned on ``pairs`` right after the model's own
    loaders wrote them, or why there is none (it fails its check): the model must live in this
    process (one worker, its views the live parameters' storage), and every destination must hold
    exactly what the loaders just wrote."""
    learned = llm.apply_model(functools.partial(learn_copy_plan, named=pairs))
    if len(learned) != 1:
        return f"the model runs in {len(learned)} workers"
    plan = learned[0]
    if isinstance(plan, str):
        return plan
    spans = llm.apply_model(_parameter_spans)[0]
    for name, view in zip(plan.names, plan.views):
        first, end = view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()
        if not any(lo <= first and end <= hi for lo, hi in spans):
            return f"{name}'s destination is not in the live model's memory (the model is not in this process)"
    return _checked(plan, pairs)


def local_copy_plan(model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]]) -> CopyPlan | str:
    """``model``'s copy plan learned on ``named`` right after its own loaders wrote them, in the
    process that holds the model (an engine core's worker: ``vllm_shared_weights.py``), or why none."""
    plan = learn_copy_plan(model, named)
    return plan if isinstance(plan, str) else _checked(plan, named)


def _checked(plan: CopyPlan, named: Sequence[tuple[str, torch.Tensor]]) -> CopyPlan | str:
    """``plan`` if every destination holds exactly what the loaders just wrote from ``named``."""
    wrong = plan.mismatches(named)
    if wrong:
        return f"{len(wrong)} destination(s) differ from what the loaders wrote (first: {wrong[0]})"
    return plan


def _parameter_spans(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Each parameter's [first byte, end) address in memory."""
    return [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in model.parameters()]
