"""The frozen OPD teacher on the scoring engine ``rl.teacher.backend`` names.

The teacher never receives weights: it is built once, from its own model directory, and scores the
student's realised completions (``teacher/scoring.py`` turns its scores into the training signal).
"""

from __future__ import annotations

import time

from posttrain.config.opd import OPDConfig
from posttrain.errors import ConfigError
from posttrain.metrics.sinks import MetricsLogger
from posttrain.models.loading import load_model_and_tokenizer, load_tokenizer, resolve_model_path
from posttrain.teacher.base import Teacher
from posttrain.teacher.hf_teacher import HFTeacher


def build_teacher(cfg: OPDConfig, log: MetricsLogger) -> Teacher:
    """The frozen teacher on the configured scoring engine."""
    t = cfg.rl.teacher
    if t.name_or_path is None:  # refused by the preflight; narrows the type
        raise ConfigError(["rl.teacher.name_or_path is required"])
    started = time.perf_counter()
    teacher: Teacher
    if t.backend == "vllm":
        from posttrain.teacher.vllm_teacher import VLLMTeacher

        teacher = VLLMTeacher(
            resolve_model_path(t.name_or_path),
            gpu_memory_utilization=t.gpu_memory_utilization,
            tensor_parallel_size=t.tensor_parallel_size,
            max_model_len=t.max_model_len,
            tokenizer=load_tokenizer(resolve_model_path(t.name_or_path)),
        )
    else:
        model, tokenizer = load_model_and_tokenizer(cfg.model.model_copy(update={"name_or_path": t.name_or_path}))
        teacher = HFTeacher(
            model,
            tokenizer,
            batch_size=t.batch_size,
            chunk_tokens=cfg.model.logprob_chunk_tokens,
            max_model_len=t.max_model_len,
        )
    log.info(
        f"teacher {t.name_or_path} ({t.backend}, {t.input_mode}/{t.signal_mode}) ready in "
        f"{time.perf_counter() - started:.1f}s"
    )
    return teacher
