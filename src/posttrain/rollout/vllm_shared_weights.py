"""Weights for a vLLM engine core in a process of its own, through memory both processes map.

With ``rollout.separate_engine_process`` the vLLM engine core (scheduler, model runner, sampler)
runs in its own process, so its host work no longer takes turns with the trainer's on one GIL: the
one-step off-policy mode can sample batch k+1 while batch k trains. The weights then cannot be
handed over by reference. Instead the trainer's side keeps ONE flat byte buffer holding every
tensor (in shared CPU memory, or on the GPU, where torch shares it by CUDA IPC), hands the engine's
worker a mapping of it once, and at each sync copies the policy's tensors into it and asks the
worker to reload its model from the mapped views. A sync is then one device-local copy and one
RPC, whatever the number of tensors; nothing is pickled or sent through a socket per tensor.

``SharedWeightsSender`` is the trainer's side; ``SharedWeightsWorker`` is mixed into vLLM's
worker class (vLLM's ``worker_extension_cls``) in the engine core process.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch

WORKER_EXTENSION = "posttrain.rollout.vllm_shared_weights.SharedWeightsWorker"
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

    def push(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy ``pairs`` into the buffer and have the worker reload its model from it."""
        layout, size = plan_layout(pairs)
        device = pairs[0][1].device if pairs else torch.device("cpu")
        if layout != self.layout or self.buffer is None or self.buffer.device != device:
            self._attach(layout, size, device)
        if pairs:  # one foreach copy, not a copy_ call per tensor
            with torch.no_grad():
                torch._foreach_copy_([view for _, view in self.views], [t for _, t in pairs], non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the worker reads on its own stream, in its own process
        self.llm.collective_rpc("posttrain_reload_shared")

    def _attach(self, layout: Layout, size: int, device: torch.device) -> None:
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        if device.type == "cpu":
            buffer.share_memory_()
        self.llm.collective_rpc("posttrain_attach_shared", args=(_dumps_shared(buffer), layout))
        self.buffer, self.layout, self.views = buffer, layout, buffer_views(buffer, layout)

    def close(self) -> None:
        """Drop the buffer (after the engine is gone: its worker maps it until then)."""
        self.buffer, self.layout, self.views = None, None, []


class SharedWeightsWorker:
    """Mixed into vLLM's worker in the engine core process (``worker_extension_cls``)."""

    _posttrain_views: list[tuple[str, torch.Tensor]]
    reload_weights: Callable[..., None]  # the vLLM worker's own (annotation only: vLLM refuses clashes)
    model_runner: Any  # the vLLM worker's own, as above

    def posttrain_attach_shared(self, payload: bytes, layout: Layout) -> int:
        """Map the trainer's buffer; returns how many tensors it holds."""
        import torch.multiprocessing  # noqa: F401  (torch's reductions rebuild the shared tensor)

        buffer = pickle.loads(payload)
        self._posttrain_views = buffer_views(buffer, [(n, d, tuple(s), o, b) for n, d, s, o, b in layout])
        return len(self._posttrain_views)

    def posttrain_reload_shared(self) -> None:
        """Reload the model from the mapped buffer (vLLM maps the names onto its fused layers)."""
        self.reload_weights(weights_iterator=self._posttrain_views, is_checkpoint_format=True)
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():  # vLLM's CPU build skips its MoE prepack on reloads (vllm_moe.py)
            from posttrain.rollout.vllm_moe import repack_cpu_moe

            repack_cpu_moe(self.model_runner.get_model())
