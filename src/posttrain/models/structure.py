"""Where the parts of a Hugging Face causal LM are: its decoder body and its LM head.

The trainer, the FSDP2 sharding and the transformers teacher all run the body and the head apart
(chunked logprobs, one FSDP unit per part), so they find them the same way, here; and
``model.compile`` compiles the body's decoder layers (``compile_layers``).
"""

from __future__ import annotations

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
    """The decoder body's last hidden states ``[R, L, H]`` for ``input_ids_RL`` (no KV cache kept)."""
    out = body(input_ids=input_ids_RL, position_ids=position_ids_RL, use_cache=False)
    hidden: Tensor = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` every decoder layer in place (``model.compile``), with dynamic shapes so that
    changing batch and sequence sizes do not recompile each step."""
    body, _ = split_body_and_head(model)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise PosttrainError(f"model.compile=true: {type(body).__name__} has no .layers to compile")
    for layer in layers:
        layer.compile(dynamic=True)
