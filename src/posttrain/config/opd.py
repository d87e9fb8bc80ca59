"""The typed configuration of an on-policy distillation (OPD) run, and its cross-field rules.

OPD is the GRPO loop plus a frozen teacher (``rl.teacher.*``): the student samples, the teacher
scores the same completion, and the objective is swapped (spec: ../shared/spec/opd.md).
``OPDConfig`` extends ``GRPOConfig``, so every GRPO knob keeps its meaning; ``opd_preflight``
runs GRPO's model-free checks plus the rules below, all before any model loads (and under
``--validate-manifest``). Nothing here imports torch.

Valid teacher combinations (text models):

| ``input_mode``      | ``signal_mode`` | ``distillation_mode`` | what it is                                   |
| ------------------- | --------------- | --------------------- | -------------------------------------------- |
| ``shared_vocab``    | ``topk``        | ``direct``            | top-k + residual generalized JSD             |
| ``shared_vocab``    | ``topk``        | ``advantage``         | legacy per-token teacher credit              |
| ``cross_token_text``| ``dpca``        | ``advantage``         | cross-tokenizer chunk credit (DPCA)          |
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from posttrain.config.schema import GRPOConfig, RLConfig, _Section
from posttrain.config.validate import Findings, check_model_path, preflight

InputMode = Literal["shared_vocab", "cross_token_text", "shared_vocab_multimodal", "cross_token_multimodal"]
SignalMode = Literal["topk", "dpca"]
DistillationMode = Literal["direct", "advantage"]


class TeacherConfig(_Section):
    """The frozen teacher: it scores the student's realized completions and never receives weights."""

    name_or_path: str | None = None
    """A local Hugging Face model directory, or ``embedded:smollm2-135m-instruct``. Required."""
    backend: Literal["hf", "vllm"] = "hf"
    """Scoring engine: ``hf`` (a transformers forward pass, chunked LM head) or ``vllm`` (prompt
    logprobs of the forced sequence)."""
    input_mode: InputMode = "shared_vocab"
    """``shared_vocab``: the teacher shares the student's tokenizer and scores the student's token ids
    verbatim. ``cross_token_text``: the teacher renders the prompt with its own tokenizer and chat
    template, tokenizes the student's completion text itself, and the two tokenizations are aligned
    (DPCA). The ``*_multimodal`` modes of the spec need media inputs, which posttrain (text models)
    does not take; they are refused with that explanation."""
    signal_mode: SignalMode = "topk"
    """``topk``: per position the teacher's top-k ids and logprobs (same tokenizer only). ``dpca``:
    the teacher's logprobs of its own realized tokens, aligned into text chunks."""
    top_k: int = Field(8, ge=0)
    """Teacher top-k support size per scored position (``topk``); must be 0 for ``dpca``."""
    scoring_temperature: float = Field(1.0, gt=0.0)
    """Temperature of the teacher's scoring distribution. Must be 1: the forced-sequence scoring
    path returns raw logprobs, so another value would not temperature-scale the teacher."""
    conditional_think_prefix: str | None = None
    """Text inserted exactly once after the teacher's generation prompt (``cross_token_text`` only),
    e.g. ``"<think>\\n\\n</think>\\n\\n"``. An empty closed think block the teacher's template already
    emitted is removed first; missing, duplicate or misplaced conditioning fails before scoring."""
    use_chat_template: bool = True
    """Render the teacher's prompt with its own chat template (``cross_token_text``)."""
    max_model_len: int | None = Field(None, ge=16)
    """Longest teacher sequence (prompt + completion); a longer request fails the batch. ``null``:
    the teacher model's own limit."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Teacher ranks. More than 1 needs ``grid.backend=ray``; the local backend is TP 1."""
    gpu_memory_utilization: float = Field(0.2, gt=0.0, le=1.0)
    """GPU memory fraction of the vLLM teacher (``backend=vllm``)."""
    max_score_attempts: int = Field(2, ge=1)
    """Scoring is all-or-nothing per batch; a failed attempt (an engine error or an invalid payload)
    is retried up to this many attempts in all, then the run stops with the last error."""
    dpca_max_chunk_tokens: int = Field(32, ge=1)
    """Alignment guard: a DPCA chunk longer than this many tokens on either side (a long run where
    the two tokenizations never share a boundary) fails the batch instead of being force-closed."""
    batch_size: int = Field(64, ge=1)
    """Sequences per teacher forward pass (``backend=hf``); memory only."""


class OPDRLConfig(RLConfig):
    """The GRPO loop's knobs plus the teacher and the distillation objective."""

    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    """The frozen teacher."""
    distillation_mode: DistillationMode = "direct"
    """``direct``: minimise the generalized JSD between teacher and student over the teacher's top-k
    support plus the residual mass (no reward term, no importance ratio). ``advantage``: the teacher
    signal becomes per-token credit added to the reward advantage, trained with the clipped
    surrogate."""
    jsd_beta: float | None = Field(1.0, ge=0.0, le=1.0)
    """Generalized JSD weight (``direct``): 0 is forward KL(teacher || student), 1 reverse
    KL(student || teacher), in between the generalized JSD (docs/opd.md). Must be ``null`` in
    ``advantage`` mode."""
    kl_penalty_coef: float = Field(1.0, ge=0.0)
    """Weight of the teacher credit in ``advantage`` mode: A_policy = A_reward + kl_penalty_coef * A_teacher."""
    n_ignore_prefix_tokens: int = Field(0, ge=0)
    """The first N completion tokens carry no teacher signal (credit zeroed in ``advantage`` mode,
    masked from the divergence in ``direct`` mode)."""


class OPDConfig(GRPOConfig):
    """A whole on-policy distillation run: the GRPO loop with a teacher and a distillation objective."""

    algorithm: Literal["opd"] = "opd"  # type: ignore[assignment]
    """Always ``opd``."""
    rl: OPDRLConfig = Field(default_factory=OPDRLConfig)
    """The loop, the teacher and the objective."""

    def resume_identity_extra(self) -> dict[str, object]:
        """What a resume must find unchanged beyond GRPO's identity: the teacher's signal and
        objective knobs, and the teacher itself (see :func:`teacher_fingerprint`)."""
        rl = self.rl
        t = rl.teacher
        knobs = {
            "distillation_mode": rl.distillation_mode,
            "jsd_beta": rl.jsd_beta,
            "kl_penalty_coef": rl.kl_penalty_coef,
            "n_ignore_prefix_tokens": rl.n_ignore_prefix_tokens,
            "input_mode": t.input_mode,
            "signal_mode": t.signal_mode,
            "top_k": t.top_k,
            "conditional_think_prefix": t.conditional_think_prefix,
            "use_chat_template": t.use_chat_template,
        }
        return {"teacher": {**knobs, "model": teacher_fingerprint(t.name_or_path)}}


# Files that define how a teacher tokenizes, renders and is configured; they are hashed whole.
_IDENTITY_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")


def teacher_fingerprint(name_or_path: str | None) -> str | None:
    """sha256 over the teacher directory's config, tokenizer and template files (whole) and the names
    and sizes of its other files (weights are not read: a large teacher would take minutes). An
    embedded model is named by its identifier, which pins the packaged file."""
    import hashlib

    if name_or_path is None or name_or_path.startswith("embedded:"):
        return name_or_path
    root = Path(name_or_path).expanduser()
    if not root.is_dir():
        return None
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = file.relative_to(root).as_posix()
        if file.suffix in _IDENTITY_SUFFIXES:
            digest.update(f"{rel}\0{hashlib.sha256(file.read_bytes()).hexdigest()}\n".encode())
        else:
            digest.update(f"{rel}\0size={file.stat().st_size}\n".encode())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------
# Cross-field rules
# ------------------------------------------------------------------------------------------------


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


def _grpo_rejections(cfg: OPDConfig) -> list[str]:
    """GRPO knobs OPD refuses."""
    rl = cfg.rl
    problems = []
    for key in ("min_informative_groups", "min_informative_groups_frac"):
        if getattr(rl, key) is not None:
            problems.append(
                f"rl.{key}={getattr(rl, key)}: dynamic sampling is GRPO-only; on-policy distillation trains on "
                "every trajectory regardless of reward spread. Remove the knob"
            )
    if rl.importance_sampling_level != "token":
        problems.append(
            f"rl.importance_sampling_level={rl.importance_sampling_level}: OPD needs token (its advantage "
            "objective scores a token-level ratio and direct mode forms none)"
        )
    if rl.kl_beta > 0 or rl.ref.build_ref:
        problems.append(
            f"rl.kl_beta={rl.kl_beta} / rl.ref.build_ref={rl.ref.build_ref}: OPD has no reference role; "
            "the teacher is the anchor. Set rl.kl_beta=0 and rl.ref.build_ref=false"
        )
    if rl.score_centering.enabled:
        problems.append("rl.score_centering.enabled=true: score centering is a GRPO correction; OPD refuses it")
    return problems


def _teacher_problems(cfg: OPDConfig) -> list[str]:
    """The teacher's own fields."""
    t, grid = cfg.rl.teacher, cfg.grid
    problems = []
    if t.name_or_path is None:
        problems.append("rl.teacher.name_or_path is required: the teacher model directory")
    if t.input_mode.endswith("_multimodal"):
        plain = t.input_mode.removesuffix("_multimodal").replace("cross_token", "cross_token_text")
        problems.append(
            f"rl.teacher.input_mode={t.input_mode}: posttrain trains text models and takes no media; "
            f"use rl.teacher.input_mode={plain}"
        )
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
    if t.conditional_think_prefix is not None and t.input_mode != "cross_token_text":
        problems.append(
            "rl.teacher.conditional_think_prefix applies to input_mode=cross_token_text only (the same-vocabulary "
            "teacher scores the student's own prompt tokens verbatim)"
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
            "use input_mode=cross_token_text (or signal_mode=topk for a same-vocabulary teacher)"
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
    return problems


def opd_rules(cfg: OPDConfig, out: Findings) -> None:
    """Every OPD-specific rule, appended to ``out``."""
    out.errors.extend(_grpo_rejections(cfg))
    out.errors.extend(_teacher_problems(cfg))
    out.errors.extend(_mode_problems(cfg))
    rl = cfg.rl
    if rl.teacher.name_or_path is not None:
        check_model_path("rl.teacher.name_or_path", rl.teacher.name_or_path, out)
    if rl.distillation_mode == "advantage" and rl.kl_penalty_coef == 0:
        out.warnings.append("rl.kl_penalty_coef=0 in advantage mode: the teacher credit is multiplied by 0")
    for key, path in (
        ("model.name_or_path", cfg.model.name_or_path),
        ("rl.teacher.name_or_path", rl.teacher.name_or_path),
    ):
        if path and "opd-demo" in path and not Path(path).expanduser().exists():
            out.errors.append(
                f"{key}={path}: the demo students are made once with `python -m posttrain.models.opd_demo`"
            )


def opd_preflight(cfg: OPDConfig) -> Findings:
    """GRPO's model-free checks plus OPD's rules, every problem at once."""
    findings = preflight(cfg)
    opd_rules(cfg, findings)
    return findings
