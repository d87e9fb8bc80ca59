"""Rows with images (every accepted format, order, limits, named errors) and the built-in shape-count task."""

from __future__ import annotations

import io
from collections import deque
from pathlib import Path

import pytest
from PIL import Image

from posttrain.data.images import (
    ImageLimits,
    has_images,
    image_bytes,
    image_row_to_sample,
    normalize_prompt,
    prompt_images,
)
from posttrain.data.visual import QUESTION, ShapeCountSource, shape_count_rows, write_dataset
from posttrain.errors import DataError
from posttrain.rewards.base import RewardInput
from posttrain.rewards.registry import get_reward


def _png(colour: tuple[int, int, int], size: tuple[int, int] = (8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


RED, GREEN, BLUE = _png((255, 0, 0)), _png((0, 255, 0)), _png((0, 0, 255))


def _colour(data: bytes) -> tuple[int, ...]:
    with Image.open(io.BytesIO(data)) as img:
        return tuple(img.convert("RGB").getpixel((0, 0)))


def test_image_values_of_every_format(tmp_path: Path) -> None:
    (tmp_path / "red.png").write_bytes(RED)
    pil = Image.new("RGB", (4, 4), (0, 0, 255))
    assert image_bytes(RED, "w") == RED
    assert image_bytes(bytearray(RED), "w") == RED
    assert image_bytes(str(tmp_path / "red.png"), "w") == RED
    assert image_bytes("red.png", "w", base_dir=str(tmp_path)) == RED
    assert image_bytes({"bytes": GREEN, "path": None}, "w") == GREEN  # datasets Image, decode=False
    assert image_bytes({"bytes": None, "path": str(tmp_path / "red.png")}, "w") == RED
    assert _colour(image_bytes(pil, "w")) == (0, 0, 255)  # a decoded datasets Image cell


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("https://example.com/a.png", "is a URL; posttrain reads local files and bytes only"),
        ("/no/such/file.png", "cannot read image file '/no/such/file.png'"),
        ({"path": None}, "image object has neither 'bytes' nor 'path'"),
        (12, "an image must be a file path, raw bytes, a datasets Image value or a PIL image, got int"),
    ],
)
def test_bad_image_values_are_named(value: object, message: str) -> None:
    with pytest.raises(DataError, match=r"rows\.jsonl line 3") as info:
        image_bytes(value, "rows.jsonl line 3")
    assert message in str(info.value)


def test_parts_in_messages_keep_their_order() -> None:
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": GREEN}, {"type": "text", "text": "and"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image", "image": RED}, {"type": "image", "image": BLUE}]},
    ]
    messages = normalize_prompt(prompt, where="f line 1")
    assert prompt_images(messages) == [GREEN, RED, BLUE]
    assert messages[0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert messages[1]["content"][1] == {"type": "text", "text": "and"}
    assert has_images(messages) and not has_images("text") and not has_images([{"role": "user", "content": "x"}])


def test_separate_column_fills_placeholders_in_order() -> None:
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "vs"}, {"type": "image"}]}]
    messages = normalize_prompt(prompt, where="w", images=[BLUE, RED])
    assert [p["type"] for p in messages[0]["content"]] == ["image", "text", "image"]
    assert prompt_images(messages) == [BLUE, RED]


def test_separate_column_without_placeholders_goes_before_the_first_user_text() -> None:
    messages = normalize_prompt("Which colour?", where="w", images=[RED, GREEN])
    assert messages == [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": RED},
                {"type": "image", "image": GREEN},
                {"type": "text", "text": "Which colour?"},
            ],
        }
    ]
    single = normalize_prompt(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], where="w", images=BLUE
    )
    assert single[1]["content"][0] == {"type": "image", "image": BLUE}


@pytest.mark.parametrize(
    ("prompt", "images", "message"),
    [
        (
            [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
            [RED],
            "column 'prompt' has 2 image placeholder(s) but column 'images' holds 1 image(s)",
        ),
        (
            [{"role": "user", "content": [{"type": "image", "image": RED}]}],
            [GREEN],
            "images both in column 'prompt' and in column 'images'",
        ),
        (
            [{"role": "user", "content": [{"type": "image"}]}],
            None,
            "1 image placeholder(s) without an image and no images in column 'images'",
        ),
        (
            [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}],
            None,
            "message 0 part 0 is a video; posttrain takes images only",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            None,
            "message 0 part 0 must be {'type': 'text', 'text': str} or {'type': 'image', ...}",
        ),
        ([{"role": "system", "content": "s"}], [RED], "has no user message to attach the images of 'images' to"),
        ([{"role": "user", "content": [{"type": "image", "image": b"not a png"}]}], None, "image 0: not an image"),
    ],
)
def test_malformed_image_rows_are_named(prompt: object, images: object, message: str) -> None:
    with pytest.raises(DataError, match=r"data\.jsonl line 7") as info:
        normalize_prompt(prompt, where="data.jsonl line 7", images=images)
    assert message in str(info.value)


def test_limits_count_and_pixels_per_row() -> None:
    limits = ImageLimits(max_images=2, max_pixels=100)
    with pytest.raises(DataError, match=r"sample 4: 3 images, more than the limit of 2 per row"):
        normalize_prompt("q", where="sample 4", images=[RED, RED, RED], limits=limits)
    big = _png((0, 0, 0), (20, 10))
    with pytest.raises(DataError, match=r"sample 4: image 1: 20x10 = 200 pixels, more than the limit of 100"):
        normalize_prompt("q", where="sample 4", images=[RED, big], limits=limits)
    assert len(prompt_images(normalize_prompt("q", where="s", images=[RED, RED], limits=limits))) == 2


def test_row_to_sample_keeps_other_columns(tmp_path: Path) -> None:
    (tmp_path / "g.png").write_bytes(GREEN)
    row = {"prompt": "colour?", "images": ["g.png"], "answer": "green", "source": "unit"}
    sample = image_row_to_sample(row, where="f line 2", uid="f:2", response_column="answer", base_dir=str(tmp_path))
    assert sample.ground_truth == "green" and sample.uid == "f:2"
    assert sample.metadata == {"answer": "green", "source": "unit"}
    assert isinstance(sample.prompt, list) and prompt_images(sample.prompt) == [GREEN]
    with pytest.raises(DataError, match="f line 2: no value in column 'answer'"):
        image_row_to_sample({"prompt": "q"}, where="f line 2", uid="u", response_column="answer")


def test_datasets_image_column(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    for name, data in (("r.png", RED), ("b.png", BLUE)):
        (tmp_path / name).write_bytes(data)
    table = datasets.Dataset.from_dict(
        {"prompt": ["first", "second"], "images": [[str(tmp_path / "r.png"), str(tmp_path / "b.png")], []]}
    )
    for decode in (True, False):  # decoded: PIL images; decode=False: {"bytes", "path"} cells
        cast = table.cast_column("images", datasets.Sequence(datasets.Image(decode=decode)))
        samples = [image_row_to_sample(row, where=f"dataset row {i}", uid=str(i)) for i, row in enumerate(cast)]
        first = prompt_images(samples[0].prompt)  # type: ignore[arg-type]
        assert [_colour(b) for b in first] == [(255, 0, 0), (0, 0, 255)]
        assert prompt_images(samples[1].prompt) == []  # type: ignore[arg-type]


def _count_squares(data: bytes) -> int:
    """Connected components of non-white pixels (4-neighbourhood), an independent count of the shapes."""
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
        w, h = rgb.size
        ink = {(x, y) for x in range(w) for y in range(h) if rgb.getpixel((x, y)) != (255, 255, 255)}
    components = 0
    while ink:
        components += 1
        todo = deque([ink.pop()])
        while todo:
            x, y = todo.popleft()
            for nb in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if nb in ink:
                    ink.remove(nb)
                    todo.append(nb)
    return components


def test_shape_count_task_is_seeded_and_exact() -> None:
    source = ShapeCountSource(seed=3)
    batch = source.next_batch(12)
    again = ShapeCountSource(seed=3).next_batch(12)
    assert [s.prompt for s in batch] == [s.prompt for s in again]
    assert [s.prompt for s in batch] != [s.prompt for s in ShapeCountSource(seed=4).next_batch(12)]
    counts = [s.ground_truth for s in batch]
    assert set(counts) <= {1, 2, 3, 4, 5} and len(set(counts)) > 1
    for sample in batch:
        assert isinstance(sample.prompt, list)
        (image,) = prompt_images(sample.prompt)
        assert _count_squares(image) == sample.ground_truth
        assert sample.prompt[0]["content"][1] == {"type": "text", "text": QUESTION}
    reward = get_reward("arithmetic")
    truth = batch[0].ground_truth
    assert reward(RewardInput(prompt=batch[0].prompt, completion=f"{truth}", ground_truth=truth)) == 1.0
    assert reward(RewardInput(prompt=batch[0].prompt, completion=f"{truth + 1}", ground_truth=truth)) == 0.0


def test_shape_count_cursor_resumes_exactly() -> None:
    source = ShapeCountSource(seed=1)
    source.next_batch(5)
    resumed = ShapeCountSource(seed=1)
    resumed.load_state_dict(source.state_dict())
    assert [s.uid for s in resumed.next_batch(3)] == ["shapes:5", "shapes:6", "shapes:7"]
    with pytest.raises(DataError, match="saved with data seed 1 but this run uses 2"):
        ShapeCountSource(seed=2).load_state_dict(source.state_dict())
    with pytest.raises(DataError, match="1 <= min_count <= max_count <= 16"):
        ShapeCountSource(min_count=3, max_count=2)
    assert [s.uid for s in shape_count_rows(seed=0, rows=2)] == ["shapes:0", "shapes:1"]


def test_written_dataset_reads_back_through_paths(tmp_path: Path) -> None:
    import json

    path = write_dataset(str(tmp_path / "out"), rows=3, seed=0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    originals = shape_count_rows(seed=0, rows=3)
    for i, (row, original) in enumerate(zip(rows, originals, strict=True)):
        sample = image_row_to_sample(
            row, where=f"{path} line {i + 1}", uid=str(i), prompt_column="messages", response_column="answer"
        )
        assert sample.prompt == original.prompt and sample.ground_truth == original.ground_truth


def test_a_text_run_refuses_image_rows_by_row() -> None:
    from posttrain.data.factory import FactorySource

    with pytest.raises(DataError, match=r"shape_count_rows row 0: column 'prompt' message 0 content must be a string"):
        FactorySource("posttrain.data.visual:shape_count_rows", prompt_column="prompt", response_column="answer")
