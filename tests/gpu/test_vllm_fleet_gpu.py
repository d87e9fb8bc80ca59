"""Two vLLM engines on one CUDA GPU as one rollout engine (``rollout.engines_per_device=2``,
``rollout/vllm_fleet.py``), bf16: the trainer's fp32 master weights reach both engines' workers (each
through its own CUDA IPC buffer), both then sample with exactly those weights, and a restored call
counter replays a call. On the CPU the fleet draws exactly what one engine draws
(tests/integration/test_vllm_fleet.py); on a GPU the kernels may round differently per batch size,
so that comparison is reported here, not asserted.

A file of its own because vLLM decides where an engine core runs once per process (docs/vllm.md):
run it in a pytest process of its own on the device machine (``benchmarks/side_by_side.sh tests31``). It
loads the embedded SmolLM2: on W's random 0.4B model a replayed call's draws differed (a nearly flat next-token
distribution flips on a logit rounded differently, most likely where the replayed prompts hit the prefix
cache; thirtieth session).
"""

from __future__ import annotations

import pytest
import torch
from engine_weights import assert_samples_with, gpu_model_dir, moved, trainer_side

from posttrain.distributed.fsdp import PolicyWeights
from posttrain.rollout.base import SamplingParams

pytestmark = pytest.mark.gpu


def test_two_engines_take_the_weights_and_replay_a_call(trainer_logprobs) -> None:
    model_dir = gpu_model_dir()
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine
    from posttrain.rollout.vllm_fleet import VLLMEngineFleet
    from posttrain.rollout.vllm_runtime import engine_core_is_separate

    side = trainer_side(model_dir, 5)
    prompts, masters = side.prompts, side.masters

    def member(share: float) -> VLLMRolloutEngine:
        return VLLMRolloutEngine(
            model_dir, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=share, max_model_len=1024,
            seed=0, separate_process=True,
        )  # fmt: skip

    fleet = VLLMEngineFleet(member, 2, 0.3)
    try:
        assert all(engine_core_is_separate(m._llm) for m in fleet.members)
        moved(masters)
        # the loaders at the first sync (one engine after the other), the copy plan from the second, and from
        # the third on the engines are written at once
        syncs_s = []
        for version, by_plan in ((1, False), (2, True), (3, True)):
            fleet.receive_weights(PolicyWeights(masters), version=version)
            assert [m.writes_by_copy_plan for m in fleet.members] == [by_plan] * 2, version
            syncs_s.append(round(fleet.last_sync_s, 4))
        print(f"fleet syncs (s): {syncs_s}")  # reported: the first one engine after the other
        params = SamplingParams(max_tokens=24, seed=5)
        fleet.load_state_dict({"generate_calls": 3})
        batch = fleet.generate(prompts, 4, params)
        assert batch.weight_version == 3 and [c.prompt_index for c in batch.completions] == [
            p for p in range(5) for _ in range(4)
        ]
        assert_samples_with(batch, masters.to(torch.bfloat16), side.base, side.pad_id, trainer_logprobs)
        fleet.load_state_dict({"generate_calls": 3})
        again = fleet.generate(prompts, 4, params)
        assert [c.token_ids for c in again.completions] == [c.token_ids for c in batch.completions]
        # one engine given every prompt at the same call: reported (batch-size rounding may differ on a GPU)
        alone = fleet.members[0]
        alone.load_state_dict({"generate_calls": 3})
        one = alone.generate(prompts, 4, params)
        same = sum(a.token_ids == b.token_ids for a, b in zip(one.completions, batch.completions))
        print(f"fleet vs one engine: {same} of {len(batch.completions)} completions identical")
    finally:
        fleet.close()
