"""The typed configuration of an on-policy distillation (OPD) run.

OPD is the shared loop plus a frozen teacher (``rl.teacher.*``): the student samples, the teacher
scores the same completion, and the objective is swapped (spec: ../shared/spec/opd.md).
``OPDConfig`` is a ``RunConfig`` (``job``, ``model``, ``rollout``, ``grid`` and the shared ``rl``
knobs of ``BaseRLConfig``) with OPD's own ``rl`` part; it has none of GRPO's own knobs (dynamic
sampling, the KL reference, score centering, the importance-sampling level), and setting one is an
unknown key whose message says why (``unknown_key_hints``). OPD's cross-field rules run in
``posttrain.preflight.opd`` before any model loads (and under ``--validate-manifest``). Nothing here
imports torch.

Valid teacher combinations (text models; the ``*_multimodal`` twins, ``shared_vocab_multimodal``
and ``cross_token_multimodal``, take the same signal and objective with a vision-language student
and teacher: docs/multimodal.md, "Multimodal OPD"):

| ``input_mode``      | ``signal_mode`` | ``distillation_mode`` | what it is                                   |
| ------------------- | --------------- | --------------------- | -------------------------------------------- |
| ``shared_vocab``    | ``topk``        | ``direct``            | top-k + residual generalized JSD             |
| ``shared_vocab``    | ``topk``        | ``advantage``         | legacy per-token teacher credit              |
| ``cross_token_text``| ``dpca``        | ``advantage``         | cross-tokenizer chunk credit (DPCA)          |
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from posttrain.config.schema import BaseRLConfig, RefConfig, RunConfig, ScoreCenteringConfig
from posttrain.config.section import Section

InputMode = Literal["shared_vocab", "cross_token_text", "shared_vocab_multimodal", "cross_token_multimodal"]
SignalMode = Literal["topk", "dpca"]
DistillationMode = Literal["direct", "advantage"]


class TeacherConfig(Section):
    """The frozen teacher: it scores the student's realized completions and never receives weights."""

    name_or_path: str | None = None
    """A local Hugging Face model directory, a hub id ``org/name`` (resolved as ``model.name_or_path``
    is), or ``embedded:smollm2-135m-instruct``. Required."""
    revision: str | None = None
    """Branch, tag or commit of a hub id ``rl.teacher.name_or_path``; ``null`` is ``main``."""
    backend: Literal["hf", "vllm"] = "hf"
    """Scoring engine: ``hf`` (a transformers forward pass, chunked LM head) or ``vllm`` (prompt
    logprobs of the forced sequence)."""
    input_mode: InputMode = "shared_vocab"
    """``shared_vocab``: the teacher shares the student's tokenizer and scores the student's token ids
    verbatim. ``cross_token_text``: the teacher renders the prompt with its own tokenizer and chat
    template, tokenizes the student's completion text itself, and the two tokenizations are aligned
    (DPCA). ``shared_vocab_multimodal`` / ``cross_token_multimodal``: the same two with a
    vision-language student and teacher (Qwen3-VL) and image prompts; the teacher renders its own
    image prefix from the same ordered raw images (docs/multimodal.md, "Multimodal OPD")."""
    signal_mode: SignalMode = "topk"
    """``topk``: per position the teacher's top-k ids and logprobs (same tokenizer only). ``dpca``:
    the teacher's logprobs of its own realized tokens, aligned into text chunks."""
    top_k: int = Field(8, ge=0)
    """Teacher top-k support size per scored position (``topk``); must be 0 for ``dpca``."""
    scoring_temperature: float = Field(1.0, gt=0.0)
    """Temperature of the teacher's scoring distribution. Must be 1: the forced-sequence scoring
    path returns raw logprobs, so another value would not temperature-scale the teacher."""
    conditional_think_prefix: str | None = None
    """Text inserted exactly once after the teacher's generation prompt (the ``cross_token_*`` modes),
    e.g. ``"<think>\\n\\n</think>\\n\\n"``. An empty closed think block the teacher's template already
    emitted is removed first; missing, duplicate or misplaced conditioning fails before scoring."""
    use_chat_template: bool = True
    """Render the teacher's prompt with its own chat template (``cross_token_text``; the multimodal
    modes always do: the template writes the image markers)."""
    max_model_len: int | None = Field(None, ge=16)
    """Longest teacher sequence (prompt + completion); a longer request fails the batch. ``null``:
    the teacher model's own limit."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Teacher ranks per replica (one GPU each, vLLM tensor parallelism inside the replica). More
    than 1 needs ``grid.backend=ray`` and ``rl.teacher.backend=vllm``; the local backend is TP 1."""
    replicas: int = Field(1, ge=1)
    """Teacher replicas under ``grid.backend=ray`` (docs/distributed.md): each is an actor group of
    ``tensor_parallel_size`` ranks on GPUs of its own, and every step's scoring requests, batched
    from all policy ranks, are split over the live replicas. The local backend has one in-process
    teacher per policy rank: 1 only."""
    gpu_memory_utilization: float = Field(0.2, gt=0.0, le=1.0)
    """GPU memory fraction of the vLLM teacher (``backend=vllm``)."""
    moe_backend: str = Field("auto", min_length=1)
    """vLLM's MoE expert kernel for a sparse-MoE teacher (``backend=vllm``; vLLM's ``moe_backend``
    engine argument, e.g. ``triton``); ``auto`` lets vLLM choose. It does not inherit
    ``rollout.moe_backend``: set both when student and teacher need the same non-default kernel."""
    max_score_attempts: int = Field(2, ge=1)
    """Scoring is all-or-nothing per batch; a failed attempt (an engine error or an invalid payload)
    is retried up to this many attempts in all, then the run stops with the last error."""
    dpca_max_chunk_tokens: int = Field(32, ge=1)
    """Alignment guard: a DPCA chunk longer than this many tokens on either side (a long run where
    the two tokenizations never share a boundary) gets no credit (``train/opd_dpca_too_long_chunk_count``)
    instead of being force-closed; the chunks around it keep theirs."""
    batch_size: int = Field(64, ge=1)
    """Sequences per teacher forward pass (``backend=hf``); memory only."""


class OPDRLConfig(BaseRLConfig):
    """The loop's shared knobs plus the teacher and the distillation objective."""

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

    # What shared code reads on an OPD run: OPD has none of these GRPO knobs (setting one is an unknown
    # key), but policy/trainer.py (objective_spec, build_reference), loop/collect.py, loop/run_dir.py
    # and loop/resume.py still read them from any config. These read-only properties give OPD's
    # values; remove each once shared code no longer reads it (the trainer taking its objective from
    # the recipe). The resume identity of an OPD run reads them too, so keep the values unchanged.
    @property
    def reads_every_sampler_logprob(self) -> bool:
        """Advantage mode (DPCA included) scores every realized token by its rollout logprob."""
        return self.use_rollout_logprobs_for_loss or self.distillation_mode == "advantage"

    @property
    def importance_sampling_level(self) -> Literal["token"]:
        """Always ``token``: OPD's advantage objective scores a token-level ratio, direct mode none."""
        return "token"

    @property
    def kl_beta(self) -> float:
        """Always 0: OPD has no reference role (the teacher is the anchor)."""
        return 0.0

    @property
    def kl_coeff_clamp(self) -> float | None:
        """Always ``None`` (no KL term to clamp)."""
        return None

    @property
    def ref(self) -> RefConfig:
        """Always the unbuilt reference (``build_ref=false``, no ``model_dir``)."""
        return RefConfig()

    @property
    def score_centering(self) -> ScoreCenteringConfig:
        """Always disabled: score centering is a GRPO correction."""
        return ScoreCenteringConfig()

    @property
    def effective_min_informative_groups(self) -> int:
        """Always 0: no dynamic sampling, every trajectory trains."""
        return 0

    @property
    def routing_replay(self) -> Literal["off", "rollout"]:
        """Always off: OPD refuses MoE routing replay (the spec's constraint)."""
        return "off"


def _grpo_knob(why: str) -> str:
    """The unknown-key hint of a GRPO knob OPD lacks (``{key}`` is filled in by config/loading.py)."""
    return "{key} is a GRPO knob; " + why + ". Remove it"


_NO_DYNAMIC_SAMPLING = _grpo_knob(
    "dynamic sampling is GRPO-only: on-policy distillation trains on every trajectory regardless of reward spread"
)
_NO_REFERENCE = _grpo_knob("OPD has no reference role: the teacher is the anchor")

# Why OPD lacks a GRPO key (a key, or a section prefix), shown in the unknown-key error.
GRPO_ONLY_HINTS: Mapping[str, str] = {
    "rl.min_informative_groups": _NO_DYNAMIC_SAMPLING,
    "rl.min_informative_groups_frac": _NO_DYNAMIC_SAMPLING,
    "rl.dynamic_sampling_max_extra_rollouts": _NO_DYNAMIC_SAMPLING,
    "rl.dynamic_sampling_on_budget_exhausted": _NO_DYNAMIC_SAMPLING,
    "rl.dynamic_sampling_refill_dispatch": _NO_DYNAMIC_SAMPLING,
    "rl.dynamic_sampling_refill_mode": _NO_DYNAMIC_SAMPLING,
    "rl.importance_sampling_level": _grpo_knob(
        "OPD's ratio is always per token (its advantage objective scores a token-level ratio and direct "
        "mode forms none)"
    ),
    "rl.kl_beta": _NO_REFERENCE,
    "rl.kl_coeff_clamp": _NO_REFERENCE,
    "rl.ref": _NO_REFERENCE,
    "rl.score_centering": _grpo_knob("score centering is a GRPO correction; OPD has none"),
    "rl.routing_replay": _grpo_knob("MoE routing replay pins GRPO's clipped-surrogate forwards only; OPD refuses it"),
}


class OPDConfig(RunConfig):
    """A whole on-policy distillation run: the shared loop with a teacher and a distillation objective."""

    algorithm: Literal["opd"] = "opd"
    """Always ``opd``."""
    rl: OPDRLConfig = Field(default_factory=OPDRLConfig)
    """The loop, the teacher and the objective."""

    unknown_key_hints: ClassVar[Mapping[str, str]] = GRPO_ONLY_HINTS

    def resume_identity_extra(self) -> dict[str, object]:
        """What a resume must find unchanged beyond the identity every run pins: the teacher's signal and
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
        teacher: dict[str, object] = {**knobs, "model": teacher_fingerprint(t.name_or_path)}
        if t.input_mode.endswith("_multimodal"):  # only then, so text OPD identities stay as they were
            from posttrain.config.opd_media import media_cardinality, media_identity

            media = media_identity(t.name_or_path) or {}
            teacher["media"] = {**media, **media_cardinality(rl.data.images.max_per_row)}
        return {"teacher": teacher}


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
