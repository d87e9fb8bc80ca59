"""The preflight rules of a vision-language policy (Qwen3-VL; docs/multimodal.md), before any model loads.

A run whose ``model.name_or_path`` is a vision-language model (its ``config.json`` has a
``vision_config``) trains with images: the loop renders prompts with the model's image processor,
samples them with the transformers engine and feeds pixel values and image grids to the trainer.
What that path cannot do is refused here, each by name with what to change:

* ``model.sequence_packing=true``: Qwen3-VL places its multimodal rotary positions per input row;
* ``model.share_prompt_prefix=true``: the shared-prompt forward would lose the image positions
  (``auto`` simply runs every prompt with its completion for image batches);
* ``rollout.backend=vllm`` where torchvision is not installed: vLLM's Qwen3-VL processor needs it,
  and vLLM's CPU build removes it (on a GPU install vLLM gets the images, ``rollout/vllm_images.py``);
* ``grid.gpu_placement=disaggregated``: rollout replicas would sample text prompts;
* ``rollout.repetition_penalty != 1`` and ``rl.score_centering``: the image sampler has neither;
* ``rl.grpo_surrogate=legacy_pg`` (the spec: it cannot score multimodal inputs), ``model.lora``,
  ``model.compile``, ``model.use_chat_template=false`` (images are placed by the chat template),
  OPD with a vision-language student (multimodal OPD is a later step);
* a ``model_type`` other than ``qwen3_vl`` (the MoE variant comes with the MoE work) and a model
  directory without ``preprocessor_config.json``.

``model.freeze_vision_tower=true`` on a text model is refused too. The rows themselves (images per
row, pixels per image, readable images) are checked by ``check_vision_data`` in the data pass.
Nothing here imports torch.
"""

from __future__ import annotations

import importlib.util

from posttrain.config.schema import RunConfig
from posttrain.models.loading import local_model_dir
from posttrain.models.vision import VISION_MODEL_TYPES, vision_model_type
from posttrain.preflight.findings import Findings


def vision_policy_type(cfg: RunConfig) -> str | None:
    """The ``model_type`` of a vision-language ``model.name_or_path`` found on disk, else None."""
    model_dir = local_model_dir(cfg.model.name_or_path, cfg.model.revision)
    return None if model_dir is None else vision_model_type(model_dir)


def _refusals(cfg: RunConfig) -> list[str]:
    """What the image path cannot do, each with what to change."""
    model, ro, rl = cfg.model, cfg.rollout, cfg.rl
    teacher_mode = getattr(getattr(rl, "teacher", None), "input_mode", None)  # an OPD run's teacher input
    found = [
        (
            model.sequence_packing,
            "model.sequence_packing=true cannot pack image prompts: Qwen3-VL places its multimodal rotary "
            "positions per input row; set model.sequence_packing=false",
        ),
        (
            model.share_prompt_prefix is True,
            "model.share_prompt_prefix=true: the shared-prompt forward runs a prompt once and its completions "
            "against the prompt's cache with text positions, which loses the prompt's image positions; set "
            "model.share_prompt_prefix=auto or false",
        ),
        (
            ro.backend == "vllm" and importlib.util.find_spec("torchvision") is None,
            "rollout.backend=vllm cannot sample a vision-language policy here: vLLM's Qwen3-VL processor "
            "needs torchvision, which is not installed (vLLM's CPU build removes it); install the torchvision "
            "that matches torch, or set rollout.backend=hf",
        ),
        (
            cfg.grid.gpu_placement == "disaggregated",
            "grid.gpu_placement=disaggregated: rollout replicas sample text prompts only; use colocated",
        ),
        (
            ro.repetition_penalty != 1.0,
            f"rollout.repetition_penalty={ro.repetition_penalty}: the image sampler has no repetition "
            "penalty; set it to 1",
        ),
        (
            rl.score_centering.enabled,
            "rl.score_centering.enabled=true: the image sampler returns no top-k head; turn it off",
        ),
        (
            getattr(rl, "grpo_surrogate", "clipped") == "legacy_pg",
            "rl.grpo_surrogate=legacy_pg cannot score multimodal inputs; use rl.grpo_surrogate=clipped",
        ),
        (model.lora.enabled, "model.lora: adapters on a vision-language policy are not supported yet; unset it"),
        (
            ro.engines_per_device > 1,
            f"rollout.engines_per_device={ro.engines_per_device} splits text prompts only; set it to 1",
        ),
        (model.compile, "model.compile=true is not supported for vision-language policies yet; set it false"),
        (
            not model.use_chat_template,
            "model.use_chat_template=false: image markers are written by the chat template; set it true",
        ),
        (
            teacher_mode is not None and not str(teacher_mode).endswith("_multimodal"),
            f"rl.teacher.input_mode={teacher_mode} is a text mode: a "
            "vision-language student distills with rl.teacher.input_mode=shared_vocab_multimodal (same vocabulary, "
            "top-k) or cross_token_multimodal (DPCA)",
        ),
    ]
    return [message for hit, message in found if hit]


def check_vision_policy(cfg: RunConfig, out: Findings) -> None:
    """The rules above, for a vision-language ``model.name_or_path``; ``model.freeze_vision_tower``
    on a text model."""
    kind = vision_policy_type(cfg)
    head = f"model.name_or_path={cfg.model.name_or_path} is a vision-language model ({kind})"
    if kind is None:
        if cfg.model.freeze_vision_tower and local_model_dir(cfg.model.name_or_path, cfg.model.revision):
            out.errors.append(
                f"model.freeze_vision_tower=true, but model.name_or_path={cfg.model.name_or_path} is a text model "
                "(no vision_config in its config.json); unset it"
            )
        return
    if kind not in VISION_MODEL_TYPES:
        out.errors.append(f"{head}: posttrain trains {', '.join(sorted(VISION_MODEL_TYPES))} policies only")
        return
    model_dir = local_model_dir(cfg.model.name_or_path, cfg.model.revision)
    if model_dir is not None and not (model_dir / "preprocessor_config.json").is_file():
        out.errors.append(f"{head}, but {model_dir} holds no preprocessor_config.json (its image processor)")
    out.errors.extend(f"{head}: {message}" for message in _refusals(cfg))


def check_vision_data(cfg: RunConfig) -> list[str]:
    """The prompt source of a vision-language run: the knobs, then every row of a local source
    through the image row rules (``data/vision_source.py``); the arithmetic generator and a factory
    as for text runs (a factory runs user code and is checked when it is built)."""
    from posttrain.data.build import check_data_config, source_knob_problems
    from posttrain.data.vision_source import check_image_rows

    data = cfg.rl.data
    if data.kind in ("arithmetic", "factory"):
        return check_data_config(data)
    if problems := source_knob_problems(data):
        return problems
    return check_image_rows(cfg)
