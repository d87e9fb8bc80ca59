"""Sparse-MoE routing replay on a CUDA GPU with vLLM (0.24 on the device): the routed experts vLLM
returns, their alignment with the trainer's own routing, expert-weight sync, and GRPO steps end to
end with ``rl.routing_replay=rollout``. vLLM's CPU build cannot return routing, so none of this runs
on CPU.

Runs a vLLM engine in the test process: ``pytest -m gpu tests/gpu/test_moe_gpu.py`` in a pytest
process of its own, on the device machine (needs the vLLM kit of benchmarks/device_gpu_tests.sh).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.distributed.fsdp import PolicyWeights
from posttrain.models.routing_replay import record_routing
from posttrain.models.tiny import make_tiny_moe_model
from posttrain.rollout.base import SamplingParams

pytestmark = pytest.mark.gpu

TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "smollm2_tokenizer"
PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5, 100, 200, 300], [42, 43, 44]]
LAYERS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    pytest.importorskip("vllm", reason="vLLM is not installed (see docs/vllm.md)")
    return make_tiny_moe_model(str(tmp_path_factory.mktemp("moe")), str(TOKENIZER), num_layers=LAYERS, top_k=TOP_K)


@pytest.fixture(scope="module")
def engine(moe_dir: str) -> Iterator[object]:
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    eng = VLLMRolloutEngine(
        moe_dir, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=512,
        return_routed_experts=True,
    )  # fmt: skip
    yield eng
    eng.close()


def test_vllm_returns_the_routing_of_every_position_it_ran(engine, moe_dir: str) -> None:
    out = engine.generate(PROMPTS, 2, SamplingParams(max_tokens=12, seed=1))
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.bfloat16).cuda().eval()
    agree, total = 0, 0
    for c in out.completions:
        prompt = out.prompt_token_ids[c.prompt_index]
        experts = c.extra["routed_experts"]
        assert experts.shape == (len(prompt) + len(c.token_ids) - 1, LAYERS, TOP_K)
        with record_routing(model) as rec, torch.no_grad():
            model(torch.tensor([prompt + c.token_ids], device="cuda"))
        own = rec[0][:-1].cpu().sort(-1).values
        agree += int((own == experts.long().sort(-1).values).all(-1).sum())
        total += own.shape[0] * LAYERS
    assert agree / total > 0.8  # the same weights route alike, except near-ties across kernels


def test_expert_weight_sync_moves_the_routing_and_logprobs(engine, moe_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(-1)  # reverses every router's ranking
    params = SamplingParams(max_tokens=8, seed=2)
    before = engine.generate(PROMPTS, 1, params)
    engine.receive_weights(PolicyWeights(model), version=1)
    after = engine.generate(PROMPTS, 1, params)
    changed = sum(
        not torch.equal(a.extra["routed_experts"][: len(p)], b.extra["routed_experts"][: len(p)])
        for a, b, p in zip(before.completions, after.completions, PROMPTS)
    )
    assert changed == len(PROMPTS)  # the prompt positions now route elsewhere: the new router arrived


def test_grpo_with_routing_replay_end_to_end(moe_dir: str, grpo_run: Callable[..., Any]) -> None:
    _, _, records = grpo_run(
        moe_dir,
        "rl.mini_batch_per_replica=8",
        "rollout.backend=vllm",
        "rollout.enforce_eager=true",
        "rollout.max_tokens=16",
        "rl.routing_replay=rollout",
    )
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # every prompt and completion token pinned (completion tokens alone are fewer)
        assert r["train/routing_replay_pinned_tokens"] > r["train/valid_token_count"] > 0


def test_a_moe_engine_after_a_dense_one_in_one_process(moe_dir: str, tmp_path: Path) -> None:
    """A dense engine, then an MoE one, in a fresh process (a dense student's rollout engine, then an
    MoE teacher): vLLM makes its parallel groups with the first engine, without the expert group the
    MoE layers ask for (vllm_runtime.complete_expert_group; the CPU build's check is in
    tests/integration/test_moe_vllm.py). bf16 on both sides, different kernels: the gaps are
    test_vllm_gpu.py's."""
    import json
    import subprocess
    import sys

    from posttrain.models.tiny import make_tiny_model

    dense = make_tiny_model(str(tmp_path / "dense"), str(TOKENIZER), num_heads=2, num_kv_heads=1)
    script = Path(__file__).resolve().parents[1] / "integration" / "moe_after_dense.py"
    proc = subprocess.run(
        [sys.executable, str(script), dense, moe_dir, "bfloat16", "cuda", "0.1"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    gaps = json.loads(proc.stdout.strip().splitlines()[-1])
    assert gaps["tokens"] > 0 and gaps["gap_mean"] < 0.1 and gaps["gap_max"] < 1.0, gaps
