"""The OPD preflight: the shared model-free checks plus the teacher and distillation rules, all
before any model loads (and under ``--validate-manifest``), and ``check_shared_vocabulary``, which
the OPD loop runs before the models load (it reads both tokenizers).

OPD has none of GRPO's own knobs, so there is nothing here to refuse them: setting one is an unknown
key (its message says why: ``OPDConfig.unknown_key_hints``). Importing this module imports no torch.
"""

from __future__ import annotations

import os

from posttrain.config.opd import OPDConfig
from posttrain.errors import ConfigError
from posttrain.preflight.common import check_shared_objective, run_checks
from posttrain.preflight.findings import Findings
from posttrain.preflight.opd_media import media_problems
from posttrain.preflight.paths import check_model_path


def _cross_mode(input_mode: str) -> str:
    """The cross-tokenizer input mode of the same modality as ``input_mode``."""
    return "cross_token_multimodal" if input_mode.endswith("_multimodal") else "cross_token_text"


def _neutral_sampling_problems(cfg: OPDConfig, why: str) -> list[str]:
    """Advantage mode scores realized tokens by their likelihood, so sampling must be unwarped."""
    ro, rl = cfg.rollout, cfg.rl
    checks = [
        ("rollout.temperature", ro.temperature, ro.temperature == 1.0, "1"),
        ("rl.temperature", rl.temperature, rl.temperature == 1.0, "1"),
        ("rollout.top_p", ro.top_p, ro.top_p == 1.0, "1"),
        ("rollout.top_k", ro.top_k, ro.top_k <= 0, "-1 (disabled)"),
        ("rollout.repetition_penalty", ro.repetition_penalty, ro.repetition_penalty == 1.0, "1"),
    ]
    return [f"{key}={value}: {why} needs {want}" for key, value, ok, want in checks if not ok]


def _teacher_problems(cfg: OPDConfig) -> list[str]:
    """The teacher's own fields."""
    t, grid = cfg.rl.teacher, cfg.grid
    problems = []
    if t.name_or_path is None:
        problems.append("rl.teacher.name_or_path is required: the teacher model directory")
    problems.extend(media_problems(cfg))  # the *_multimodal modes (preflight/opd_media.py)
    if t.scoring_temperature != 1.0:
        problems.append(
            f"rl.teacher.scoring_temperature={t.scoring_temperature}: must be 1 (the forced-sequence scoring "
            "path returns raw logprobs; another value would not temperature-scale the teacher)"
        )
    if t.tensor_parallel_size > 1 and grid.backend != "ray":
        problems.append(
            f"rl.teacher.tensor_parallel_size={t.tensor_parallel_size} needs grid.backend=ray; the local "
            "backend supports only TP 1"
        )
    problems.extend(_teacher_pool_problems(cfg))
    if t.conditional_think_prefix is not None and not t.input_mode.startswith("cross_token"):
        problems.append(
            "rl.teacher.conditional_think_prefix applies to input_mode=cross_token_text / cross_token_multimodal "
            "only (the same-vocabulary teacher scores the student's own prompt tokens verbatim)"
        )
    return problems


def _teacher_pool_problems(cfg: OPDConfig) -> list[str]:
    """The teacher role's shape (``teacher/pool.py``): replicas need Ray, tensor parallelism vLLM."""
    t, problems = cfg.rl.teacher, []
    if t.replicas > 1 and cfg.grid.backend != "ray":
        problems.append(
            f"rl.teacher.replicas={t.replicas} needs grid.backend=ray (a teacher pool of its own); under "
            "grid.backend=local the teacher is one in-process TP-1 scorer per policy rank: use rl.teacher.replicas=1"
        )
    if t.tensor_parallel_size > 1 and t.backend != "vllm":
        problems.append(
            f"rl.teacher.tensor_parallel_size={t.tensor_parallel_size} with rl.teacher.backend={t.backend}: the "
            "transformers teacher has no tensor parallelism; use rl.teacher.backend=vllm (one engine over the "
            "replica's ranks) or rl.teacher.tensor_parallel_size=1 with more rl.teacher.replicas"
        )
    return problems


def _mode_problems(cfg: OPDConfig) -> list[str]:
    """The three valid teacher / objective combinations and their requirements."""
    rl = cfg.rl
    t = rl.teacher
    mode, signal, shared = rl.distillation_mode, t.signal_mode, not t.input_mode.startswith("cross_token")
    problems = []
    if signal == "topk" and not shared:
        problems.append(
            f"rl.teacher.signal_mode=topk with input_mode={t.input_mode}: top-k ids exist only when teacher and "
            "student share a vocabulary; use signal_mode=dpca for a cross-tokenizer teacher"
        )
    if signal == "dpca" and shared:
        problems.append(
            f"rl.teacher.signal_mode=dpca with input_mode={t.input_mode}: DPCA aligns two tokenizations; "
            f"use input_mode={_cross_mode(t.input_mode)} "
            "(or signal_mode=topk for a same-vocabulary teacher)"
        )
    if mode == "direct":
        if signal != "topk":
            problems.append("rl.distillation_mode=direct needs rl.teacher.signal_mode=topk (DPCA is advantage-only)")
        if t.top_k < 1:
            problems.append(f"rl.teacher.top_k={t.top_k}: direct mode needs a top-k support of at least 1")
        if rl.jsd_beta is None:
            problems.append("rl.jsd_beta=null: direct mode needs a beta in [0, 1] (1 = reverse KL, the usual choice)")
        if rl.temperature != 1.0:
            problems.append(f"rl.temperature={rl.temperature}: the student's scoring temperature must be 1 in OPD")
        return problems
    if rl.jsd_beta is not None:
        problems.append(f"rl.jsd_beta={rl.jsd_beta}: advantage mode forms no divergence; set rl.jsd_beta=null")
    if signal == "dpca" and t.top_k != 0:
        problems.append(f"rl.teacher.top_k={t.top_k}: DPCA scores realized tokens only; set rl.teacher.top_k=0")
    why = "DPCA" if signal == "dpca" else "advantage-mode OPD"
    problems.extend(_neutral_sampling_problems(cfg, why))
    problems.extend(_rollout_logprob_problems(cfg))
    return problems


def _rollout_logprob_problems(cfg: OPDConfig) -> list[str]:
    """Advantage mode (DPCA included) scores the student's realized tokens by their rollout logprobs
    (the clipped surrogate's pi_old; DPCA's chunk sums), so every step must record them. The
    transformers engine always does; vLLM only as ``rollout.sampler_logprobs_every`` says."""
    every, samples = cfg.rollout.sampler_logprobs_every, cfg.rollout.sampler_logprobs_samples
    if cfg.rollout.backend != "vllm" or (every == 1 and samples in (None, "auto")):
        return []
    dpca = " (and DPCA sums them per chunk)" if cfg.rl.teacher.signal_mode == "dpca" else ""
    if every != 1:
        when = "never" if every == 0 else f"only with the weights of every {every}-th optimizer step"
        fix, setting = "set rollout.sampler_logprobs_every=1", f"rollout.sampler_logprobs_every={every}"
    else:
        when = f"for {samples} sample(s) per prompt only"
        fix, setting = "set rollout.sampler_logprobs_samples=null", f"rollout.sampler_logprobs_samples={samples}"
    return [
        f"rl.distillation_mode=advantage reads the student's rollout logprobs of every completion at every "
        f"step{dpca}, but rollout.backend=vllm with {setting} records them {when}: {fix}"
    ]


def opd_rules(cfg: OPDConfig, out: Findings) -> None:
    """Every OPD-specific rule, appended to ``out``."""
    out.errors.extend(_teacher_problems(cfg))
    out.errors.extend(_mode_problems(cfg))
    rl = cfg.rl
    if rl.teacher.name_or_path is not None:
        check_model_path("rl.teacher.name_or_path", rl.teacher.name_or_path, out, revision=rl.teacher.revision)
    if rl.distillation_mode == "advantage" and rl.kl_penalty_coef == 0:
        out.warnings.append("rl.kl_penalty_coef=0 in advantage mode: the teacher credit is multiplied by 0")
    for key, path in (
        ("model.name_or_path", cfg.model.name_or_path),
        ("rl.teacher.name_or_path", rl.teacher.name_or_path),
    ):
        if path and "opd-demo" in path and not os.path.exists(os.path.expanduser(path)):  # never raises
            out.errors.append(
                f"{key}={path}: the demo students are made once with `python -m posttrain.models.opd_demo`"
            )


def opd_preflight(cfg: OPDConfig) -> Findings:
    """Every model-free check of an OPD run (the shared ones, then OPD's rules), all problems at once."""
    findings = run_checks(cfg, (check_shared_objective,))
    opd_rules(cfg, findings)
    return findings


def check_shared_vocabulary(cfg: OPDConfig) -> None:
    """A same-vocabulary teacher must tokenize exactly like the student: its top-k ids and its scores
    of the student's ids mean nothing otherwise. Checked before either model loads (it reads both
    tokenizers, so it is not part of ``opd_preflight``, which reads no model files)."""
    if (
        cfg.rl.teacher.input_mode not in ("shared_vocab", "shared_vocab_multimodal")
        or cfg.rl.teacher.name_or_path is None
    ):
        return
    from posttrain.models.loading import load_tokenizer, resolve_model_path

    student = load_tokenizer(resolve_model_path(cfg.model.name_or_path, cfg.model.revision))
    teacher_dir = resolve_model_path(
        cfg.rl.teacher.name_or_path, cfg.rl.teacher.revision, key="rl.teacher.name_or_path"
    )
    teacher = load_tokenizer(teacher_dir)
    if student.get_vocab() != teacher.get_vocab():
        raise ConfigError(
            [
                f"rl.teacher.input_mode={cfg.rl.teacher.input_mode} but the teacher's tokenizer ({len(teacher)} "
                f"tokens) differs from the student's ({len(student)} tokens); use "
                f"input_mode={_cross_mode(cfg.rl.teacher.input_mode)} with signal_mode=dpca"
            ]
        )
