"""The preflight rules of multimodal OPD (``rl.teacher.input_mode=*_multimodal``), before any model loads.

Both modes need a vision-language student and teacher (Qwen3-VL directories with their image
processors), the transformers teacher in this process (the vLLM teacher and the Ray teacher pool do
not carry images yet) and the teacher's chat template (it writes the image markers).
``shared_vocab_multimodal`` also binds the teacher's media identity to the student's
(``config/opd_media.py``): tokenizer, image processor, chat template and placeholder ids must be
equal, each difference named with the mode to use instead. A vision-language student with a text
input mode is refused by ``preflight/vision.py``. Nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.config.opd import OPDConfig
from posttrain.config.opd_media import BOUND_FIELDS, media_identity
from posttrain.models.loading import local_model_dir
from posttrain.models.vision import vision_model_type

_WHAT = {
    "tokenizer": "tokenizer (tokenizer.json vocabulary, merges and added tokens)",
    "processor": "image processor (preprocessor_config.json: resize bounds, patch and merge sizes, normalisation)",
    "chat_template": "chat template",
    "placeholders": "image placeholder ids (<|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>)",
}


def _bind_problems(mode: str, student: Path, teacher: Path) -> list[str]:
    """``shared_vocab_multimodal``: every bound field of the two directories' media identities equal."""
    mine, theirs = media_identity(student) or {}, media_identity(teacher) or {}
    return [
        f"{mode} binds the teacher's {_WHAT[f]} to the student's, but {teacher} and {student} differ; give both "
        "roles the same one, or use rl.teacher.input_mode=cross_token_multimodal with signal_mode=dpca"
        for f in BOUND_FIELDS
        if mine.get(f) != theirs.get(f)
    ]


def media_problems(cfg: OPDConfig) -> list[str]:
    """Every rule above for a multimodal input mode; nothing for the text modes."""
    t = cfg.rl.teacher
    if not t.input_mode.endswith("_multimodal"):
        return []
    mode = f"rl.teacher.input_mode={t.input_mode}"
    problems = []
    if t.backend != "hf":
        problems.append(
            f"{mode} with rl.teacher.backend={t.backend}: the vLLM teacher does not take images yet (posttrain "
            "sends it no multimodal requests); use rl.teacher.backend=hf"
        )
    if cfg.grid.backend != "local":
        problems.append(
            f"{mode} with grid.backend={cfg.grid.backend}: the Ray teacher pool does not carry images yet; use "
            "grid.backend=local (an in-process teacher per policy rank)"
        )
    if not t.use_chat_template:
        problems.append(
            f"{mode} with rl.teacher.use_chat_template=false: the teacher's chat template writes the "
            "image markers; set it true"
        )
    student = local_model_dir(cfg.model.name_or_path, cfg.model.revision)
    if student is not None and vision_model_type(student) is None:
        text = t.input_mode.replace("_multimodal", "").replace("cross_token", "cross_token_text")
        problems.append(
            f"{mode} needs a vision-language student, but model.name_or_path={cfg.model.name_or_path} is a text "
            f"model (no vision_config in its config.json); use rl.teacher.input_mode={text}"
        )
    teacher = local_model_dir(t.name_or_path, t.revision) if t.name_or_path else None
    if teacher is None:
        return problems
    if vision_model_type(teacher) is None:
        problems.append(
            f"{mode} needs a vision-language teacher, but rl.teacher.name_or_path={t.name_or_path} is a text model "
            "(no vision_config in its config.json)"
        )
    elif not (teacher / "preprocessor_config.json").is_file():
        problems.append(
            f"{mode}: the teacher directory {teacher} holds no preprocessor_config.json (its image processor)"
        )
    elif t.input_mode == "shared_vocab_multimodal" and student is not None and vision_model_type(student) is not None:
        problems.extend(_bind_problems(mode, student, teacher))
    return problems
