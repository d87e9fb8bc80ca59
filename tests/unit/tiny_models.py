"""The tiny random Llama the unit tests build in memory (two layers, width 16, grouped-query
attention, tied embeddings): one definition, so the tests that need a real transformers model agree."""

from __future__ import annotations

from typing import Any


def tiny_llama(vocab: int, *, config_dtype: str | None = None, attention: str = "eager") -> Any:
    """A ``LlamaForCausalLM`` of ``vocab`` tokens (random weights: seed torch first for repeatable ones)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        attn_implementation=attention,
        **({"dtype": config_dtype} if config_dtype else {}),
    )
    return LlamaForCausalLM(config)
