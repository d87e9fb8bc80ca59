"""How the vLLM rollout engine makes a seeded ``generate`` call draw the same completions again.

Two schemes, both keyed on ``(params.seed, call index)`` so that the engine's call counter
(``rollout/state.py``) is the whole sampling-stream position a checkpoint has to store:

- ``call`` (``rollout.per_prompt_seeds=false``; vLLM's CPU build only): the process's default
  generators, CPU and the engine's CUDA device, are seeded from ``(seed, call index)`` right before
  ``LLM.generate`` and the requests go unseeded, so vLLM samples the whole batch at once from those
  generators (its CPU sampler draws one row seed per step from the CPU generator; its CUDA sampler
  draws the exponential noise from the device's). The generators get back what they held afterwards,
  so the trainer's own stream does not move. A call then draws the same tokens whenever it runs with
  the same weights, prompts, previous-call history since the last weight sync and engine settings:
  the batch is scheduled the same way every time (vLLM's scheduler is deterministic). It holds only
  where vLLM's sampler runs in this process and nothing else draws from these generators while it
  samples: the engine core in this process, one vLLM worker, and no trainer running meanwhile in
  another thread (one-step off-policy). What a prompt draws then depends on the whole call (the
  other prompts and their order), not on the prompt alone.
- ``prompt``: one vLLM request seed per prompt (``prompt_seed``), which vLLM samples with one
  ``torch.Generator`` per request, row by row. A prompt's draws do not depend on the rest of the
  call. The default, and used wherever ``call`` does not hold.

On CUDA ``call`` did not replay (vLLM 0.24, one H200: tests/gpu/test_vllm_gpu.py drew other tokens
after a restored call counter) and was no faster at issue 9's workload, so a CUDA engine refuses it
(``rollout/vllm_engine.py``); docs/vllm.md, "Seeding".
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig

Seeding = Literal["call", "prompt"]


def call_seed(seed: int, call_index: int) -> int:
    """A 63-bit generator seed per (seed, call): what ``call`` seeding gives the engine's generators."""
    digest = hashlib.sha256(f"posttrain-vllm-call:{seed}:{call_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def wants_call_seeds(cfg: RunConfig) -> bool:
    """Whether the config's vLLM engine seeds per call (from the config alone: the resume identity
    needs the answer before any engine exists). ``rollout.seed=null`` seeds nothing at all."""
    ro = cfg.rollout
    return (
        ro.backend == "vllm"
        and ro.seed is not None
        and not ro.per_prompt_seeds
        and not ro.separate_engine_process  # the sampler's generators live in the other process
        and ro.tensor_parallel_size == 1  # several vLLM workers: the sampler runs in each of them
        and cfg.rl.max_off_policy_steps == 0  # the trainer would run in another thread meanwhile
    )


def engine_seeding(call_seeds: bool, *, separate_process: bool, vllm_workers: int) -> Seeding:
    """The scheme an engine built with ``call_seeds`` uses: ``call`` only where vLLM's sampler
    draws from this process's generators: engine core here, one vLLM worker (``vllm_workers``:
    vLLM's tensor x pipeline parallel width, not posttrain's processes)."""
    return "call" if call_seeds and not separate_process and vllm_workers == 1 else "prompt"


def seeding_note(seeding: Seeding) -> str:
    """How an engine start line states the scheme."""
    if seeding == "call":
        return "seeding=per call (engine generators seeded per generate call, batched sampling)"
    return "seeding=per prompt (one vLLM request seed per prompt)"


@contextmanager
def generators_seeded(seed: int, cuda_device: int | None) -> Iterator[None]:
    """The default CPU generator (and ``cuda_device``'s) seeded with ``seed`` inside, as before outside."""
    cpu_state = torch.random.default_generator.get_state()
    cuda_state = torch.cuda.get_rng_state(cuda_device) if cuda_device is not None else None
    torch.random.default_generator.manual_seed(seed)
    if cuda_device is not None:
        torch.cuda.default_generators[cuda_device].manual_seed(seed)
    try:
        yield
    finally:
        torch.random.default_generator.set_state(cpu_state)
        if cuda_device is not None and cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, cuda_device)
