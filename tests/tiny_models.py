"""The tiny random models the tests build in memory: a Llama (two layers, width 16, grouped-query attention,
tied embeddings) and a Qwen3-MoE (two sparse layers, eight experts, top-2): one definition each, so the tests that
need a real transformers model agree. Importable from every test folder (``tests/`` holds the root conftest)."""

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


def tiny_qwen3_moe(vocab: int = 1000) -> Any:
    """A ``Qwen3MoeForCausalLM`` of ``vocab`` tokens, the same weights on every call (seed 0, the caller's RNG
    state untouched): width 32, two sparse layers of eight 16-wide experts, top-2, untied head. The routers
    are drawn at std 0.5 (transformers starts them at zero, tying every expert score), which keeps the
    top-k scores apart: no fp32 near-ties for a replay or a second rank to break differently."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config)
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.mlp.gate.weight, std=0.5)
    return model
