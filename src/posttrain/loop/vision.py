"""A run's vision-language policy (Qwen3-VL): whether it has one, and the pieces the loop adds for it.

``vision_run(cfg)`` asks the policy's ``config.json`` (``models.vision.vision_model_type``); the
loop then reads image rows (``build_data_source(images=True)``), freezes the vision tower when
``model.freeze_vision_tower`` says so (before the optimizer and any engine copy exist), and samples
through an ``ImagePromptSampler`` (``rollout/vl_sampling.py``), which ``loop/collect.py`` uses to
render prompts with their images and to put the pixel values and grids into the ``TrainBatch``.
The trainer's forwards take them through ``policy/images.py``. docs/multimodal.md.
"""

from __future__ import annotations

from typing import Any

from posttrain.config.schema import RunConfig
from posttrain.metrics.sinks import MetricsLogger
from posttrain.models.hub import is_hub_id
from posttrain.models.loading import local_model_dir, resolve_model_path
from posttrain.models.vision import VisionProcessor, vision_model_type
from posttrain.policy.images import freeze_vision_tower
from posttrain.rollout.vl_sampling import ImagePromptSampler


def vision_run(cfg: RunConfig) -> bool:
    """Whether ``model.name_or_path`` is a vision-language model. Asked before the data source is
    built, so it converts nothing: the embedded models are text models, and a directory on disk
    (a cached hub snapshot included) is read as it is; only a hub id not in the cache is resolved
    (downloaded) here rather than a moment later by the model loader. A local path that does not
    exist is not a vision model here: the loader refuses it after the data checks."""
    name, revision = cfg.model.name_or_path, cfg.model.revision
    if name.startswith("embedded:"):
        return False
    local = local_model_dir(name, revision)
    if local is None and not is_hub_id(name):
        # a path that does not exist: the model loader names it, after the data checks have run
        return False
    return vision_model_type(local if local is not None else resolve_model_path(name, revision)) is not None


def prepare_vision_policy(cfg: RunConfig, model: Any, tokenizer: Any, log: MetricsLogger) -> ImagePromptSampler:
    """Freeze the tower if asked (``model.freeze_vision_tower``) and build the policy's image sampler."""
    path = resolve_model_path(cfg.model.name_or_path, cfg.model.revision)
    if cfg.model.freeze_vision_tower:
        frozen = freeze_vision_tower(model)
        log.info(f"model.freeze_vision_tower: {frozen / 1e6:.2f}M vision-tower parameters frozen")
    return ImagePromptSampler(VisionProcessor.from_dir(path, tokenizer), cfg.model.chat_template_kwargs)
