"""A random-weight bf16 Llama of a named shape on the SmolLM2 tokenizer, saved as a Hugging Face
directory (for the GPU benchmarks; nothing is downloaded).

    python benchmarks/make_random_model.py TOKENIZER_DIR OUT_DIR --shape 1.5b [--arch qwen2]

Shapes: ``135m`` (SmolLM2-135M itself), ``tiny30`` (its 30 layers at width 64), ``0.5b``
(Qwen2.5-0.5B's body: issue 9's 402M workload model, the same as
``../shared/peers/make_random_models.py`` builds) and ``1.5b`` (Qwen2.5-1.5B's body: hidden 1,536,
intermediate 8,960, 28 layers, 12 query and 2 key/value heads of 128; 1.39B parameters with the
49,152-token vocabulary and tied embeddings). ``--arch qwen2``: the same body as a ``Qwen2ForCausalLM``
(biased query/key/value projections, as Qwen2.5 has; the head size must be hidden / heads, which holds for
``0.5b`` and ``1.5b``), an architecture vLLM 0.24 runs on its V1 model runner by default.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

SHAPES = {
    "135m": {},
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, head_dim=128),
    # the 135M shape's 30 layers at width 64: on a GPU its update is almost nothing but kernel
    # launches, the floor of the 135M shape's launch-bound small update (update_precision.py)
    "tiny30": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16),
    # larger bodies of the same family (Qwen2.5-3B and -7B; a 10B-class one between 7B and 14B),
    # used by update_memory.py to find the largest model that trains on one GPU
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, head_dim=128),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, head_dim=128),
    "10b": dict(hidden_size=4096, intermediate_size=22016, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128),
}  # fmt: skip


def shape_config(tokenizer_dir: str, shape: str) -> LlamaConfig:
    """SmolLM2's config (the tokenizer directory's) with ``shape``'s body (also update_precision.py's)."""
    cfg = LlamaConfig.from_pretrained(tokenizer_dir)
    for key, value in SHAPES[shape].items():
        setattr(cfg, key, value)
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tokenizer_dir")
    p.add_argument("out_dir")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    p.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    a = p.parse_args()
    start = time.time()
    cfg = shape_config(a.tokenizer_dir, a.shape)
    model_class: type = LlamaForCausalLM
    if a.arch == "qwen2":
        if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            raise SystemExit(f"--arch qwen2: shape {a.shape}'s head size is not hidden / heads")
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
        cfg = Qwen2Config(**{k: getattr(cfg, k) for k in keys if hasattr(cfg, k)})
        model_class = Qwen2ForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = model_class(cfg).to(torch.bfloat16)
    model.save_pretrained(a.out_dir)
    AutoTokenizer.from_pretrained(a.tokenizer_dir).save_pretrained(a.out_dir)
    n = sum(t.numel() for t in model.parameters())
    print(f"MODEL {a.shape} {a.arch} params={n / 1e6:.1f}M saved {a.out_dir} in {time.time() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
