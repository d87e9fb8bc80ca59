"""The tiny vision-language policy of the multimodal GRPO demo (``recipes/vl_grpo.py``), built locally.

``python -m posttrain.models.vl_demo [--out DIR] [--warmup-steps N]`` writes it, and the recipe
builds it on first use when it is missing (default ``$POSTTRAIN_CACHE/vl-demo/tiny-qwen3-vl``, i.e.
``~/.cache/posttrain/vl-demo/tiny-qwen3-vl``; a few seconds on a CPU, nothing downloaded):

1. a random Qwen3-VL (``models.tiny.make_tiny_vl_model``: hidden size 64, 2 text layers, a 2-block
   vision tower) with the embedded SmolLM2's tokenizer plus the four vision tokens and a ChatML
   template that writes image markers;
2. a short supervised warm-up on the answer format: the shape-count question beside a plain
   coloured image, answered ``"<k><|im_end|>"`` with ``k`` drawn uniformly from 1..5. A random model
   never writes a digit, so every reward would be 0 and GRPO would have nothing to learn from; after
   the warm-up it answers with a number, right about one time in five, and the groups mix right and
   wrong answers from the first step. The images carry no count, so the warm-up teaches the format
   only: counting is left to GRPO.

Written to a temporary sibling and renamed into place, so a half-written model is never used.
"""

from __future__ import annotations

import argparse
import io
import random
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.models.embedded import default_cache_root

TINY_VL = "tiny-qwen3-vl"
QUESTION = "How many squares are in the image? Reply with only the number."
"""The shape-count task's question (``posttrain.data.visual.QUESTION``, which this layer cannot import)."""


def vl_demo_dir() -> Path:
    """Where the demo policy lives by default."""
    return default_cache_root() / "vl-demo" / TINY_VL


def _png(rng: random.Random) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), tuple(rng.randrange(256) for _ in range(3))).save(buf, format="PNG")
    return buf.getvalue()


def train_on_answers(model_dir: str, steps: int, example: Callable[[], tuple[bytes, str]], *, lr: float) -> Any:
    """The Qwen3-VL of ``model_dir`` after ``steps`` teacher-forced answers, one a step: ``example()``
    gives a PNG and the answer to ``QUESTION`` about it; the loss is on ``"<answer><|im_end|>"`` only.
    Shared by this demo's format warm-up and the OPD demo's teacher (``models/vl_opd_demo.py``)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from posttrain.models.vision import VisionProcessor

    processor = VisionProcessor.from_dir(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        png, answer_text = example()
        content = [{"type": "image", "image": png}, {"type": "text", "text": QUESTION}]
        prompt = processor.render([{"role": "user", "content": content}])
        answer = processor.tokenizer(f"{answer_text}<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt.input_ids + answer])
        labels = ids.clone()
        labels[0, : len(prompt.input_ids)] = -100  # the loss is on the answer only
        out = model(
            input_ids=ids,
            labels=labels,
            pixel_values=prompt.pixel_values_P,
            image_grid_thw=prompt.image_grid_thw_I3,
            mm_token_type_ids=(ids == processor.image_pad_id).int(),
        )
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return model


def warm_up(model_dir: str, steps: int, *, seed: int = 0, lr: float = 3e-3) -> Any:
    """The model of ``model_dir`` after ``steps`` answers in the task's format, each a count drawn
    uniformly from 1..5 beside a plain coloured image (see the module docstring)."""
    rng = random.Random(f"posttrain-vl-demo:{seed}")
    return train_on_answers(model_dir, steps, lambda: (_png(rng), str(rng.randint(1, 5))), lr=lr)


def make_vl_demo(out: Path, *, warmup_steps: int = 150) -> Path:
    """Write the demo policy into ``out`` (replacing what is there); returns ``out``."""
    from posttrain.models.loading import resolve_model_path
    from posttrain.models.tiny import make_tiny_vl_model

    tokenizer_dir = resolve_model_path("embedded:smollm2-135m-instruct")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_vl_model(str(tmp), tokenizer_dir)
    if warmup_steps > 0:
        warm_up(str(tmp), warmup_steps).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def ensure_vl_demo(out: Path | None = None) -> Path:
    """The demo policy's directory, built first when it is missing."""
    target = out or vl_demo_dir()
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        make_vl_demo(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.models.vl_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(vl_demo_dir()), help="output directory (default %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=150, help="answer-format steps (default %(default)s)")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"wrote {make_vl_demo(out, warmup_steps=args.warmup_steps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
