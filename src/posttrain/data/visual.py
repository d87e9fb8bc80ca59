"""The built-in visual task: count the squares in a rendered image (a multimodal run needs no external data).

Sample ``i`` of seed ``s`` is drawn from an RNG seeded with ``(s, i)`` alone, like the arithmetic
generator: a white ``size`` x ``size`` canvas with between ``min_count`` and ``max_count`` filled
squares of random colours on distinct cells of a 4 x 4 grid (so they never touch or overlap), PNG
encoded. The prompt is one user message, the image part then the question; the ground truth is the
count, scored by the ``arithmetic`` reward (the last number of the completion equals it exactly).

Two ways to use it: ``ShapeCountSource`` (an endless stream with a cursor), or the factory
``posttrain.data.visual:shape_count_rows`` (a fixed list of samples, ``rl.data.factory``), or
``python -m posttrain.data.visual OUT_DIR [--rows N] [--seed S]``, which writes the images as PNG
files and ``OUT_DIR/shapes.jsonl`` rows that name them by path (the spec's image-row format).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
from pathlib import Path

from posttrain.data.base import PromptSample, SeededStream
from posttrain.errors import DataError

QUESTION = "How many squares are in the image? Reply with only the number."
GRID = 4
"""Cells per side: a square fills the middle of one cell, so squares never overlap or touch."""


def render_squares(rng: random.Random, count: int, size: int) -> bytes:
    """PNG bytes of ``count`` coloured squares on distinct grid cells of a white ``size``-pixel canvas."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    cell = size // GRID
    side = max(2, cell * 2 // 3)
    for index in rng.sample(range(GRID * GRID), count):
        row, col = divmod(index, GRID)
        x0 = col * cell + (cell - side) // 2
        y0 = row * cell + (cell - side) // 2
        colour = tuple(rng.randrange(0, 200) for _ in range(3))  # never near the white background
        draw.rectangle((x0, y0, x0 + side - 1, y0 + side - 1), fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


class ShapeCountSource(SeededStream):
    """Endless "how many squares?" prompts whose ground truth is the count (see the module docstring)."""

    cursor_name = "shape-count"

    def __init__(self, seed: int = 0, *, min_count: int = 1, max_count: int = 5, size: int = 64) -> None:
        if not 1 <= min_count <= max_count <= GRID * GRID:
            raise DataError(
                f"shape counts must satisfy 1 <= min_count <= max_count <= {GRID * GRID}, got {min_count}..{max_count}"
            )
        if size < 2 * GRID:
            raise DataError(f"image size {size} is too small for a {GRID}x{GRID} grid; use at least {2 * GRID}")
        self.seed = seed
        self.min_count = min_count
        self.max_count = max_count
        self.size = size

    def sample(self, index: int) -> PromptSample:
        """Sample ``index`` of this seed's stream (independent of the cursor)."""
        rng = random.Random(f"posttrain-shapes:{self.seed}:{index}")
        count = rng.randint(self.min_count, self.max_count)
        image = render_squares(rng, count, self.size)
        content = [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]
        return PromptSample(
            prompt=[{"role": "user", "content": content}],
            ground_truth=count,
            uid=f"shapes:{index}",
            metadata={"count": count},
        )


def shape_count_rows(seed: int = 0, rows: int = 256) -> list[PromptSample]:
    """The first ``rows`` samples of ``ShapeCountSource(seed)`` (a prompt factory)."""
    return ShapeCountSource(seed).next_batch(rows)


def write_dataset(out_dir: str, *, rows: int, seed: int) -> Path:
    """Write ``rows`` PNG files and ``shapes.jsonl`` naming them by absolute path; returns the JSONL path."""
    out = Path(out_dir).resolve()
    (out / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for sample in shape_count_rows(seed, rows):
        assert isinstance(sample.prompt, list)
        image_path = out / "images" / f"{sample.uid.replace(':', '_')}.png"
        image_path.write_bytes(sample.prompt[0]["content"][0]["image"])
        content = [{"type": "image", "image": str(image_path)}, {"type": "text", "text": QUESTION}]
        lines.append(json.dumps({"messages": [{"role": "user", "content": content}], "answer": sample.ground_truth}))
    path = out / "shapes.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.data.visual", description="Write shape-count rows.")
    parser.add_argument("out_dir")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_dataset(args.out_dir, rows=args.rows, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
