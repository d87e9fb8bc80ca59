"""Tiny random Llama (or Qwen2, Qwen3), Qwen3-MoE and Qwen3-VL models with a real tokenizer, for tests (nothing
downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def make_tiny_model(
    out_dir: str,
    tokenizer_dir: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    family: str = "llama",
) -> str:
    """Save a randomly initialised ``LlamaForCausalLM`` (fp32) sized to ``tokenizer_dir``'s vocabulary,
    together with that tokenizer, into ``out_dir``; returns ``out_dir``. ``family="qwen2"``: the same
    body as a ``Qwen2ForCausalLM`` (biased query/key/value projections); ``family="qwen3"``: a
    ``Qwen3ForCausalLM`` (an RMSNorm over each query and key head, heads of ``hidden_size / num_heads``);
    ``family="mistral"``: a ``MistralForCausalLM`` with full attention (no sliding window, as Mistral v0.2 on)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }
    if family not in classes:
        raise ValueError(f"family must be one of {sorted(classes)}, got {family!r}")
    config_class, model_class = classes[family]
    family_options: dict[str, int | None] = {}
    if family == "qwen3":  # its config fixes its heads' width (128) apart from the hidden size; the others derive it
        family_options["head_dim"] = hidden_size // num_heads
    if family == "mistral":  # MistralConfig's default window is 4,096 tokens
        family_options["sliding_window"] = None
    tokenizer = _tokenizer(tokenizer_dir)
    config = config_class(
        **family_options,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return _save(model, tokenizer, out_dir)


def make_tiny_moe_model(
    out_dir: str,
    tokenizer_dir: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = True,
    seed: int = 0,
) -> str:
    """Save a randomly initialised sparse ``Qwen3MoeForCausalLM`` (fp32, every layer an MoE layer,
    untied head) sized to ``tokenizer_dir``'s vocabulary, with that tokenizer, into ``out_dir``.
    Its head size is ``hidden_size // num_heads`` (32 by default: vLLM's CPU attention refuses 16).
    The router weights are drawn like every other linear weight (transformers initialises them to
    zero, which would tie every expert score)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = _tokenizer(tokenizer_dir)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.head_dim = hidden_size // num_heads  # written to config.json: vLLM reads it
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.mlp.gate.weight, std=config.initializer_range)
    return _save(model, tokenizer, out_dir)


def make_tiny_vl_model(
    out_dir: str,
    tokenizer_dir: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    vision_hidden_size: int = 32,
    vision_depth: int = 2,
    patch_size: int = 16,
    min_pixels: int = 32 * 32,
    max_pixels: int = 64 * 64,
    seed: int = 0,
) -> str:
    """Save a randomly initialised ``Qwen3VLForConditionalGeneration`` (fp32, tied head, head size 32)
    with ``tokenizer_dir``'s tokenizer plus the four vision tokens and ``VL_CHAT_TEMPLATE``, and a
    Qwen2-VL image processor config (``preprocessor_config.json``; images resized to between
    ``min_pixels`` and ``max_pixels``, so a test image is a few patches) into ``out_dir``.
    ``posttrain.models.vision.VisionProcessor.from_dir(out_dir)`` renders prompts for it."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from posttrain.models.vision import VISION_TOKENS, VL_CHAT_TEMPLATE

    tokenizer = _tokenizer(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids: Any = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    start, end, image, video = ids
    head_dim = hidden_size // num_heads
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        # M-RoPE splits the rotary half-dimension into (time, height, width) sections.
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope(head_dim)},
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": True,
    }
    vision = {
        "depth": vision_depth,
        "hidden_size": vision_hidden_size,
        "intermediate_size": 2 * vision_hidden_size,
        "num_heads": 2,
        "out_hidden_size": hidden_size,
        "patch_size": patch_size,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )
    _save(model, tokenizer, out_dir)
    image_processor.save_pretrained(out_dir)
    return out_dir


def _tokenizer(tokenizer_dir: str) -> Any:
    """The local tokenizer, with its EOS as the pad token when it has none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _save(model: Any, tokenizer: Any, out_dir: str) -> str:
    """Give ``model`` a generation config of the tokenizer's special ids, save both into ``out_dir``."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _mrope(head_dim: int) -> list[int]:
    """Qwen3-VL's (t, h, w) rotary sections for ``head_dim``, in its 24:20:20 proportion."""
    half = head_dim // 2
    h = w = half * 20 // 64
    return [half - h - w, h, w]
