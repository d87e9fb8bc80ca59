"""``rollout.cuda_graphs`` on CUDA: the recorded decode step replays what the same step computes eagerly, reads
the policy's current weights at every call, agrees with the engine's eager decode (its step compiled too), and a
GRPO run uses it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 8, 2], [9, 4, 61], [12, 7, 7, 40, 3, 21, 6]]


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")


def _engine(model_dir: str, *, mixed: bool, record: bool | None, sharpen: float = 1.0) -> Any:
    """An hf engine on CUDA over a fresh load of ``model_dir``: fp32 weights computing in bf16 (``mixed``) or
    in fp32; its decode recorded (``record=True``), the static step run eagerly (False) or eager (None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models.precision import Precision
    from posttrain.rollout.graphed_decode import DecodeGraphs
    from posttrain.rollout.hf_engine import HFRolloutEngine, _graph_draw

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").cuda().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    precision = Precision(torch.float32, torch.bfloat16) if mixed else None
    engine = HFRolloutEngine(model, AutoTokenizer.from_pretrained(model_dir), precision=precision)
    assert engine.graphs is not None, engine.decode_note  # auto graphs a llama on CUDA
    engine.graphs = (
        None if record is None else DecodeGraphs(model, precision, engine.eos_ids, _graph_draw, record=record)
    )
    return engine


def _tokens(batch: Any) -> list[list[int]]:
    return [c.token_ids for c in batch.completions]


def test_the_replayed_graph_draws_what_the_step_draws_eagerly(tiny_model_dir: str) -> None:
    """Bit for bit: the same kernels, recorded or launched one by one; a second call (other prompts, the
    same slot bucket) replays the same graph."""
    from posttrain.rollout.base import SamplingParams

    graphed = _engine(tiny_model_dir, mixed=True, record=True)
    stepped = _engine(tiny_model_dir, mixed=True, record=False)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    for prompts in (PROMPTS, [[*p[::-1], 11] for p in PROMPTS]):
        got, want = graphed.generate(prompts, 4, params), stepped.generate(prompts, 4, params)
        assert _tokens(got) == _tokens(want)
        assert [c.logprobs for c in got.completions] == [c.logprobs for c in want.completions]
    assert len(graphed.graphs.graphs) == 1
    assert len({tuple(t) for t in _tokens(got)}) > 1


def test_the_graph_reads_the_weights_of_each_call(tiny_model_dir: str) -> None:
    """An in-place change of the fp32 parameters (what the optimizer does) reaches the recorded decode
    through its compute-dtype copies at the next call: it draws what a fresh eager step draws."""
    from posttrain.rollout.base import SamplingParams

    graphed = _engine(tiny_model_dir, mixed=True, record=True, sharpen=30.0)
    stepped = _engine(tiny_model_dir, mixed=True, record=False, sharpen=30.0)
    params = SamplingParams(max_tokens=16, temperature=0.0, seed=0)
    before = _tokens(graphed.generate(PROMPTS, 1, params))
    with torch.no_grad():
        for engine in (graphed, stepped):
            for param in engine.model.parameters():
                param.add_(torch.randn_like(param, generator=torch.Generator("cuda").manual_seed(1)) * 0.05)
    after = _tokens(graphed.generate(PROMPTS, 1, params))
    assert after == _tokens(stepped.generate(PROMPTS, 1, params))
    assert after != before


def test_graphed_greedy_decode_matches_the_eager_engine_in_fp32(tiny_model_dir: str) -> None:
    """fp32 on CUDA, greedy: the graphed decode's tokens are the transformers engine's eager ones."""
    from posttrain.rollout.base import SamplingParams

    graphed = _engine(tiny_model_dir, mixed=False, record=True, sharpen=30.0)
    eager = _engine(tiny_model_dir, mixed=False, record=None, sharpen=30.0)
    params = SamplingParams(max_tokens=20, temperature=0.0, seed=0)
    got, want = graphed.generate(PROMPTS, 2, params), eager.generate(PROMPTS, 2, params)
    assert _tokens(got) == _tokens(want)
    for g, w in zip(got.completions, want.completions):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)


def test_the_compiled_step_records_and_decodes_as_the_eager_engine(tiny_model_dir: str) -> None:
    """``DecodeGraphs(compiled=True)``, the benchmark arm: the step through torch.compile (Triton kernels) is
    recorded and replayed, and in fp32 decodes greedily as the eager engine does; a second call replays it."""
    from posttrain.rollout.base import SamplingParams

    graphed = _engine(tiny_model_dir, mixed=False, record=True, sharpen=30.0)
    graphed.graphs.compiled = True
    eager = _engine(tiny_model_dir, mixed=False, record=None, sharpen=30.0)
    params = SamplingParams(max_tokens=20, temperature=0.0, seed=0)
    for _ in range(2):
        got, want = graphed.generate(PROMPTS, 2, params), eager.generate(PROMPTS, 2, params)
        assert _tokens(got) == _tokens(want)
        for g, w in zip(got.completions, want.completions):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)
    assert len(graphed.graphs.graphs) == 1 and graphed.graphs.graphs.popitem()[1][1] is not None


def test_a_grpo_run_samples_through_the_graphs(tiny_model_dir: str, grpo_run: Callable[..., Any]) -> None:
    _, run_dir, records = grpo_run(tiny_model_dir, "rollout.cuda_graphs=true")
    assert [r["step"] for r in records] == [1, 2, 3]
    log = (run_dir / "train.log").read_text()
    assert "rollout: transformers engine, decode replayed as CUDA graphs (rollout.cuda_graphs)" in log
