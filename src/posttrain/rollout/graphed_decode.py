"""The transformers engine's decode on CUDA, one step replayed as a CUDA graph (``rollout.cuda_graphs``).

Why: a decode step of a small model is bound by the host, not the GPU. W's 0.4B model decodes 256 rows in
well under a millisecond of GPU work per step, but a step of transformers' forward dispatches some 400
kernels from Python, and vLLM's engine spends 4-6 ms a step on its scheduler, sampler and output plumbing
(docs/benchmarks.md, "What bounds the step"). Here one whole step (draw a token per row from the last
logits, record it, feed it through the decoder, keep the next logits) is recorded once and replayed, so the
host launches one graph per token and waits on the GPU only every ``DONE_CHECK_EVERY`` steps.

What makes a step replayable:

* **Static shapes.** The rows stay in the batch when they finish (their later tokens are not recorded), and
  the KV cache is one preallocated ``[rows, kv_heads, slots, head_dim]`` buffer per layer, its slot count
  rounded up to ``SLOT_BUCKET`` so that calls whose prompts differ in length replay the same graph. A
  prompt's left padding and the slots not yet written are masked by an additive ``-inf`` bias.
* **Counters on the device.** The step index, the cache slot and each row's position id are tensors the
  graph increments itself; the uniforms of the inverse-CDF draw are drawn for the whole call up front from
  the call's seeded generator (``[max_tokens, rows]``), which the graph indexes by the step counter.
* **Weights at fixed addresses.** Under mixed precision the graph reads compute-dtype copies that belong to
  this object and are refreshed in place (one foreach copy) at every call; otherwise it reads the
  parameters, whose addresses are checked at every call (a moved parameter drops the graphs).
* **Attention without copies.** The decoder layers run through their own submodules (norms, projections,
  the modeling module's rotary embedding, MLP), not transformers' attention dispatch: for one new token
  per row, the query heads of a key-value group are that group's rows of one SDPA call over the cached keys
  (``grouped_decode_attention``), so grouped-query attention reads each cached key once instead of
  repeating it per query head as transformers' masked SDPA path does.

Supported: the dense full-attention decoders listed in ``config.rollout.GRAPHED_DECODE_MODEL_TYPES`` with plain rotary
embeddings (``decode_graph_support``); the prefill stays the engine's eager forward.

The draws: the same inverse-CDF sampler as the eager loop (``hf_engine.draw_tokens``), its uniforms drawn
per call as one ``[max_tokens, rows]`` block rather than one column per step over the rows still running,
so the graphed decode draws other tokens than the eager one from the same seed (and its bf16 kernels round
differently anyway); a run and its resume on one machine draw the same.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.config.rollout import GRAPHED_DECODE_MODEL_TYPES
from posttrain.errors import TrainingError
from posttrain.models.moe import is_sparse_moe
from posttrain.models.precision import Precision, parameters_read_as
from posttrain.models.structure import split_body_and_head
from posttrain.rollout.base import SamplingParams

log = logging.getLogger(__name__)

PLAIN_ROPE = ("default", "linear", "llama3")
"""Rotary embeddings that depend on the positions alone (``dynamic`` and ``longrope`` read the largest
position on the host, which a graph cannot)."""

SLOT_BUCKET = 128
"""KV-cache slots are rounded up to a multiple of this: calls whose prompts differ in length share a graph."""

MAX_GRAPHS = 4
"""Graphs (with their KV caches) kept per engine; the least recently used beyond this is dropped."""

DONE_CHECK_EVERY = 16
"""Replays between host checks of whether every row has finished (each check waits for the GPU)."""


def decode_graph_support(model: nn.Module) -> str | None:
    """None when ``model``'s decode can be graphed here; else why not, for the log or an error."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    # GRAPHED_DECODE_MODEL_TYPES: decoders whose layers are (RMSNorm, attention with q/k/v/o projections and
    # rotary embeddings, optional q/k head norms, RMSNorm, MLP), each with a residual: what _layer_step runs
    if model_type not in GRAPHED_DECODE_MODEL_TYPES:
        return f"model_type {model_type!r} (graphed decode: {', '.join(GRAPHED_DECODE_MODEL_TYPES)})"
    if is_sparse_moe(model):
        return "a sparse-MoE policy"
    body, _ = split_body_and_head(model)
    layers = getattr(body, "layers", None)
    if layers is None or not all(hasattr(body, name) for name in ("embed_tokens", "norm", "rotary_emb")):
        return f"{type(body).__name__} lacks embed_tokens, layers, norm or rotary_emb"
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return f"{type(layer).__name__} has no plain self-attention (q/k/v/o projections)"
        if _sliding_window(attn, config) is not None:
            return "sliding-window attention"
        if any(hasattr(mod, "lora_A") for mod in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)):
            return "LoRA-wrapped projections"
    rope_type = getattr(body.rotary_emb, "rope_type", "default")
    if rope_type not in PLAIN_ROPE:
        return f"rope_type {rope_type!r} (graphed decode: {', '.join(PLAIN_ROPE)})"
    return None


def _sliding_window(attn: nn.Module, config: Any) -> int | None:
    """The window an attention layer attends within, None for full attention. Qwen2 and Qwen3 layers hold
    theirs (None on their full-attention layers); Mistral's forward reads ``config.sliding_window`` at every
    call (Mistral-7B-v0.1: 4,096 tokens), so a layer without the attribute has the config's."""
    holder = attn if hasattr(attn, "sliding_window") else config
    window: int | None = getattr(holder, "sliding_window", None)
    return window


def decode_graphs_choice(setting: bool | str, model: nn.Module) -> tuple[bool, str]:
    """``rollout.cuda_graphs`` for the transformers engine sampling with ``model``: whether to graph its
    decode, and a note for the log. ``auto`` graphs on CUDA where ``decode_graph_support`` finds nothing
    against it; ``true`` there too, and raises a ``ConfigError`` naming the knob elsewhere (the preflight
    refused the cases it can see before the model loaded)."""
    from posttrain.errors import ConfigError

    if setting is False:
        return False, "decode eager (rollout.cuda_graphs=false)"
    device = next(model.parameters()).device
    reason = "the model is not on CUDA" if device.type != "cuda" else decode_graph_support(model)
    if reason is None:
        return True, "decode replayed as CUDA graphs (rollout.cuda_graphs)"
    if setting is True:
        raise ConfigError(
            [f"rollout.cuda_graphs=true cannot graph this decode: {reason}; set rollout.cuda_graphs=auto"]
        )
    return False, f"decode eager (rollout.cuda_graphs=auto: {reason})"


def grouped_decode_attention(
    query_BH1D: Tensor, key_BKLD: Tensor, value_BKLD: Tensor, bias_B11L: Tensor, scale: float
) -> Tensor:
    """Attention of one new token per row over the cached keys, ``[B, 1, H * D]``.

    The ``H / K`` query heads of key-value head ``k`` (heads ``k * G .. k * G + G - 1``, transformers'
    ``repeat_kv`` order) attend with the same keys and the same mask, so they are ``G`` query rows of one
    SDPA call per (row, key-value head): no key or value is copied per query head."""
    rows, heads, _, dim = query_BH1D.shape
    kv_heads = key_BKLD.shape[1]
    query_BKGD = query_BH1D.reshape(rows, kv_heads, heads // kv_heads, dim)
    out_BKGD = F.scaled_dot_product_attention(query_BKGD, key_BKLD, value_BKLD, attn_mask=bias_B11L, scale=scale)
    return out_BKGD.reshape(rows, 1, heads * dim)


def _rotary_function(attn: nn.Module) -> Callable[..., tuple[Tensor, Tensor]]:
    """The modeling module's ``apply_rotary_pos_emb`` (as patched there, by Liger-Kernel for instance)."""
    fn: Callable[..., tuple[Tensor, Tensor]] = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    return fn


@dataclass
class _Counters:
    """What the graph increments: the step (row of the uniforms, column of the outputs) and the cache slot."""

    step: Tensor
    slot: Tensor


class StaticDecode:
    """The buffers of one decode shape (rows, cache slots, tokens, sampling settings) and its step.

    ``step()`` is the replayable unit: draw from ``logits_BV``, record, feed the drawn tokens through the
    decoder into the next ``logits_BV``. It runs eagerly too (the CPU tests compare it with the engine's
    transformers forward)."""

    def __init__(
        self,
        model: nn.Module,
        rows: int,
        slots: int,
        *,
        params: SamplingParams,
        eos_ids: list[int],
        dtype: torch.dtype,
        draw: Callable[[Tensor, SamplingParams, Tensor, Tensor | None], tuple[Tensor, Tensor]],
    ) -> None:
        body: Any
        head: Any
        body, head = split_body_and_head(model)
        self.body, self.head, self.params, self.draw = body, head, params, draw
        self.layers: list[Any] = list(body.layers)
        attn = self.layers[0].self_attn
        self.rotary = _rotary_function(attn)
        device = next(model.parameters()).device
        config: Any = model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads
        vocab = head.weight.shape[0]
        self.rows, self.slots, self.max_tokens = rows, slots, params.max_tokens
        self.keys = [torch.zeros(rows, kv_heads, slots, head_dim, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.bias_B11L = torch.full((rows, 1, 1, slots), float("-inf"), dtype=dtype, device=device)
        self.pos_B = torch.zeros(rows, dtype=torch.long, device=device)
        self.counters = _Counters(torch.zeros(1, dtype=torch.long, device=device), torch.zeros_like(self.pos_B[:1]))
        self.logits_BV = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.uniform_TB = torch.zeros(params.max_tokens + 1, rows, dtype=torch.float64, device=device)
        self.tokens_BT = torch.full((rows, params.max_tokens + 1), -1, dtype=torch.long, device=device)
        self.logprobs_BT = torch.zeros(rows, params.max_tokens + 1, dtype=torch.float32, device=device)
        self.done_B = torch.zeros(rows, dtype=torch.bool, device=device)
        self.stopped_B = torch.zeros_like(self.done_B)
        self.eos_E = torch.tensor(eos_ids, dtype=torch.long, device=device)
        self.seen_BV = (
            torch.zeros(rows, vocab, dtype=torch.bool, device=device) if params.repetition_penalty != 1.0 else None
        )

    def start(
        self,
        prefill_cache: Any,
        width: int,
        *,
        mask_BK: Tensor,
        pos_B: Tensor,
        logits_BV: Tensor,
        seen_BV: Tensor | None,
        generator: torch.Generator,
    ) -> None:
        """A new call's state: the prompts' keys and values (``width`` slots, left-padded), their mask, each
        row's last position, the prefill's logits and this call's uniforms from ``generator``."""
        for layer_cache, keys, values in zip(prefill_cache.layers, self.keys, self.values):
            keys[:, :, :width].copy_(layer_cache.keys)
            values[:, :, :width].copy_(layer_cache.values)
        self.bias_B11L.fill_(float("-inf"))
        self.bias_B11L[:, 0, 0, :width].masked_fill_(mask_BK.bool(), 0.0)
        self.pos_B.copy_(pos_B)
        self.counters.step.zero_()
        self.counters.slot.fill_(width)
        self.logits_BV.copy_(logits_BV)
        self.uniform_TB.copy_(
            torch.rand(self.uniform_TB.shape, generator=generator, dtype=torch.float64, device=self.pos_B.device)
        )
        self.tokens_BT.fill_(-1)
        self.logprobs_BT.zero_()
        self.done_B.zero_()
        self.stopped_B.zero_()
        if self.seen_BV is not None and seen_BV is not None:
            self.seen_BV.copy_(seen_BV)

    def step(self) -> None:
        """Draw, record, then feed the drawn tokens: the one unit a graph replays."""
        step, slot = self.counters.step, self.counters.slot
        uniform_B1 = self.uniform_TB.index_select(0, step).view(self.rows, 1)
        ids_B, logprobs_BV = self.draw(self.logits_BV, self.params, uniform_B1, self.seen_BV)
        recording_B = ~self.done_B
        token_logprob_B = logprobs_BV.gather(-1, ids_B[:, None]).squeeze(-1)
        self.tokens_BT.index_copy_(1, step, torch.where(recording_B, ids_B, -1)[:, None])
        self.logprobs_BT.index_copy_(1, step, torch.where(recording_B, token_logprob_B, 0.0)[:, None])
        is_eos_B = (ids_B[:, None] == self.eos_E).any(-1)
        self.stopped_B |= is_eos_B & recording_B
        self.done_B |= is_eos_B
        if self.seen_BV is not None:
            self.seen_BV.scatter_(1, ids_B[:, None], True)
        self.pos_B += 1
        self.bias_B11L.index_fill_(-1, slot, 0.0)
        self.logits_BV.copy_(self.forward(ids_B))
        step += 1
        slot += 1

    def forward(self, ids_B: Tensor) -> Tensor:
        """The next-token logits ``[B, V]`` (fp32) after feeding ``ids_B`` at each row's next position,
        its keys and values written at the current slot."""
        hidden_B1H = self.body.embed_tokens(ids_B[:, None])
        cos, sin = self.body.rotary_emb(hidden_B1H, self.pos_B[:, None])
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            hidden_B1H = self._layer_step(layer, hidden_B1H, (cos, sin), (keys, values))
        logits_B1V: Tensor = self.head(self.body.norm(hidden_B1H))
        return logits_B1V[:, -1].float()

    def _layer_step(
        self, layer: Any, hidden_B1H: Tensor, rotary: tuple[Tensor, Tensor], cache: tuple[Tensor, Tensor]
    ) -> Tensor:
        """One decoder layer for one new token per row, its key and value written into ``cache`` at the slot."""
        attn = layer.self_attn
        keys, values = cache
        rows = hidden_B1H.shape[0]
        normed = layer.input_layernorm(hidden_B1H)
        head_dim = keys.shape[-1]
        query = attn.q_proj(normed).view(rows, 1, -1, head_dim)
        key = attn.k_proj(normed).view(rows, 1, -1, head_dim)
        if hasattr(attn, "q_norm"):  # qwen3: RMSNorm over each head's vector before the rotary embedding
            query, key = attn.q_norm(query), attn.k_norm(key)
        query, key = self.rotary(query.transpose(1, 2), key.transpose(1, 2), *rotary)
        value = attn.v_proj(normed).view(rows, 1, -1, head_dim).transpose(1, 2)
        keys.index_copy_(2, self.counters.slot, key)
        values.index_copy_(2, self.counters.slot, value)
        attended = grouped_decode_attention(query, keys, values, self.bias_B11L, attn.scaling)
        hidden_B1H = hidden_B1H + attn.o_proj(attended)
        return hidden_B1H + layer.mlp(layer.post_attention_layernorm(hidden_B1H))

    def collect(self, steps: int) -> tuple[Tensor, Tensor, Tensor]:
        """Tokens ``[B, T]`` (-1 past each row's end), their logprobs and whether each row stopped on EOS."""
        return self.tokens_BT[:, :steps], self.logprobs_BT[:, :steps], self.stopped_B


class DecodeGraphs:
    """An engine's recorded decode graphs, one per (rows, slots, sampling settings), and the weights they read."""

    def __init__(
        self,
        model: nn.Module,
        precision: Precision | None,
        eos_ids: list[int],
        draw: Callable[..., Any],
        *,
        record: bool = True,
        forced: bool = False,
        compiled: bool = False,
    ):
        """``record=False`` runs the same static step eagerly instead of recording it: what the CPU tests
        compare with the engine's eager decode. ``forced`` (``rollout.cuda_graphs=true``): a recording that
        fails raises; otherwise (``auto``) it is logged and the engine decodes eagerly from then on.
        ``compiled``: each new step goes through ``torch.compile`` before it is recorded, so that Inductor fuses
        its elementwise work into fewer kernels (a benchmark arm, ``grpo_step.py --decode-compile``; not yet
        measured on a GPU, so no setting reaches it)."""
        self.model, self.precision, self.eos_ids, self.draw, self.record = model, precision, eos_ids, draw, record
        self.forced = forced
        # a replayed step of a small model is probably bound by its kernel count, not its arithmetic (unprofiled)
        self.compiled = compiled
        self.mixed = precision is not None and precision.mixed
        self.dtype = precision.compute_dtype if precision is not None else next(model.parameters()).dtype
        self.graphs: OrderedDict[tuple[Any, ...], tuple[StaticDecode, torch.cuda.CUDAGraph | None]] = OrderedDict()
        self.pool: Any = None
        self.copies: dict[int, Tensor] = {}  # parameter id -> its compute-dtype copy (mixed precision)
        self.addresses: list[int] = []  # the parameters' storage the graphs read (not mixed)

    @contextlib.contextmanager
    def weights(self) -> Iterator[None]:
        """Inside, the model reads the weights the graphs read: under mixed precision this object's
        compute-dtype copies, refreshed from the parameters on entry; otherwise the parameters."""
        params = [p for p in self.model.parameters() if p.is_floating_point()]
        if not self.mixed:
            addresses = [p.data_ptr() for p in params]
            if addresses != self.addresses:  # moved (loaded anew, say): what was recorded reads freed memory
                self.graphs.clear()
                self.addresses = addresses
            yield
            return
        assert self.precision is not None
        if self.copies.keys() != {id(p) for p in params}:  # first call, or parameters replaced or added
            self.graphs.clear()
            self.copies = {id(p): p.detach().to(self.precision.compute_dtype) for p in params}
        else:
            torch._foreach_copy_([self.copies[id(p)] for p in params], [p.detach() for p in params])

        def read(_module: nn.Module, _name: str, param: Tensor) -> Tensor | None:
            return self.copies.get(id(param))

        with parameters_read_as(self.model, read):
            yield

    def decode(
        self, rows: int, width: int, params: SamplingParams
    ) -> tuple[StaticDecode, torch.cuda.CUDAGraph | None] | None:
        """The recorded decode for ``rows`` rows after prompts ``width`` slots wide (recorded now if new);
        None when recording it failed under ``auto`` (the caller decodes eagerly)."""
        slots = -(-(width + params.max_tokens + 1) // SLOT_BUCKET) * SLOT_BUCKET
        key = (
            rows,
            slots,
            params.max_tokens,
            params.temperature,
            params.top_p,
            params.top_k,
            params.repetition_penalty,
        )
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        static = StaticDecode(
            self.model, rows, slots, params=params, eos_ids=self.eos_ids, dtype=self.dtype, draw=self.draw
        )
        if self.compiled:  # this instance's step (what is recorded, or run eagerly) through Inductor
            static.step = torch.compile(static.step, dynamic=False)  # type: ignore[method-assign]
        try:
            self.graphs[key] = (static, self._record(static) if self.record else None)
        except RuntimeError as err:
            if self.forced:
                raise TrainingError(
                    f"rollout.cuda_graphs=true: recording the decode step failed ({err}); set "
                    "rollout.cuda_graphs=auto to decode eagerly where it fails"
                ) from err
            log.warning("rollout.cuda_graphs=auto: recording the decode step failed (%s); decoding eagerly", err)
            return None
        return self.graphs[key]

    @staticmethod
    def replay(static: StaticDecode, graph: torch.cuda.CUDAGraph | None) -> int:
        """Replay ``graph`` (None: run the step eagerly) until every row has finished or ``max_tokens``
        tokens; the steps taken."""
        for step in range(static.max_tokens):
            if graph is None:
                static.step()
            else:
                graph.replay()
            if (step + 1) % DONE_CHECK_EVERY == 0 and bool(static.done_B.all()):
                return step + 1
        return static.max_tokens

    def _record(self, static: StaticDecode) -> torch.cuda.CUDAGraph:
        """Warm the step up on a side stream (lazy kernels, workspaces), then capture it."""
        static.bias_B11L[:, :, :, 0] = 0.0  # a finite warm-up: one attended slot
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # a compiled step is also compiled here, not in the capture
                static.step()
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            static.step()
        log.info(
            "rollout: recorded the decode step as a CUDA graph (%d rows, %d cache slots, %d tokens)",
            static.rows,
            static.slots,
            static.max_tokens,
        )
        return graph
