"""Local student models for the OPD demo recipes, derived from the embedded SmolLM2 (no download).

``python -m posttrain.models.opd_demo [--out DIR] [--layers N]`` writes two students next to each
other (default ``$POSTTRAIN_CACHE/opd-demo``, i.e. ``~/.cache/posttrain/opd-demo``):

* ``student-same-vocab``: SmolLM2-135M-Instruct keeping its first N decoder layers (default 6 of
  30). Same tokenizer as the full model, so the full model is its same-vocabulary teacher
  (``recipes/opd_direct.py``): distillation restores what the dropped layers did.
* ``student-other-vocab``: the same truncated body with a *different* tokenizer, a byte-level BPE
  trained here on arithmetic prompts and answers (vocabulary ~2k). Its embeddings are initialised
  as the mean of SmolLM2's embeddings of each new token's text, so it starts out roughly sensible.
  Its tokenizer differs from the teacher's, which is what ``recipes/opd_dpca.py`` (cross-token
  DPCA) needs.

Both are written to a temporary sibling and renamed into place, so a half-written student is
never used.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
from pathlib import Path
from typing import Any

from posttrain.models.embedded import default_cache_root

SAME_VOCAB = "student-same-vocab"
OTHER_VOCAB = "student-other-vocab"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def demo_dir() -> Path:
    """Where the demo students live by default."""
    return default_cache_root() / "opd-demo"


def _corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Arithmetic questions and answers, the text the demo's students read and write."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        op = rng.choice(["+", "-", "*"])
        value = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"What is {a} {op} {b}? Reply with only the number.")
        lines.append(f"{a} {op} {b} = {value}. The answer is {value}.")
    return lines


def _truncate(model: Any, layers: int) -> Any:
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return model


def _bpe_tokenizer(teacher_tok: Any, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    fast.chat_template = teacher_tok.chat_template
    return fast


def _transfer_embeddings(model: Any, teacher_tok: Any, new_tok: Any) -> None:
    """New embedding rows = mean of the old embeddings of each new token's text (tied head too)."""
    import torch

    old = model.get_input_embeddings().weight.detach()
    rows = torch.empty(len(new_tok), old.shape[1], dtype=old.dtype)
    for token_id in range(len(new_tok)):
        text = new_tok.decode([token_id])
        pieces = teacher_tok(text, add_special_tokens=False)["input_ids"] or [teacher_tok.eos_token_id]
        rows[token_id] = old[pieces].mean(dim=0)
    model.resize_token_embeddings(len(new_tok))
    model.get_input_embeddings().weight.data.copy_(rows)
    model.config.vocab_size = len(new_tok)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, key, getattr(new_tok, key))
        setattr(model.generation_config, key, getattr(new_tok, key))


def _write(target: Path, model: Any, tokenizer: Any) -> None:
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def make_demo_students(out: Path, layers: int = 6, vocab_size: int = 2048) -> list[Path]:
    """Write both students into ``out``; returns their directories."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models.loading import resolve_model_path

    teacher_dir = resolve_model_path("embedded:smollm2-135m-instruct")
    teacher_tok = AutoTokenizer.from_pretrained(teacher_dir, local_files_only=True)
    out.mkdir(parents=True, exist_ok=True)
    same = _truncate(AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32), layers)
    _write(out / SAME_VOCAB, same, teacher_tok)
    other = _truncate(AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32), layers)
    new_tok = _bpe_tokenizer(teacher_tok, vocab_size)
    _transfer_embeddings(other, teacher_tok, new_tok)
    _write(out / OTHER_VOCAB, other, new_tok)
    return [out / SAME_VOCAB, out / OTHER_VOCAB]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.models.opd_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(demo_dir()), help="output directory (default %(default)s)")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers kept (default %(default)s)")
    args = parser.parse_args(argv)
    for path in make_demo_students(Path(args.out).expanduser(), layers=args.layers):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
