"""Where the parts of a Hugging Face causal LM are: its decoder body and its LM head.

The trainer, the FSDP2 sharding and the transformers teacher all run the body and the head apart
(chunked logprobs, one FSDP unit per part), so they find them the same way, here; the body runs
through ``body_hidden_states``, which tells transformers when its rows hold no packed sequences
(``rows_not_packed``); and ``model.compile`` compiles the body's decoder layers (``compile_layers``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from posttrain.errors import PosttrainError


def split_body_and_head(model: Any) -> tuple[nn.Module, nn.Module]:
    """The decoder body (returns hidden states) and the LM head of a Hugging Face causal LM."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if head is None or body is None:
        raise PosttrainError(
            f"{type(model).__name__} does not expose its decoder body and LM head (get_decoder / "
            "get_output_embeddings); posttrain needs a Hugging Face *ForCausalLM model"
        )
    config = getattr(model, "config", None)
    for knob in ("logit_scale", "logits_scaling"):
        value = getattr(config, knob, None)
        if value is not None and value != 1:
            # These models rescale logits inside forward(); the chunked head would silently miss it.
            raise PosttrainError(f"model config sets {knob}={value}, which the chunked logprob path does not apply")
    return body, head


def body_hidden_states(body: nn.Module, input_ids_RL: Tensor, position_ids_RL: Tensor | None = None) -> Tensor:
    """The decoder body's last hidden states ``[R, L, H]`` for ``input_ids_RL`` (no KV cache kept).
    ``position_ids_RL`` None means padded rows, one sequence each (positions 0..L-1); packed rows
    pass their positions, from which transformers builds the per-sequence mask."""
    padded = contextlib.nullcontext() if position_ids_RL is not None else rows_not_packed()
    with padded:
        out = body(input_ids=input_ids_RL, position_ids=position_ids_RL, use_cache=False)
    hidden: Tensor = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden


_ROWS_NOT_PACKED = contextvars.ContextVar("posttrain_rows_not_packed", default=False)


@contextlib.contextmanager
def rows_not_packed() -> Iterator[None]:
    """Tell transformers that the rows of the forwards run inside hold no packed sequences.

    Its mask builder looks for packing in the position ids (``masking_utils.
    find_packed_sequence_indices``), which costs a host sync per forward on a GPU (a Python ``if`` on
    a device tensor: the host waits for every queued kernel, the previous micro-batch's backward
    included, before it launches the forward); during a CUDA capture it cannot read them at all and
    assumes packing, so it builds a full ``[B, 1, L, L]`` mask, which keeps SDPA off its flash kernel
    (on one H200 the 1.5B update took 7 % longer graphed than eager). Padded rows are never packed
    (their positions are 0..L-1), so the answer is known without reading anything. The flag is a
    context variable, so a forward in another thread (a packed one, say) still gets the check."""
    _install_packing_check()
    token = _ROWS_NOT_PACKED.set(True)
    try:
        yield
    finally:
        _ROWS_NOT_PACKED.reset(token)


def _install_packing_check() -> None:
    """Wrap transformers' packing check once, so that it answers "no packing" while
    ``rows_not_packed`` is open and asks the original otherwise."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None or getattr(original, "_posttrain_wrapped", False):
        return  # a transformers without the check builds no such mask; or already wrapped

    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: Tensor) -> Tensor | None:
        return None if _ROWS_NOT_PACKED.get() else original(position_ids)

    find_packed_sequence_indices._posttrain_wrapped = True  # type: ignore[attr-defined]
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` every decoder layer in place (``model.compile``), with dynamic shapes so that
    changing batch and sequence sizes do not recompile each step."""
    body, _ = split_body_and_head(model)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise PosttrainError(f"model.compile=true: {type(body).__name__} has no .layers to compile")
    for layer in layers:
        layer.compile(dynamic=True)
