"""``models/tiny.py``'s dense families: each saves a model of its own type that loads and runs, and an
unknown family is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.mark.parametrize(
    ("family", "architecture", "norms"),
    [
        ("llama", "LlamaForCausalLM", 5),
        ("qwen2", "Qwen2ForCausalLM", 5),
        ("qwen3", "Qwen3ForCausalLM", 9),
        ("mistral", "MistralForCausalLM", 5),
    ],
)
def test_each_family_saves_its_own_type(
    family: str, architecture: str, norms: int, smollm2_tokenizer_dir: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from posttrain.models.tiny import make_tiny_model

    model_dir = make_tiny_model(
        str(tmp_path), smollm2_tokenizer_dir, family=family, hidden_size=128, num_heads=4, num_kv_heads=2
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == architecture
    # two norms per layer and the final one; Qwen3 adds one over each query head and each key head
    assert sum(type(m).__name__.endswith("RMSNorm") for m in model.modules()) == norms
    if family == "qwen3":  # heads as wide as hidden / heads (the config's own default is 128 whatever the width)
        assert model.config.head_dim == 32
        assert model.model.layers[0].self_attn.q_norm.weight.shape == (32,)
    if family == "mistral":  # full attention: Mistral's config would otherwise slide a 4,096-token window
        assert model.config.sliding_window is None
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, model.config.vocab_size)


def test_an_unknown_family_is_refused_by_name(smollm2_tokenizer_dir: str, tmp_path: Path) -> None:
    from posttrain.models.tiny import make_tiny_model

    refused = "family must be one of \\['llama', 'mistral', 'qwen2', 'qwen3'\\], got 'gpt2'"
    with pytest.raises(ValueError, match=refused):
        make_tiny_model(str(tmp_path), smollm2_tokenizer_dir, family="gpt2")
