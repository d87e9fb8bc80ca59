"""The preflight rule for vision-language policies (docs/multimodal.md).

The image data, the transformers engine's image sampler and the trainer's image forward exist, but
the loop renders every prompt as text and loads the policy as a causal LM, so a run whose
``model.name_or_path`` is a vision-language model (its ``config.json`` has a ``vision_config``,
Qwen3-VL) would fail in transformers' loader with an unrelated message. It is refused here, by name.
"""

from __future__ import annotations

import json

from posttrain.config.schema import RunConfig
from posttrain.models.loading import local_model_dir
from posttrain.preflight.findings import Findings


def check_vision_policy(cfg: RunConfig, out: Findings) -> None:
    """Refuse a vision-language ``model.name_or_path`` until the run path takes images."""
    model_dir = local_model_dir(cfg.model.name_or_path, cfg.model.revision)
    if model_dir is None or not (model_dir / "config.json").is_file():
        return  # check_model_path reports a missing model
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # check_model_path reports an unreadable config
    if isinstance(config, dict) and isinstance(config.get("vision_config"), dict):
        out.errors.append(
            f"model.name_or_path={cfg.model.name_or_path} is a vision-language model "
            f"({config.get('model_type', 'with a vision_config')}): a run does not take vision-language policies "
            "yet (the loop renders prompts as text; see docs/multimodal.md); use a text model"
        )
