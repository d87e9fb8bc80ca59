"""Weights for a vLLM engine core in a process of its own, through memory both processes map.

With ``rollout.separate_engine_process`` the vLLM engine core (scheduler, model runner, sampler)
runs in its own process, so its host work no longer takes turns with the trainer's on one GIL: the
one-step off-policy mode can sample batch k+1 while batch k trains. The weights then cannot be
handed over by reference. Instead the trainer's side keeps ONE flat byte buffer holding every
tensor (in shared CPU memory, or on the GPU, where torch shares it by CUDA IPC), hands the engine's
worker a mapping of it once, and at each sync copies the policy's tensors into it and asks the
worker to reload its model from the mapped views. A sync is then one device-local copy and one
RPC, whatever the number of tensors; nothing is pickled or sent through a socket per tensor.

How the worker writes the mapped views into its model (``ViewSync``): on CUDA a plain dense model
(``vllm_weight_load.loads_in_place``) takes the first sync through its own weight loaders, which
also teaches it a copy plan (``vllm_copy_plan.local_copy_plan``), and every later sync is one
foreach copy from the views into the parameters; anything else, and a CPU engine, goes through
vLLM's ``reload_weights``, which re-creates every layer (0.08-0.13 s of W's step on one H200).

``SharedWeightsSender`` is the trainer's side; ``SharedWeightsWorker`` is mixed into vLLM's
worker class (vLLM's ``worker_extension_cls``) in the engine core process.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from posttrain.rollout.vllm_copy_plan import SyncOutcome, SyncPath, WeightWriter, local_copy_plan
from posttrain.rollout.vllm_weight_load import load_in_place, loads_in_place

WORKER_EXTENSION = "posttrain.rollout.vllm_shared_weights.SharedWeightsWorker"
_log = logging.getLogger("posttrain.rollout")
_ALIGN = 64  # bytes: every tensor starts aligned for any dtype's view


# (name, dtype name, shape, byte offset, byte count) of each tensor in the flat buffer
Layout = list[tuple[str, str, tuple[int, ...], int, int]]


def plan_layout(pairs: Sequence[tuple[str, torch.Tensor]]) -> tuple[Layout, int]:
    """Where each tensor lives in the flat buffer, and the buffer's size in bytes."""
    layout: Layout = []
    offset = 0
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return layout, offset


def buffer_views(buffer: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
    """The named tensors that ``layout`` places in the uint8 ``buffer``, as views of it."""
    return [
        (name, buffer[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape))
        for name, dtype, shape, offset, nbytes in layout
    ]


def _dumps_shared(obj: Any) -> bytes:
    """Pickle with torch's tensor reductions: a tensor travels as a handle to its shared memory."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    out = io.BytesIO()
    ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


class SharedWeightsSender:
    """The trainer's side: one flat buffer, mapped by the engine's worker once, refilled per sync."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.layout: Layout | None = None
        self.buffer: torch.Tensor | None = None
        self.views: list[tuple[str, torch.Tensor]] = []
        self.last_paths: list[SyncPath] = []  # how each worker wrote the last push
        # where the last push's time went (seconds): mapping a new buffer into the worker, the copy into
        # the buffer (and the device's wait for it), the worker's write of its model with the RPC around it
        self.last_phases: dict[str, float] = {}

    def push(self, pairs: Sequence[tuple[str, torch.Tensor]], *, refill: bool = False) -> list[SyncPath]:
        """Copy ``pairs`` (in the engine's dtype) into the buffer and have the worker write its model
        from it; ``refill``: the model's weights were dropped (a level-2 sleep), so every row must be
        written again, not only the ones a copy plan covers. How each worker wrote it; a worker's
        change of path is logged here, in the trainer's process."""
        layout, size = plan_layout(pairs)
        device = pairs[0][1].device if pairs else torch.device("cpu")
        start = time.perf_counter()
        if layout != self.layout or self.buffer is None or self.buffer.device != device:
            self._attach(layout, size, device)
        attached = time.perf_counter()
        if pairs:  # one foreach copy, not a copy_ call per tensor
            with torch.no_grad():
                torch._foreach_copy_([view for _, view in self.views], [t for _, t in pairs], non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the worker reads on its own stream, in its own process
        copied = time.perf_counter()
        outcomes: list[SyncOutcome] = self.llm.collective_rpc("posttrain_reload_shared", args=(refill,))
        self.last_phases = {
            "attach_s": attached - start,
            "copy_s": copied - attached,
            "worker_s": time.perf_counter() - copied,
        }
        # an engine core's reply crosses vLLM's msgpack, which gives the worker's tuples back as lists
        notes = dict.fromkeys((int(note[0]), str(note[1])) for _, note in outcomes if note is not None)
        for level, text in notes:  # once, not per worker
            _log.log(level, text)
        self.last_paths = [path for path, _ in outcomes]
        return self.last_paths

    def _attach(self, layout: Layout, size: int, device: torch.device) -> None:
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        if device.type == "cpu":
            buffer.share_memory_()
        self.llm.collective_rpc("posttrain_attach_shared", args=(_dumps_shared(buffer), layout))
        self.buffer, self.layout, self.views = buffer, layout, buffer_views(buffer, layout)

    def close(self) -> None:
        """Drop the buffer (after the engine is gone: its worker maps it until then)."""
        self.buffer, self.layout, self.views = None, None, []


class ViewSync:
    """How one worker writes the mapped buffer's views into its model, from the first sync on (the
    path is ``WeightWriter``'s, shared with the in-process engine)."""

    def __init__(self, views: list[tuple[str, torch.Tensor]], *, in_place: bool) -> None:
        self.views = views
        # in_place: the model's own loaders give what reload_weights gives (loads_in_place)
        self.writer = WeightWriter(in_place=in_place)

    def sync(self, model: torch.nn.Module, reload: Callable[[], None], *, refill: bool = False) -> SyncOutcome:
        """Write the views into ``model``: by the copy plan once there is one (not on a ``refill``),
        else by the model's loaders (learning the plan after the first such load), else ``reload``."""
        return self.writer.write(
            self.views,
            load=lambda: load_in_place(self.views)(model),
            reload=reload,
            learn=lambda: local_copy_plan(model, self.views),
            where="in the engine's process",
            refill=refill,
        )


class SharedWeightsWorker:
    """Mixed into vLLM's worker in the engine core process (``worker_extension_cls``)."""

    _posttrain_sync: ViewSync
    reload_weights: Callable[..., None]  # the vLLM worker's own (annotation only: vLLM refuses clashes)
    model_runner: Any  # the vLLM worker's own, as above

    def posttrain_attach_shared(self, payload: bytes, layout: Layout) -> int:
        """Map the trainer's buffer; returns how many tensors it holds."""
        import torch.multiprocessing  # noqa: F401  (torch's reductions rebuild the shared tensor)
        from vllm.platforms import current_platform

        buffer = pickle.loads(payload)
        views = buffer_views(buffer, [(n, d, tuple(s), o, b) for n, d, s, o, b in layout])
        in_place = loads_in_place(self.model_runner.get_model(), cuda=current_platform.is_cuda())
        self._posttrain_sync = ViewSync(views, in_place=in_place)
        return len(views)

    def posttrain_reload_shared(self, refill: bool = False) -> SyncOutcome:
        """Write the model from the mapped buffer (``ViewSync``)."""
        return self._posttrain_sync.sync(self.model_runner.get_model(), self._posttrain_reload, refill=refill)

    def _posttrain_reload(self) -> None:
        """vLLM's reload from the views (it maps the names onto its fused layers), and on the CPU
        build the MoE prepack it skips on reloads (vllm_moe.py)."""
        self.reload_weights(weights_iterator=self._posttrain_sync.views, is_checkpoint_format=True)
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            from posttrain.rollout.vllm_moe import repack_cpu_moe

            repack_cpu_moe(self.model_runner.get_model())
