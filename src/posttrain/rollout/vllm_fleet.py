"""Several vLLM engines sharing one device, used as one rollout engine (``rollout.engines_per_device``).

Why: decoding a small model, vLLM's engine core spends most of each step on the host (scheduling,
the model runner's input preparation), one thread of one process, while the GPU waits. Two engine
cores in two processes overlap that host work: W's generation (32 prompts x 8 samples x 256 tokens,
0.4B shape) took 0.90 s in two bare engine processes on one H100 against 1.26-1.40 s in one, and
1.46 s in four, which time-slice the GPU (docs/benchmarks.md, twenty-eighth session).

How: each member is a ``VLLMRolloutEngine`` with its engine core in a process of its own
(``separate_process``) and ``gpu_memory_utilization / N`` of the device. A ``generate`` call splits
its prompts into N contiguous runs (sizes differing by at most one, ``split_prompts``); each member
samples its run in a thread of this process, which mostly waits on the member's engine process
(with every engine core apart, nothing process-wide here, such as torch's thread count, changes).
Each prompt's request seed is keyed on its index in the whole call (``first_prompt``) and every
member samples as call ``i`` of the fleet's counter, so the seeds, and what a checkpoint stores
(the call counter), do not depend on the number of engines. On the CPU the batch, put back in
prompt order, is exactly what one engine draws for the same call; on a GPU the kernels may round a
logit differently at another batch size, so a token can differ there (a replay with the same N and
the same prompts draws the same batch).

Weights: gathered once (``PolicyWeights.full_state_dict``, a collective when sharded), cast once to
the engines' dtype, and written into every member (each through its own shared buffer); the fleet
stamps the version only once every member holds it, and a failure in any member poisons the fleet.
Members whose writes are one foreach copy (the copy plan, from the second sync on) are written at once;
any other write goes one member after another: the first sync goes through vLLM's weight loaders, many
small kernels with host waits between them, and two processes doing that at once take turns on the GPU
in time slices, each wait a slice long (W's 0.4B model on one H100: 3.7 s each at once, 0.17-0.24 s each
one after the other; docs/benchmarks.md, thirty-first session).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from posttrain.errors import TrainingError
from posttrain.rollout.base import RolloutBatch, SamplingParams, check_generate_inputs, generation_stats
from posttrain.rollout.state import CALLS_KEY, RESUME_HINT, EngineState, HoldsEngineState
from posttrain.rollout.vllm_engine import as_engine_dtype

if TYPE_CHECKING:
    from posttrain.distributed.fsdp import PolicyWeights
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

T = TypeVar("T")


def split_prompts(count: int, parts: int) -> list[range]:
    """``count`` prompt indices in ``parts`` contiguous runs whose sizes differ by at most one (the
    first runs take the extra ones; runs may be empty when there are fewer prompts than parts)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    size, extra = divmod(count, parts)
    runs, start = [], 0
    for part in range(parts):
        stop = start + size + (1 if part < extra else 0)
        runs.append(range(start, stop))
        start = stop
    return runs


class VLLMEngineFleet(HoldsEngineState):
    """N ``VLLMRolloutEngine``s on one device behind the ``RolloutEngine`` protocol (``ResumableEngine``:
    the fleet's call counter is what a checkpoint stores)."""

    def __init__(self, build: Callable[[float], VLLMRolloutEngine], engines: int, gpu_memory_utilization: float):
        """``build(share)`` starts one member with its engine core in a process of its own, on ``share``
        of the device's memory; members start one after another (vLLM sizes its KV cache from the
        memory free when it starts)."""
        if engines < 2:
            raise ValueError(f"a fleet has at least 2 engines, got {engines}")
        start = time.perf_counter()
        self.members: list[VLLMRolloutEngine] = []
        try:
            for _ in range(engines):
                self.members.append(build(gpu_memory_utilization / engines))
        except BaseException:
            self.close()
            raise
        first = self.members[0]
        self.logprobs_mode, self.seeding, self.model_runner = first.logprobs_mode, first.seeding, first.model_runner
        self.state = EngineState(f"the {engines} vLLM engines cannot be used: {{reason}}. " + RESUME_HINT)
        self._pool = ThreadPoolExecutor(max_workers=engines, thread_name_prefix="vllm-fleet")
        self.last_sync_s = 0.0
        self.start_s = time.perf_counter() - start

    def _each(self, work: Callable[[int, VLLMRolloutEngine], T]) -> list[T]:
        """``work(i, member)`` for every member at once; every one finishes before the first error is raised."""
        futures = [self._pool.submit(work, i, member) for i, member in enumerate(self.members)]
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return [f.result() for f in futures]

    # -- shutdown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut every member down (each its engine process)."""
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        members, self.members = self.members, []
        for member in members:
            member.close()

    # -- weights -------------------------------------------------------------------------------
    def receive_weights(self, weights: PolicyWeights, version: int) -> None:
        """The policy's weights into every member (gathered once); stamped once all hold them. A
        version every member already holds is not sent again (an optimizer step that was skipped)."""
        self.state.check_usable()
        if all(member.holds(version) for member in self.members):
            self.last_sync_s = 0.0
            return
        start = time.perf_counter()
        # cast once for every member (fp32 master weights -> the engines' bf16): their own cast then passes
        dtype = self.members[0].weight_dtype
        full = {name: as_engine_dtype(tensor, dtype) for name, tensor in weights.full_state_dict().items()}
        try:
            if all(member.writes_by_copy_plan for member in self.members):
                self._each(lambda _i, member: member.load_weights(full, version))
            else:  # one after another: see the module's docstring
                for member in self.members:
                    member.load_weights(full, version)
        except Exception as err:
            raise self.state.poison(
                f"the weights of version {version} reached only some of the engines ({type(err).__name__}: {err})"
            ) from err
        self.last_sync_s = time.perf_counter() - start
        self.state.commit(version)

    # -- sampling ------------------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        params: SamplingParams,
        images: Sequence[Sequence[Any]] | None = None,
        banned_token_ids: Sequence[int] = (),
    ) -> RolloutBatch:
        """``n`` completions per prompt, grouped by prompt: each member samples a contiguous run of
        the prompts as call ``i`` of the fleet, seeded by the prompts' places in the whole call."""
        if images is not None:
            raise TrainingError("rollout.engines_per_device > 1 samples text prompts only; set it to 1")
        self.state.check_usable()
        check_generate_inputs(prompt_token_ids, n, params)
        call_index = self.state.next_call()
        runs = split_prompts(len(prompt_token_ids), len(self.members))

        def sample(i: int, member: VLLMRolloutEngine) -> RolloutBatch | None:
            run = runs[i]
            if not run:  # fewer prompts than engines (its counter is set again before its next call)
                return None
            member.load_state_dict({CALLS_KEY: call_index})
            ids = prompt_token_ids[run.start : run.stop]
            return member.generate(ids, n, params, banned_token_ids=banned_token_ids, first_prompt=run.start)

        start = time.perf_counter()
        parts = self._each(sample)
        gen_s = time.perf_counter() - start
        completions = []
        for run, part in zip(runs, parts):
            if part is None:
                continue
            if part.weight_version != self.weight_version:
                raise self.state.poison(
                    f"an engine sampled with the weights of version {part.weight_version}, the fleet holds "
                    f"{self.weight_version}"
                )
            for completion in part.completions:
                completion.prompt_index += run.start
                completions.append(completion)
        stats = generation_stats(sum(len(c.token_ids) for c in completions), gen_s)
        sleeps = [p.stats["rollout/sleep_s"] for p in parts if p is not None and "rollout/sleep_s" in p.stats]
        if sleeps:
            stats["rollout/sleep_s"] = max(sleeps)
        return RolloutBatch([list(p) for p in prompt_token_ids], completions, self.weight_version, stats)
