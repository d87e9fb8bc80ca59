"""The vLLM rollout engine: vLLM's offline ``LLM`` living in the policy's process (colocated).

Same output contract as the transformers engine (``rollout/hf_engine.py``): ``n`` completions per
prompt grouped by prompt, token ids ending with the EOS id when the finish reason is ``stop``, one
sampler logprob per generated token, the decoded text, and the ``rollout/*`` stats. The engine is
built with the vLLM logprob mode its temperature needs and refuses sampling controls that mode
cannot report (``rollout/vllm_requests.py``, which also builds the requests and reads the outputs).
A seeded call draws from ``(seed, call index)``: each prompt's request seeded, or (``call_seeds``,
vLLM's CPU build only) vLLM's generators seeded once for the call (``rollout/vllm_seeding.py``).
Image prompts of a vision-language policy go with their decoded images (``rollout/vllm_images.py``).

Weights move in-process: the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so ``receive_weights`` hands the policy's tensors (``PolicyWeights.full_state_dict()``, gathered
when sharded) to vLLM unserialized: a plain dense model on CUDA writes them in place with its own
``load_weights`` (Hugging Face names onto the fused layers; ``rollout/vllm_weight_load.py``), and
from the second sync on with one foreach copy into the places the first one wrote
(``rollout/vllm_copy_plan.py``); others go through vLLM's ``reload_weights`` (which redoes the
post-load processing). Then the engine drops the prefix cache (KV of the old weights) and only then
stamps the version. A transfer that fails midway poisons the engine (``rollout/state.py``).

With ``separate_process`` (``rollout.separate_engine_process``) the engine core runs in a process of
its own, so sampling in a background thread does not take turns with the trainer on this process's
GIL (one-step off-policy), and the weights go through one buffer both processes map
(``rollout/vllm_shared_weights.py``: shared memory, CUDA IPC); ``rollout/vllm_fleet.py`` runs several.

vLLM 0.32 (CPU build, CI) and 0.24 (CUDA 13 / torch 2.11, the GPU device) expose the APIs used here.
On CUDA the engine asks for vLLM's FlashAttention backend by default (``attention_backend``), and can
free its GPU memory while the policy trains (``enable_sleep_mode``): ``generate`` puts the engine to
sleep when it returns, ``load_weights`` wakes the weights, writes the new ones, then wakes the KV
cache, and ``generate`` wakes whatever still sleeps (vLLM's CPU backend has no sleep mode).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from posttrain.errors import ConfigError, PosttrainError, TrainingError
from posttrain.models.moe import checkpoint_layout
from posttrain.rollout.base import RolloutBatch, SamplingParams, check_generate_inputs, generation_stats
from posttrain.rollout.state import RESUME_HINT, EngineState, HoldsEngineState, records_logprobs
from posttrain.rollout.vllm_copy_plan import WeightWriter, checked_copy_plan
from posttrain.rollout.vllm_images import (
    IMAGE_PAD,
    ban_tokens,
    check_engine_expansion,
    image_token_prompts,
    multimodal_engine_args,
)
from posttrain.rollout.vllm_lora import AdapterSync, lora_engine_args
from posttrain.rollout.vllm_moe import (
    MOE_BACKEND_DEFAULT,
    attach_routed_experts,
    moe_backend_args,
    repack_cpu_moe,
    routed_experts_args,
)
from posttrain.rollout.vllm_requests import call_completions, call_requests, check_params_for_mode, logprobs_mode_for
from posttrain.rollout.vllm_runtime import (
    build_llm,
    built_model_runner,
    choose_engine_core_process,
    choose_model_runner,
    cuda_attention_backend,
    cudagraph_args,
    engine_core_is_separate,
    engine_thread_count,
    import_vllm,
    model_architectures,
    model_eos_ids,
    model_runner_for,
    on_cuda,
    shutdown_llm,
)
from posttrain.rollout.vllm_seeding import call_seed, engine_seeding, generators_seeded
from posttrain.rollout.vllm_shared_weights import WORKER_EXTENSION, SharedWeightsSender
from posttrain.rollout.vllm_weight_load import checkpoint_tensor_names, load_in_place, loads_in_place

if TYPE_CHECKING:
    from posttrain.distributed.fsdp import PolicyWeights

_log = logging.getLogger("posttrain.rollout")


class VLLMRolloutEngine(HoldsEngineState):
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
        cudagraph_capture_max: int | None = None,
        seed: int | None = 0,
        dtype: str = "auto",
        eos_ids: list[int] | None = None,
        cpu_kv_cache_gib: int = 2,
        enable_sleep_mode: bool = False,
        sleep_level: int = 1,
        async_scheduling: bool | None = None,
        attention_backend: str | None = "auto",
        separate_process: bool = False,
        lora_rank: int = 0,
        moe_backend: str = MOE_BACKEND_DEFAULT,
        return_routed_experts: bool = False,
        max_images_per_prompt: int = 0,
        call_seeds: bool = False,
        launcher_args: Mapping[str, Any] | None = None,
        model_runner: str = "auto",
    ) -> None:
        vllm = import_vllm()
        from transformers import AutoTokenizer

        # In-process engine core: load_weights hands tensors over by reference (no pickling); in a
        # separate process, through the shared buffer of vllm_shared_weights.
        choose_engine_core_process(separate_process)
        # vLLM's CPU backend sizes its KV cache from this (GiB); without it, it guesses from free RAM.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
        self.eos_ids = list(eos_ids) if eos_ids else model_eos_ids(model_dir, self.tokenizer)
        self.logprobs_mode = logprobs_mode_for(temperature)
        self._checkpoint_names = checkpoint_tensor_names(model_dir)
        self.state = EngineState("the vLLM rollout engine cannot be used: {reason}. " + RESUME_HINT)
        self.last_sync_s = 0.0  # seconds the last load_weights took (the loop logs timer/weight_sync_s)
        # What received weights are cast to (None: as they come): vLLM's loaders would cast on copy,
        # but casting first halves what crosses to a separate engine process for fp32 master weights.
        self.weight_dtype: torch.dtype | None = None if dtype == "auto" else getattr(torch, dtype)
        if sleep_level not in (1, 2):
            raise ValueError(
                f"sleep_level must be 1 (weights kept in CPU memory) or 2 (weights dropped), got {sleep_level}"
            )
        cuda = on_cuda()
        if call_seeds and cuda:  # tests/gpu/test_vllm_gpu.py: a restored call counter drew other tokens
            raise ConfigError(
                [
                    "rollout.per_prompt_seeds=false: per-call seeding does not replay on vLLM's CUDA sampler "
                    "(checked on vLLM 0.24 / one H200: a call replayed after others drew other tokens), so exact "
                    "resume would not hold; set rollout.per_prompt_seeds=true (docs/vllm.md, Seeding)"
                ]
            )
        # Sleep / wake: only vLLM's CUDA platform implements it (the CPU backend logs and ignores it).
        self.sleep_mode = bool(enable_sleep_mode) and cuda
        self.sleep_level = sleep_level
        self._asleep: set[str] = set()  # which of {"weights", "kv_cache"} vLLM holds asleep now
        self._weights_dropped = False  # level-2 sleep discarded the weights and no load_weights followed
        self._loaded_version: int | None = None  # the version a transfer wrote into vLLM, while it holds it
        self.last_sleep_s = 0.0  # seconds the last sleep took (reported as rollout/sleep_s)
        self.last_wake_s = 0.0  # seconds spent waking up since the last sleep (weights + KV cache)
        engine_args = _engine_args(
            separate_process, async_scheduling, attention_backend, cuda, self.sleep_mode, dtype=dtype
        )
        engine_args |= cudagraph_args(cudagraph_capture_max, cuda)  # rollout.cudagraph_capture_max
        engine_args |= lora_engine_args(lora_rank)  # model.lora: serve the policy's adapter (vllm_lora.py)
        engine_args |= moe_backend_args(moe_backend)  # rollout.moe_backend: nothing for auto
        # rl.routing_replay=rollout: each completion carries the experts vLLM routed it to
        engine_args |= routed_experts_args(return_routed_experts, cuda)
        # a vision-language policy: image prompts (rollout/vllm_images.py), no video
        engine_args |= multimodal_engine_args(max_images_per_prompt)
        # one lane of a tensor-parallel replica under Ray (launch/rollout_lanes.py): external_launcher
        engine_args |= dict(launcher_args or {})
        plain = tensor_parallel_size == 1 and not (lora_rank or max_images_per_prompt or return_routed_experts)
        runner = model_runner_for(
            model_runner, cuda=cuda, architectures=model_architectures(model_dir), seeded=seed is not None,
            plain_text_engine=plain and not launcher_args, environment=os.environ,
        )  # fmt: skip
        choose_model_runner(runner)  # rollout.vllm_model_runner: V2 where posttrain checked it
        pad: Any = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD) if max_images_per_prompt > 0 else None
        self.image_pad_id: int | None = None if pad is None else int(pad)
        self.return_routed_experts = return_routed_experts
        self._repack_moe = not cuda
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
        self.model_runner = built_model_runner(self._llm, runner, model_runner)  # "v1" / "v2"
        self._shared = SharedWeightsSender(self._llm) if separate_process else None
        # a plain dense model on CUDA takes the weights in place (rollout/vllm_weight_load.py), then by
        # the copy plan the writer learns at the first such load (vllm_copy_plan.py)
        in_place = self._shared is None and all(self._llm.apply_model(functools.partial(loads_in_place, cuda=cuda)))
        self._writer = WeightWriter(in_place=in_place)
        # a seeded call: the engine's generators seeded once (call_seeds), or a seed per prompt
        workers = self._llm.llm_engine.vllm_config.parallel_config.world_size  # vLLM's TP x PP
        self.seeding = engine_seeding(call_seeds, separate_process=separate_process, vllm_workers=workers)
        self._rng_device = torch.cuda.current_device() if cuda else None  # where vLLM's sampler draws
        self._prefix_cache_empty = True  # nothing sampled since start or the last weight sync
        self._adapters = AdapterSync(self._llm, self.state) if lora_rank > 0 else None
        self.start_s = time.perf_counter() - start

    def _build(self, vllm: Any, **engine_args: Any) -> Any:
        llm, self._engine_threads = build_llm(vllm, **engine_args)
        return llm

    def _engine_thread_count(self) -> Any:
        return engine_thread_count(self._engine_threads)

    # -- shutdown ------------------------------------------------------------------------------
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
        adapters = getattr(self, "_adapters", None)
        if adapters is not None:
            adapters.close()
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
    @property
    def last_sync_phases(self) -> dict[str, float]:
        """Where the last transfer's time went with the engine core apart (``SharedWeightsSender``:
        ``attach_s``, ``copy_s``, ``worker_s``); empty in one process."""
        return dict(self._shared.last_phases) if self._shared is not None else {}

    @property
    def writes_by_copy_plan(self) -> bool:
        """Whether the next transfer is most likely one foreach copy in the engine core apart: its last
        one went by the copy plan and no sleep dropped the weights since. Any other write (the first,
        which goes through vLLM's weight loaders, or a reload) launches many small kernels with waits
        between them."""
        paths = self._shared.last_paths if self._shared is not None else []
        return bool(paths) and all(path == "plan" for path in paths) and not self._weights_dropped

    def holds(self, version: int) -> bool:
        """Whether vLLM holds the weights of ``version`` now (a transfer wrote them, no sleep dropped them)."""
        return self._loaded_version == version and not self._weights_dropped

    def receive_weights(self, weights: PolicyWeights, version: int) -> None:
        """The policy's current weights into the vLLM model (see ``load_weights``): its own tensors
        in one process, the gathered full tensors when it is sharded (a collective every rank's
        engine calls in step). A LoRA policy sends its adapter alone, as a new LoRA request.

        A version this engine already loaded and still holds is not sent again: the optimizer step
        skipped (every group tied) leaves the policy's weights, and their version, unchanged. Every
        rank skips alike (the version is the same on all), so no rank waits in a gather alone."""
        if self.holds(version):
            self.state.check_usable()
            self.last_sync_s = 0.0
            return
        if self._adapters is not None:
            self.wake_up()
            self._adapters.sync(weights.module, version)  # poisons the engine on a failure
            self.last_sync_s = self._adapters.last_sync_s
            self._commit(version)
            return
        self.load_weights(weights.full_state_dict(), version)

    def load_adapter(self, trained: Mapping[str, torch.Tensor], peft_config: Any, version: int) -> None:
        """A LoRA policy's adapter (its trained tensors, policy state-dict names) as a new LoRA request
        stamped ``version``: a disaggregated replica's weight sync (``rollout/replica_lora.py``). A
        failure poisons the engine, as in ``receive_weights``."""
        if self._adapters is None:
            raise TrainingError("load_adapter needs a vLLM engine built with LoRA (model.lora.rank > 0)")
        self.wake_up()
        self._adapters.load(trained, peft_config, version)
        self.last_sync_s = self._adapters.last_sync_s
        self._commit(version)

    def load_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Write the policy's Hugging Face-named tensors into the vLLM model; stamp ``version`` only
        once the whole transfer succeeded. Any failure poisons the engine (mixed weights)."""
        self.state.check_usable()
        # stacked expert parameters go per expert when the checkpoint names them so (models/moe.py)
        layout = checkpoint_layout(_pairs(named_tensors), self._checkpoint_names)
        named = [(name, tensor.detach()) for name, tensor in layout]
        missing = self._checkpoint_names - {name for name, _ in named}
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
                self._shared.push(self._cast(named), refill=self._weights_dropped)
            else:
                self._write_in_process(named)
            self._weights_dropped = False
            self.wake_up()
            self._llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
            self._prefix_cache_empty = True
        except Exception as err:
            raise self.state.poison(
                f"load_weights for version {version} failed ({type(err).__name__}: {err}); the vLLM weights are "
                "a mix of versions"
            ) from err
        self.last_sync_s = time.perf_counter() - start
        self._commit(version)

    def _cast(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        return [(name, as_engine_dtype(tensor, self.weight_dtype)) for name, tensor in named]

    def _reload(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's own reload (``reload_weights``, checkpoint format), and the MoE repack it skips on CPU."""
        with self._engine_thread_count():
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True})
            if self._repack_moe:  # vLLM's CPU build skips its MoE prepack on reloads (vllm_moe.py)
                self._llm.apply_model(repack_cpu_moe)

    def _write_in_process(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Write the transfer into the model in this process's engine core, the way ``WeightWriter``
        chose: one foreach copy by the copy plan (it casts fp32 master weights itself), the model's
        own weight loaders, or vLLM's reload."""
        cast = functools.cache(lambda: self._cast(named))  # only the loaders and the reload need it

        def load() -> list[str]:
            with self._engine_thread_count():
                return [name for names in self._llm.apply_model(load_in_place(cast())) for name in names]

        _, note = self._writer.write(
            named,
            load=load,
            reload=lambda: self._reload(cast()),
            learn=lambda: checked_copy_plan(self._llm, cast()),
            where="into vLLM's parameters",
            refill=self._weights_dropped,
        )
        if note is not None:
            _log.log(*note)

    def _commit(self, version: int) -> None:
        """Stamp ``version`` once a whole transfer of its weights succeeded, and remember that vLLM
        holds it (a stamp from a restored state, or the build's version 0, is not a transfer)."""
        self.state.commit(version)
        self._loaded_version = version

    # -- sampling ------------------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        params: SamplingParams,
        images: Sequence[Sequence[Any]] | None = None,
        banned_token_ids: Sequence[int] = (),
        *,
        first_prompt: int = 0,
    ) -> RolloutBatch:
        """``n`` completions per prompt, grouped by prompt (prompt 0's ``n`` first). ``images``: each
        prompt's decoded images in order, its ids expanded by the processor (an engine built with
        ``max_images_per_prompt``; ``rollout/vllm_images.py`` checks vLLM's expansion against them).
        ``banned_token_ids`` are never sampled (the vision special tokens of an image policy);
        ``first_prompt``: prompt 0's index in a call split over engines (``rollout/vllm_fleet.py``)."""
        pad_id = self.image_pad_id
        if images is not None and pad_id is None:
            raise TrainingError("image prompts need a vLLM engine built with max_images_per_prompt > 0")
        self.state.check_usable()
        check_generate_inputs(prompt_token_ids, n, params)
        check_params_for_mode(self.logprobs_mode, params)
        if self._weights_dropped:
            raise TrainingError(
                "the vLLM engine slept at level 2 (its weights were dropped) and no load_weights followed: "
                "call load_weights before generate, or use sleep_level=1"
            )
        self.wake_up()
        call_index = self.state.next_call()
        record = records_logprobs(params, self.weight_version)
        per_call = self.seeding == "call" and params.seed is not None
        owners, prompts, requests, recorded = call_requests(
            prompt_token_ids, n, params, call_index=call_index, eos_ids=self.eos_ids, record=record,
            seed_prompts=not per_call, first_prompt=first_prompt,
        )  # fmt: skip
        if images is not None and pad_id is not None:
            prompts = image_token_prompts(prompt_token_ids, images, owners, pad_id)
        ban_tokens(requests, banned_token_ids)
        seeded: Any = nullcontext()  # per call: the generators vLLM samples from, seeded for this call
        if per_call and params.seed is not None:
            seeded = generators_seeded(call_seed(params.seed, call_index), self._rng_device)
            # what earlier calls left cached would change how this call's prefill is split into steps,
            # hence which rows draw which numbers: every such call starts from an empty cache
            if not self._prefix_cache_empty:  # (a weight sync just emptied it: no second pass)
                self._llm.reset_prefix_cache()
        self._prefix_cache_empty = False
        start = time.perf_counter()
        with self._engine_thread_count(), seeded:
            lora = self._adapters.request if self._adapters is not None else None
            outputs = self._llm.generate(prompts, requests, use_tqdm=False, lora_request=lora)
        gen_s = time.perf_counter() - start
        if images is not None and pad_id is not None:
            check_engine_expansion(outputs, owners, prompt_token_ids, pad_id)
        completions = call_completions(owners, outputs, params.logprobs_topk, recorded)
        if self.return_routed_experts:
            attach_routed_experts(completions, owners, outputs)
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        for completion, text in zip(completions, texts):
            completion.text = text
        tokens = sum(len(c.token_ids) for c in completions)
        stats = generation_stats(tokens, gen_s)
        if self.sleep_mode:  # free the GPU for the policy update; load_weights / generate wake it
            self.sleep()
            stats["rollout/sleep_s"] = self.last_sleep_s
        return RolloutBatch([list(p) for p in prompt_token_ids], completions, self.weight_version, stats)


def as_engine_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A floating tensor in the engine's dtype (fp32 master weights -> the bf16 engine); others as they are."""
    if dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def _engine_args(
    separate_process: bool,
    async_scheduling: bool | None,
    attention_backend: str | None,
    cuda: bool,
    sleep_mode: bool,
    *,
    dtype: str = "auto",
) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments that depend on the platform and the engine's options (on CUDA the
    attention backend: ``vllm_runtime.cuda_attention_backend``)."""
    engine_args: dict[str, Any] = {}
    if separate_process:
        engine_args["worker_extension_cls"] = WORKER_EXTENSION
    if async_scheduling is not None:
        engine_args["async_scheduling"] = async_scheduling
    if cuda:
        engine_args.update(cuda_attention_backend(attention_backend, dtype))
        if sleep_mode:
            engine_args["enable_sleep_mode"] = True
    return engine_args


def _pairs(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    return named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
