"""The tiny vision-language teacher and student of the multimodal OPD demo (``recipes/vl_opd_direct.py``).

``python -m posttrain.models.vl_opd_demo [--out DIR] [--teacher-steps N]`` writes both (default
``$POSTTRAIN_CACHE/vl-opd-demo``, i.e. ``~/.cache/posttrain/vl-opd-demo``), and the recipe builds them
on first use when they are missing (a minute or two on a CPU, nothing downloaded):

* ``teacher``: a random Qwen3-VL (``models.tiny.make_tiny_vl_model`` with 4 text layers: the SmolLM2
  tokenizer plus the four vision tokens, the image-marker ChatML template, a Qwen2-VL image
  processor) trained on the shape-count task's question with the true count: images of 1 to 5
  coloured squares drawn here, answered ``"<k><|im_end|>"``. It need not count well; it has sharp,
  image-conditioned preferences, which is what a student can move toward.
* ``student``: the teacher cut to its first text layer (vision tower, merger, embeddings and head
  kept), so the two share the tokenizer, the image processor, the chat template and the
  placeholders: the identity ``rl.teacher.input_mode=shared_vocab_multimodal`` binds. Distillation
  restores what the dropped layers did, as the text demo's truncated SmolLM2 does
  (``models/opd_demo.py``).

Both are written to temporary siblings and renamed into place, so a half-written model is never used.
"""

from __future__ import annotations

import argparse
import io
import random
import shutil
import sys
from pathlib import Path
from typing import Any

from posttrain.models.embedded import default_cache_root
from posttrain.models.vl_demo import train_on_answers

TEACHER = "teacher"
STUDENT = "student"


def vl_opd_demo_dir() -> Path:
    """Where the demo pair lives by default."""
    return default_cache_root() / "vl-opd-demo"


def squares_png(rng: random.Random) -> tuple[bytes, int]:
    """A 64 x 64 white PNG with ``k`` (1-5) coloured squares on distinct cells of a 4 x 4 grid, and ``k``."""
    from PIL import Image, ImageDraw

    k = rng.randint(1, 5)
    img = Image.new("RGB", (64, 64), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for cell in rng.sample(range(16), k):
        x, y = (cell % 4) * 16 + 3, (cell // 4) * 16 + 3
        draw.rectangle((x, y, x + 9, y + 9), fill=tuple(rng.randrange(200) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), k


def train_on_counts(model_dir: str, steps: int, *, seed: int = 0, lr: float = 3e-3) -> Any:
    """The model of ``model_dir`` after ``steps`` teacher-forced true-count answers."""
    rng = random.Random(f"posttrain-vl-opd-demo:{seed}")

    def example() -> tuple[bytes, str]:
        png, k = squares_png(rng)
        return png, str(k)

    return train_on_answers(model_dir, steps, example, lr=lr)


def truncate_text_layers(model_dir: str, out: str, layers: int) -> str:
    """Save ``model_dir``'s Qwen3-VL with only its first ``layers`` text decoder layers into ``out``
    (with the tokenizer, template and image processor files copied unchanged)."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    text = model.model.language_model
    text.layers = text.layers[:layers]
    config = model.config.text_config
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    model.save_pretrained(out)
    for file in Path(model_dir).iterdir():  # everything but the weights and the model config
        if file.is_file() and file.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy2(file, Path(out) / file.name)
    return out


def make_vl_opd_demo(out: Path, *, teacher_steps: int = 300, text_layers: int = 4, seed: int = 0) -> Path:
    """Write ``out/teacher`` and ``out/student`` (replacing what is there); returns ``out``."""
    from posttrain.models.loading import resolve_model_path
    from posttrain.models.tiny import make_tiny_vl_model

    tokenizer_dir = resolve_model_path("embedded:smollm2-135m-instruct")
    out.mkdir(parents=True, exist_ok=True)
    teacher, student = out / TEACHER, out / STUDENT
    tmp_t, tmp_s = out / f"{TEACHER}.tmp", out / f"{STUDENT}.tmp"
    for tmp in (tmp_t, tmp_s):
        shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_vl_model(str(tmp_t), tokenizer_dir, num_layers=text_layers, seed=seed)
    if teacher_steps > 0:
        train_on_counts(str(tmp_t), teacher_steps, seed=seed).save_pretrained(tmp_t)
    truncate_text_layers(str(tmp_t), str(tmp_s), 1)
    for tmp, final in ((tmp_t, teacher), (tmp_s, student)):
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    return out


def ensure_vl_opd_demo(out: Path | None = None) -> Path:
    """The demo pair's directory, built first when either model is missing."""
    target = out or vl_opd_demo_dir()
    if not all((target / name / "config.json").is_file() for name in (TEACHER, STUDENT)):
        make_vl_opd_demo(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.models.vl_opd_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(vl_opd_demo_dir()), help="output directory (default %(default)s)")
    parser.add_argument("--teacher-steps", type=int, default=300, help="teacher training steps (default %(default)s)")
    args = parser.parse_args(argv)
    print(f"wrote {make_vl_opd_demo(Path(args.out).expanduser(), teacher_steps=args.teacher_steps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
