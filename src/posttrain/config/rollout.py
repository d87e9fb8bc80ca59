"""The ``rollout`` section: which engine samples the completions, its sampling controls, and the
vLLM engine's own knobs (memory, CUDA graphs, model runner, engine processes, sleep mode).

Rules tying these to other sections (vLLM installed, warping only at temperature 1, engine
processes beside off-policy sampling) live in the preflight (``preflight/common.py``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from posttrain.config.section import SEED_BOUND, Section

GRAPHED_DECODE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""The model types whose decode ``rollout.cuda_graphs`` graphs (rollout/graphed_decode.py)."""


class RolloutConfig(Section):
    """The rollout engine and its sampling controls."""

    backend: Literal["hf", "vllm"] = "hf"
    """``hf`` samples with transformers (works everywhere); ``vllm`` with a vLLM engine."""
    max_tokens: int = Field(16, ge=1)
    """Most new tokens per completion; a completion cut here has finish reason ``length``."""
    temperature: float = Field(1.0, ge=1e-2, le=1e2)
    """Sampling temperature, in [0.01, 100]: the engines divide logits by it, so a smaller value
    overflows a bf16/fp32 logit to inf (then NaN probabilities), and above 100 every token is already
    about equally likely."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling; 1 disables it."""
    top_k: int = -1
    """Top-k sampling; 0 or a negative value disables it."""
    repetition_penalty: float = Field(1.0, ge=1e-2, le=1e2)
    """Repetition penalty, in [0.01, 100]; 1 disables it. Seen tokens' logits are divided (positive)
    or multiplied (negative) by it, so outside this range they overflow or vanish like a temperature."""
    seed: int | None = Field(0, ge=0, lt=SEED_BOUND)
    """Sampling seed, in [0, 2**63): decides what each ``generate`` call draws, so a resumed run draws
    what the uninterrupted one drew. vLLM seeds each prompt's request (``rollout.per_prompt_seeds``;
    docs/vllm.md). ``null``: not seeded."""
    per_prompt_seeds: bool = True
    """vLLM: a request seed per prompt. ``false``: the engine's generators seeded once per call instead
    (CPU build only, in-process, on-policy, TP 1; a CUDA engine refuses it; docs/vllm.md "Seeding")."""
    sampler_logprobs_every: int = Field(1, ge=0)
    """vLLM: record the sampler's logprob of each generated token only when sampling with the weights of
    every N-th optimizer step (the initial weights included); 0: never. It costs vLLM per-token work (W's
    generation on an H100: 0.13 s of 1.20 s for each group's first sample's, 0.55 s for all); unrecorded,
    ``train/logprob_gap_*`` is absent on that step. Must be 1 when the loss or off-policy sampling reads
    them (score centering records them anyway). The hf engine always records them (free there)."""
    sampler_logprobs_samples: int | Literal["auto"] | None = "auto"
    """vLLM: only the first N samples of each group record the sampler's logprobs (``null``: all);
    ``train/logprob_gap_*`` is measured on those, the draws are unchanged. ``auto``: 1 unless the
    objective reads every completion's (``rl.use_rollout_logprobs_for_loss``, score centering, OPD's
    advantage mode), then all. An explicit N is refused where the objective reads them. Recording all made
    W's step 0.23-0.43 s slower on two H200s, 0.40 s on an H100 (docs/benchmarks.md)."""
    batch_size: int = Field(256, ge=1)
    """Most sequences the hf engine decodes at once."""
    cpu_weight_layout: Literal["auto", "row_major", "column_major", "onednn_packed"] = "auto"
    """The hf engine on a CPU: the layout its fp32 linear weights are read in while it decodes (a copy per
    ``generate`` call; the parameters stay row-major). ``column_major`` hands MKL its "NN" kernel for the few
    rows of a decode step: on an Intel Xeon 1.5-10x faster per product, the default job's rollout call
    23-30 % faster (on an AMD EPYC 6-7 % slower). ``onednn_packed`` multiplies with oneDNN over weights packed
    in its blocked layout: on an AMD EPYC the head's product 1.9-2.7x faster, the rollout call 15-26 % faster (not
    measured on Intel); needs a torch with oneDNN (x86 builds have it). ``auto``: ``column_major`` on an Intel
    CPU with torch's MKL, else ``onednn_packed`` where torch packs, else ``row_major``
    (models/cpu_decode_layout.py). The layouts round differently, so they draw differently: a run and its
    resume on one machine read the same."""

    cuda_graphs: bool | Literal["auto"] = "auto"
    """The hf engine on CUDA: each decode step (draw, record, the decoder's forward) recorded once as a CUDA
    graph and replayed per token, the KV cache a fixed buffer, finished rows kept in the batch unrecorded;
    the prefill stays eager (rollout/graphed_decode.py). A step of a small model is bound by the host's
    launches, not the GPU: W's generation (0.4B, 256 x 256 tokens) took 0.86 s graphed against 16.5 s eager on
    one H100 (docs/gpu.md). ``auto``: on for a dense full-attention llama, mistral, qwen2 or qwen3 policy on
    CUDA (not for calls that record the top-k head: score centering's); ``true`` refuses anything else.
    Its draws differ from the eager decode's for the same seed (the uniforms are drawn per call, the
    kernels round differently); a run and its resume on one machine draw the same."""

    @field_validator("sampler_logprobs_samples")
    @classmethod
    def _positive_samples(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1 (null: every sample records; auto: as the objective needs)")
        return v

    gpu_memory_utilization: float = Field(0.3, gt=0.0, le=1.0)
    """GPU fraction reserved for the colocated vLLM engines (all ``engines_per_device`` of them together)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor-parallel width (must equal ROLLOUT_RANKS of ``grid.shapes.rollout``)."""
    max_model_len: int | None = Field(None, ge=16)
    """vLLM context length (prompt plus completion: more than ``max_tokens``); ``null`` = the model's own."""
    enforce_eager: bool = False
    """vLLM: skip CUDA-graph capture (faster start, slower decode)."""
    cudagraph_capture_max: int | None = Field(None, ge=1)
    """vLLM: the largest decode batch captured as a CUDA graph (``null``: vLLM's min(2 x max_num_seqs, 512));
    larger batches decode eager. On an H200, 1,024 cut 128 prompts x 8 samples' generation by 30 %."""
    async_scheduling: bool | None = None
    """vLLM's asynchronous scheduling (overlaps the host-side scheduling of step k+1 with the GPU
    work of step k); ``null`` keeps vLLM's default."""
    vllm_model_runner: Literal["auto", "v1", "v2"] = "auto"
    """vLLM on CUDA: its V1 or V2 model runner, for the whole process. ``auto``: vLLM's choice, but V2 for a
    seeded one-GPU text engine of an architecture checked on it (Qwen2); docs/vllm.md, "Model runners"."""
    separate_engine_process: bool = False
    """vLLM: the engine core (scheduler, model runner, sampler) in a process of its own, so its host
    work no longer takes turns with the trainer's on one GIL (what ``rl.max_off_policy_steps=1``
    needs to overlap); weights go through one buffer both map (shared memory; CUDA IPC). Colocated
    engines only; a script using the Python API needs an ``if __name__ == "__main__":`` guard."""
    engines_per_device: int = Field(1, ge=1, le=8)
    """vLLM: engines sharing the device, each with its engine core in a process of its own (needs
    ``separate_engine_process=true``); each call's prompts are split between them and each engine gets
    ``gpu_memory_utilization / N``, so their host-bound decode scheduling runs in parallel. It pays where one
    engine's host is slow (W's step on two H100 hosts: 1.99-2.01 s with 2 against 2.21-2.74 s with 1, and
    2.49 s against 3.80 s) and not where it is fast (1.77-1.96 s against 1.80-1.85 s); each engine starts in
    a process of its own, about 15-45 s more, and holds the whole model; 4 were slower. Each
    prompt is seeded by its place in the whole call, so the seeds do not depend on N (on the CPU neither
    do the draws; a GPU's kernels may round differently per batch size). Plain text policies (no LoRA,
    images, routing)."""
    enable_sleep_mode: bool = False
    """vLLM on a GPU: put the engine to sleep while the policy trains (its weights and KV cache leave
    GPU memory) and wake it for the next generation; ignored on CPU (docs/vllm.md)."""
    sleep_level: Literal[1, 2] = 1
    """vLLM sleep level: 1 offloads the weights to CPU memory and drops the KV cache; 2 drops both
    (the next weight sync restores the weights)."""
    moe_backend: str = Field("auto", min_length=1)
    """vLLM's MoE expert kernel for a sparse-MoE policy (vLLM's ``moe_backend`` engine argument, e.g.
    ``triton``); ``auto`` lets vLLM choose. The value must be one the pinned vLLM accepts (vLLM
    refuses others when the engine starts). ``rl.teacher.moe_backend`` does not follow it."""
