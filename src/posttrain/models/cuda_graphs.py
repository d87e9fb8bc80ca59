"""The policy body's forward and backward replayed as CUDA graphs (``model.cuda_graphs``).

On a GPU the small update is bound by the host, not by the GPU: the default recipe's update
dispatches about 8,000 operations whose kernels keep the H200 busy for 13-20 ms of a 60-170 ms update
(docs/benchmarks.md, tenth session). inductor's CUDA graphs (``mode="reduce-overhead"``) were
slower there: per-layer graphs ran while earlier layers' backwards were pending (off CUDA-graph
trees' fast path), and the bf16 weight copies that mixed precision makes outside the graph were new
inputs every step.

Here the whole decoder body is one forward graph and one backward graph per padded input shape:

* **Shapes.** Batches are padded up to a few buckets (``graph_shape``): rows to a power of two,
  lengths to a multiple of 64 (256 past 1,024 tokens). Padding is right-padding, so causal attention
  keeps every real token from seeing it, and padded positions' outputs are never read.
* **Weights.** The graphs read the parameters' own storage, which the optimizer updates in place, through
  private leaf aliases (``nn.Parameter(p.detach())``); the cast to the compute dtype
  (``models.precision``'s bf16 copies) happens inside the forward graph.
* **Gradients.** The backward graph adds its gradients into one persistent buffer per parameter,
  which is the parameter's ``.grad`` while a step runs (handed out zeroed when the optimizer has set
  it to None), so micro-batches accumulate and the LM head's gradient of a tied embedding adds to the
  same buffer. Nothing of the graph's own autograd history survives the recording, so no autograd
  node made before a capture (the trainer's LM-head cast of a tied embedding, say) takes part in one
  (such a node, made on the default stream, makes the capture fail).
* **Memory.** All shapes' graphs share one memory pool, so the activations take the largest shape's
  room, not the sum: each forward replay is followed by its backward (or, without autograd, its output
  is read) before another shape replays. At most ``MAX_SHAPES`` shapes are recorded; batches of
  other shapes run the same body eagerly.

Only the body: the chunked LM head, the loss and the optimizer stay eager (a few hundred launches).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from posttrain.errors import TrainingError
from posttrain.models.moe import is_sparse_moe
from posttrain.models.precision import Precision, compute_weights
from posttrain.models.structure import body_hidden_states, split_body_and_head

if TYPE_CHECKING:
    from collections.abc import Iterator

    from posttrain.config.schema import RunConfig

log = logging.getLogger(__name__)

MAX_SHAPES = 6
"""Input shapes recorded per run."""

AUTO_WORK_LIMIT = 2.5e11
"""``auto`` records graphs while parameters x micro-batch rows x ``rollout.max_tokens`` stays under
this: 4x the default recipe (134.5M x 32 x 16 = 6.9e10), whose update the graphs made 4x faster on
one H200; W (0.4B x 64 x 256 = 6.6e12) was even, the 1.5B shape 2 % slower (docs/benchmarks.md)."""

WARMUP_PASSES = 2
"""Forward and backward passes run before a capture, on the capture's stream: lazy initialisation
(cuBLAS workspaces, Triton compiles, autotuning) must not happen inside it."""


CAPTURE_MODE = "thread_local"
"""Only this thread's unsafe CUDA calls break a capture: a colocated vLLM engine's threads may run."""


def cuda_graphs_choice(
    cfg: RunConfig, *, device_type: str, policy_ranks: int, moe: bool, vision: bool, params: int, reference: bool
) -> tuple[bool, str]:
    """``model.cuda_graphs`` for a loaded policy of ``params`` parameters: whether to record its body's
    graphs, and why (for the log). ``true`` and ``false`` are taken as set (the preflight refused a
    ``true`` that cannot run). ``auto`` records them for a small update of a plain policy body on one
    CUDA device, without a KL ``reference``: the reference runs eagerly, so at step 1 its logprobs
    would differ from the graphed policy's by rounding (padded shapes pick other kernels), where
    unpadded they are equal and the first KL is exactly 0."""
    model = cfg.model
    if model.cuda_graphs != "auto":
        return bool(model.cuda_graphs), f"model.cuda_graphs={str(model.cuda_graphs).lower()}"
    rows = cfg.rl.micro_batch_per_replica or cfg.rl.mini_batch
    work = params * rows * cfg.rollout.max_tokens
    reasons_off = [
        (device_type != "cuda", f"the policy is on {device_type}, not CUDA"),
        (policy_ranks > 1, f"{policy_ranks} policy ranks"),
        (model.compile, "model.compile=true"),
        (model.lora.enabled, "LoRA is on"),
        (model.gradient_checkpointing, "gradient checkpointing is on"),
        (model.sequence_packing, "sequence packing is on"),
        (model.share_prompt_prefix is True, "model.share_prompt_prefix=true"),
        (moe, "a sparse-MoE policy"),
        (vision, "a vision-language policy"),
        (reference, "a KL reference runs beside it (its eager logprobs would differ from the graphs' by rounding)"),
        (
            work > AUTO_WORK_LIMIT,
            f"the update is large enough to keep the GPU busy (parameters x micro-batch rows x max_tokens = "
            f"{work:.2g} > {AUTO_WORK_LIMIT:.2g})",
        ),
    ]
    why_off = next((why for off, why in reasons_off if off), None)
    if why_off is not None:
        return False, f"model.cuda_graphs=auto: off, {why_off}"
    return True, f"model.cuda_graphs=auto: on (a small update: {work:.2g} <= {AUTO_WORK_LIMIT:.2g})"


def graphed_body_for(
    model: nn.Module, cfg: RunConfig, precision: Precision, policy_ranks: int, *, reference: bool
) -> tuple[GraphedBody | None, str]:
    """The policy's ``GraphedBody`` where ``model.cuda_graphs`` (``cuda_graphs_choice``) records one,
    else None; with the choice's reason, for the log. ``reference``: the run has a KL reference."""
    device = next(model.parameters()).device
    on, note = cuda_graphs_choice(
        cfg,
        device_type=device.type,
        policy_ranks=policy_ranks,
        moe=is_sparse_moe(model),
        vision=hasattr(getattr(model, "config", None), "vision_config"),
        params=sum(p.numel() for p in model.parameters()),
        reference=reference,
    )
    if not on:
        return None, note
    if device.type != "cuda" or policy_ranks > 1:
        raise TrainingError("model.cuda_graphs=true needs the policy on one CUDA device (one policy rank)")
    return GraphedBody(split_body_and_head(model)[0], precision), note


def graph_shape(rows: int, length: int) -> tuple[int, int]:
    """The padded ``(rows, length)`` a ``[rows, length]`` batch runs as: rows up to a power of two,
    the length up to a multiple of 64 (of 256 past 1,024), so a run's changing batches meet few
    shapes (each shape is a recording)."""
    if rows < 1 or length < 1:
        raise ValueError(f"a graphed batch needs at least one row and one token, got [{rows}, {length}]")
    padded_rows = 1 << (rows - 1).bit_length()
    step = 64 if length <= 1024 else 256
    return padded_rows, -(-length // step) * step


class _Body(nn.Module):
    """The decoder body with its weights cast inside (``compute_weights``): the eager path, for
    batches of shapes beyond ``MAX_SHAPES``."""

    def __init__(self, body: nn.Module, precision: Precision):
        super().__init__()
        self.body = body
        self.precision = precision

    def forward(self, input_ids_RL: Tensor) -> Tensor:
        with compute_weights(self.body, self.precision):
            return body_hidden_states(self.body, input_ids_RL)


class AliasedBody:
    """The body run over leaf aliases of its parameters: every parameter slot of ``body`` (tied ones
    included) reads its alias, cast to the compute dtype when the run is mixed. The aliases share the
    parameters' storage, so in-place updates of the parameters are what the aliases read; gradients
    taken with respect to the aliases are the parameters' gradients."""

    def __init__(self, body: nn.Module, precision: Precision):
        self.body = body
        self.precision = precision
        self.params = list(body.parameters())  # each once, tied ones too
        self.aliases = [nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in self.params]
        index = {id(p): i for i, p in enumerate(self.params)}
        # typed as Parameters; a plain tensor there reads through Module.__getattr__ alike
        self._slots: list[tuple[dict[str, Any], str, int]] = [
            (module._parameters, name, index[id(p)])
            for module in body.modules()
            for name, p in module._parameters.items()
            if p is not None
        ]

    @contextlib.contextmanager
    def _reading_aliases(self) -> Iterator[None]:
        mixed = self.precision.mixed
        weights: dict[int, Tensor] = {}
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for slots, name, i in self._slots:
                if i not in weights:
                    alias = self.aliases[i]
                    cast = mixed and alias.is_floating_point() and alias.dtype == self.precision.param_dtype
                    weights[i] = alias.to(self.precision.compute_dtype) if cast else alias
                swapped.append((slots, name, slots[name]))
                slots[name] = weights[i]
            yield
        finally:
            for slots, name, original in reversed(swapped):
                slots[name] = original

    def __call__(self, input_ids_RL: Tensor) -> Tensor:
        with self._reading_aliases():
            return body_hidden_states(self.body, input_ids_RL)


class _Recording:
    """One padded shape's forward and backward graphs. The backward graph adds each parameter's
    gradient into ``grad_buffers`` (the same buffers for every shape); ``used`` are the indices of the
    parameters it has a gradient for."""

    def __init__(self, aliased: AliasedBody, ids_RL: Tensor, grad_buffers: list[Tensor], pool: Any):
        self.static_ids = ids_RL
        trained = [i for i, a in enumerate(aliased.aliases) if a.requires_grad]
        aliases = [aliased.aliases[i] for i in trained]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.enable_grad():
            for _ in range(WARMUP_PASSES):
                out = aliased(ids_RL)
                torch.autograd.grad(out, aliases, torch.ones_like(out), allow_unused=True)
            del out
            self.forward_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.forward_graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_MODE):
                static_out = aliased(ids_RL)
            self.static_grad_out = torch.empty_like(static_out)
            self.backward_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.backward_graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_MODE):
                grads = torch.autograd.grad(static_out, aliases, self.static_grad_out, allow_unused=True)
                used = [(i, g) for i, g in zip(trained, grads) if g is not None]
                torch._foreach_add_([grad_buffers[i] for i, _ in used], [g for _, g in used])
            self.used = {i for i, _ in used}
            del grads, used
        torch.cuda.current_stream().wait_stream(stream)
        self.static_out = static_out.detach()  # the capture's autograd history goes; replays need none of it


class _Replay(torch.autograd.Function):
    """The forward graph's replay as an autograd node whose backward replays the backward graph. Its
    gradient goes into the parameters' ``.grad`` buffers inside the graph, so it returns none."""

    @staticmethod
    def forward(ctx: Any, graphed: GraphedBody, recording: _Recording, anchor: Tensor) -> Tensor:
        recording.forward_graph.replay()
        ctx.graphed, ctx.recording = graphed, recording
        return recording.static_out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[None, None, None]:
        ctx.graphed.hand_out_grads()
        ctx.recording.static_grad_out.copy_(grad_out)
        ctx.recording.backward_graph.replay()
        return None, None, None


class GraphedBody:
    """``hidden_states(input_ids_RL)``: the body's ``[R, L, H]`` output for right-padded rows, from the
    recorded graphs of the padded shape (recorded at the first batch of that shape)."""

    def __init__(self, body: nn.Module, precision: Precision):
        self.body = body
        self.precision = precision
        self.eager = _Body(body, precision)
        self.aliased = AliasedBody(body, precision)
        self._recordings: dict[tuple[int, int], _Recording] = {}
        self._grads: list[Tensor] | None = None
        self._used: set[int] = set()  # parameters some recording has a gradient for
        self._pool: Any = None
        self._anchor: Tensor | None = None  # a leaf that makes the replay an autograd node
        self._warned_full = False
        self.capture_seconds = 0.0

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The padded shapes recorded so far."""
        return list(self._recordings)

    def hidden_states(self, input_ids_RL: Tensor) -> Tensor:
        rows, length = input_ids_RL.shape
        shape = graph_shape(rows, length)
        recording = self._recordings.get(shape)
        if recording is None and len(self._recordings) < MAX_SHAPES:
            recording = self._recordings[shape] = self._record(shape, input_ids_RL)
        if recording is None:
            if not self._warned_full:
                log.warning(
                    f"model.cuda_graphs: {MAX_SHAPES} shapes recorded already ({self.shapes}); batches of "
                    f"other shapes (now [{rows}, {length}] -> {list(shape)}) run the body eagerly"
                )
                self._warned_full = True
            return self.eager(input_ids_RL)
        recording.static_ids.zero_()
        recording.static_ids[:rows, :length].copy_(input_ids_RL)
        if torch.is_grad_enabled():
            self.hand_out_grads()  # before any backward of this step: the LM head's must add to them too
            if self._anchor is None:
                self._anchor = torch.zeros(0, device=input_ids_RL.device, requires_grad=True)
            hidden = _Replay.apply(self, recording, self._anchor)
        else:
            recording.forward_graph.replay()
            hidden = recording.static_out.detach()
        return hidden[:rows, :length]

    def hand_out_grads(self) -> None:
        """Make the ``.grad`` of every parameter the graphs train the buffer their backward adds into:
        zeroed where the gradient was unset (the optimizer sets it to None after a step); a gradient
        held elsewhere is moved into the buffer first. A parameter the body never uses keeps no
        gradient, as in an eager backward (the optimizer then leaves it alone)."""
        buffers = self._grad_buffers()
        fresh = []
        for i in sorted(self._used):
            p, b = self.aliased.params[i], buffers[i]
            if p.grad is b:
                continue
            if p.grad is None:
                fresh.append(b)
            else:
                b.copy_(p.grad)
            p.grad = b
        if fresh:
            torch._foreach_zero_(fresh)

    def _grad_buffers(self) -> list[Tensor]:
        if self._grads is None:
            # one per trained parameter (a frozen one's is an empty placeholder)
            self._grads = [torch.zeros_like(p) if p.requires_grad else p.new_empty(0) for p in self.aliased.params]
        return self._grads

    def _record(self, shape: tuple[int, int], input_ids_RL: Tensor) -> _Recording:
        start = time.perf_counter()
        static_ids = input_ids_RL.new_zeros(shape)
        static_ids[: input_ids_RL.shape[0], : input_ids_RL.shape[1]].copy_(input_ids_RL)
        buffers = self._grad_buffers()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            recording = _Recording(self.aliased, static_ids, buffers, self._pool)
        except Exception as exc:  # a kernel that cannot be captured, a host sync in the forward
            raise TrainingError(
                f"model.cuda_graphs: recording the policy body's CUDA graphs for input shape {list(shape)} failed "
                f"({type(exc).__name__}: {exc}); set model.cuda_graphs=false"
            ) from exc
        self._used |= recording.used
        elapsed = time.perf_counter() - start
        self.capture_seconds += elapsed
        log.info(f"model.cuda_graphs: recorded the body's forward and backward for {list(shape)} in {elapsed:.1f} s")
        return recording
