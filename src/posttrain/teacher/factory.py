"""The frozen OPD teacher on the scoring engine ``rl.teacher.backend`` names.

The teacher never receives weights: it is built once, from its own model directory, and scores the
student's realised completions (``teacher/scoring.py`` turns its scores into the training signal).
Under ``grid.backend=ray`` it is a role of its own (``teacher/pool.py``) and a policy rank holds a
proxy to it (``teacher/remote.py``).
"""

from __future__ import annotations

import time
from typing import Any

from posttrain.config.opd import OPDConfig
from posttrain.errors import ConfigError
from posttrain.metrics.sinks import MetricsLogger
from posttrain.models.loading import load_model_and_tokenizer, load_tokenizer, resolve_device, resolve_model_path
from posttrain.models.precision import resolve_precision
from posttrain.teacher.base import Teacher
from posttrain.teacher.hf_teacher import HFTeacher

TEACHER_KEY = "rl.teacher.name_or_path"


def build_teacher(cfg: OPDConfig, log: MetricsLogger) -> Teacher:
    """The frozen teacher: under ``grid.backend=ray`` a proxy to the teacher pool (``teacher/remote.py``;
    the pool's actors hold the scorers), else the scorer itself, in this process."""
    t = cfg.rl.teacher
    if cfg.grid.backend == "ray":
        from posttrain.teacher.remote import teacher_proxy

        return teacher_proxy(cfg, log)
    started = time.perf_counter()
    teacher = build_scorer(cfg)
    log.info(
        f"teacher {t.name_or_path} ({t.backend}, {t.input_mode}/{t.signal_mode}) ready in "
        f"{time.perf_counter() - started:.1f}s"
    )
    return teacher


def build_scorer(cfg: OPDConfig, **vllm_args: Any) -> Teacher:
    """The frozen scorer on the configured engine, in this process (a policy rank under
    ``grid.backend=local``, a teacher lane under Ray). ``vllm_args``: extra engine arguments of a
    tensor-parallel lane (``teacher/pool.py``)."""
    t = cfg.rl.teacher
    if t.name_or_path is None:  # refused by the preflight; narrows the type
        raise ConfigError(["rl.teacher.name_or_path is required"])
    # The frozen teacher keeps no master weights: it loads and scores in the policy's compute dtype
    # (bf16 under mixed precision on a GPU; fp32 on a CPU, as before).
    m = cfg.model
    compute = resolve_precision(m.dtype, m.compute_dtype, resolve_device(m.device)).compute_name
    teacher: Teacher
    if t.backend == "vllm":
        from posttrain.teacher.vllm_teacher import VLLMTeacher

        path = resolve_model_path(t.name_or_path, t.revision, key=TEACHER_KEY)  # one resolution, one snapshot
        teacher = VLLMTeacher(
            path,
            gpu_memory_utilization=t.gpu_memory_utilization,
            tensor_parallel_size=t.tensor_parallel_size,
            max_model_len=t.max_model_len,
            tokenizer=load_tokenizer(path),
            dtype=compute,
            moe_backend=t.moe_backend,
            engine_args=vllm_args,
        )
    else:
        # The teacher's own revision, never the student's model.revision that model_copy would keep.
        update = {"name_or_path": t.name_or_path, "revision": t.revision, "dtype": compute, "compute_dtype": "auto"}
        teacher_cfg = cfg.model.model_copy(update=update)
        model, tokenizer = load_model_and_tokenizer(teacher_cfg, key=TEACHER_KEY)
        if t.input_mode.endswith("_multimodal"):  # a vision-language teacher with its own processor
            return _vision_teacher(cfg, model, tokenizer)
        teacher = HFTeacher(
            model,
            tokenizer,
            batch_size=t.batch_size,
            chunk_tokens=cfg.model.logprob_chunk_tokens,
            max_model_len=t.max_model_len,
        )
    return teacher


def _vision_teacher(cfg: OPDConfig, model: Any, tokenizer: Any) -> Teacher:
    """The ``*_multimodal`` modes' transformers scorer: the teacher's model with its own processor
    (``preprocessor_config.json`` of its directory; ``teacher/hf_vision_teacher.py``)."""
    from posttrain.models.vision import VisionProcessor
    from posttrain.teacher.hf_vision_teacher import HFVisionTeacher

    t = cfg.rl.teacher
    path = resolve_model_path(str(t.name_or_path), t.revision, key=TEACHER_KEY)
    return HFVisionTeacher(
        model,
        VisionProcessor.from_dir(path, tokenizer),
        batch_size=t.batch_size,
        chunk_tokens=cfg.model.logprob_chunk_tokens,
        max_model_len=t.max_model_len,
    )
