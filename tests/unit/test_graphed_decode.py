"""``rollout/graphed_decode.py`` on the CPU: the static decode step (what a CUDA graph records) run eagerly,
against the transformers engine's own decode, for each supported family; which models it takes; the
``rollout.cuda_graphs`` rules. Recording and replaying the graph needs CUDA: tests/gpu/test_graphed_decode_gpu.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.rollout.base import SamplingParams

PROMPTS = [[5, 17, 33, 8, 2], [9, 4, 61], [12, 7, 7, 40, 3, 21, 6]]  # unequal lengths: left padding is masked


def _engines(
    family: str, tokenizer_dir: str, tmp_path: Path, *, sharpen: float = 40.0, **engine: Any
) -> tuple[Any, Any]:
    """An eager hf engine and one whose decode runs the static step eagerly, over one tiny model of ``family``
    whose LM head is scaled by ``sharpen``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models.tiny import make_tiny_model
    from posttrain.rollout.graphed_decode import DecodeGraphs
    from posttrain.rollout.hf_engine import HFRolloutEngine, _graph_draw

    model_dir = make_tiny_model(str(tmp_path / family), tokenizer_dir, family=family, hidden_size=64, seed=3)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():  # sharper logits than the init's: greedy choices without near ties
        model.lm_head.weight.mul_(sharpen)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eager = HFRolloutEngine(model, tokenizer, **engine)
    static = HFRolloutEngine(model, tokenizer, **engine)
    assert eager.graphs is None and static.graphs is None  # on the CPU, auto decodes eagerly
    static.graphs = DecodeGraphs(model, None, static.eos_ids, _graph_draw, record=False)
    return eager, static


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_static_step_decodes_greedily_as_the_engine_does(
    family: str, smollm2_tokenizer_dir: str, tmp_path: Path
) -> None:
    """Same prompts, greedy: the same tokens, and sampler logprobs within float rounding, from the static
    cache, the grouped-query attention over it and the per-row positions of left-padded prompts."""
    eager, static = _engines(family, smollm2_tokenizer_dir, tmp_path)
    params = SamplingParams(max_tokens=12, temperature=0.0, seed=1)
    want = eager.generate(PROMPTS, 2, params)
    got = static.generate(PROMPTS, 2, params)
    assert len(got.completions) == 6
    for w, g in zip(want.completions, got.completions):
        assert g.token_ids == w.token_ids
        assert g.prompt_index == w.prompt_index and g.finish_reason == w.finish_reason
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=2e-5, rtol=0)
    # the draws were not all one token: the test would pass on a model that ignores its input otherwise
    assert len({tuple(c.token_ids) for c in got.completions}) > 1


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="Inductor's CPU code needs a C++ compiler"
)
def test_the_compiled_static_step_decodes_as_the_engine_does(smollm2_tokenizer_dir: str, tmp_path: Path) -> None:
    """``DecodeGraphs(compiled=True)`` (a benchmark arm: the step through torch.compile before it is recorded):
    Inductor traces the whole step, draw and cache writes included, and it decodes greedily as the eager engine
    does, token for token, its logprobs within float rounding."""
    from torch._dynamo.utils import counters

    eager, static = _engines("llama", smollm2_tokenizer_dir, tmp_path)
    assert static.graphs is not None
    static.graphs.compiled = True
    counters.clear()
    params = SamplingParams(max_tokens=12, temperature=0.0, seed=1)
    want = eager.generate(PROMPTS, 2, params)
    got = static.generate(PROMPTS, 2, params)
    assert counters["stats"]["unique_graphs"] >= 1  # Dynamo traced the step (not silently eager)
    for w, g in zip(want.completions, got.completions):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)
    assert len({tuple(c.token_ids) for c in got.completions}) > 1


def test_rows_stop_at_their_eos_and_nothing_after_it_is_recorded(smollm2_tokenizer_dir: str, tmp_path: Path) -> None:
    """With half the vocabulary as EOS ids, rows end at different steps: each completion ends on its first
    EOS id ("stop") or runs to max_tokens ("length"), as the eager engine's do, token for token."""
    vocab = 49152
    eos = list(range(0, vocab, 2))
    eager, static = _engines("llama", smollm2_tokenizer_dir, tmp_path, eos_ids=eos)
    params = SamplingParams(max_tokens=20, temperature=0.0, seed=0)
    want = eager.generate(PROMPTS, 1, params)
    got = static.generate(PROMPTS, 1, params)
    assert [c.token_ids for c in got.completions] == [c.token_ids for c in want.completions]
    lengths = {len(c.token_ids) for c in got.completions}
    assert len(lengths) > 1 or lengths == {1}
    for completion in got.completions:
        ids = completion.token_ids
        assert all(t % 2 == 1 for t in ids[:-1])  # no EOS before the last token
        assert (completion.finish_reason == "stop") == (ids[-1] % 2 == 0)
        assert len(completion.logprobs) == len(ids)


def test_sampling_is_reproducible_and_follows_the_seed(smollm2_tokenizer_dir: str, tmp_path: Path) -> None:
    """Temperature 1, top-k, top-p and a repetition penalty through the static step: a fresh engine with
    the same seed draws the same tokens; another seed draws others; each logprob is the tempered raw one."""
    _, first = _engines("llama", smollm2_tokenizer_dir, tmp_path / "a", sharpen=1.0)
    _, again = _engines("llama", smollm2_tokenizer_dir, tmp_path / "b", sharpen=1.0)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=500, top_p=0.95, repetition_penalty=1.2, seed=7)
    a = first.generate(PROMPTS, 4, params)
    b = again.generate(PROMPTS, 4, params)
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
    other = again.generate(PROMPTS, 4, SamplingParams(**{**params.__dict__, "seed": 8}))
    assert [c.token_ids for c in other.completions] != [c.token_ids for c in a.completions]
    for completion in a.completions:
        assert all(lp <= 0.0 for lp in completion.logprobs)
        assert len(set(completion.token_ids)) > 1  # the draws move


def test_which_models_the_graphed_decode_takes(smollm2_tokenizer_dir: str, tmp_path: Path) -> None:
    from transformers import (
        AutoModelForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from posttrain.models.tiny import make_tiny_model
    from posttrain.rollout.graphed_decode import decode_graph_support

    llama = AutoModelForCausalLM.from_pretrained(make_tiny_model(str(tmp_path / "l"), smollm2_tokenizer_dir))
    assert decode_graph_support(llama) is None
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert "model_type 'gpt2'" in (decode_graph_support(gpt2) or "")
    windowed = Qwen2ForCausalLM(
        Qwen2Config(
            num_hidden_layers=1,
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            vocab_size=64,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=0,
        )
    )
    assert decode_graph_support(windowed) == "sliding-window attention"
    # Mistral's layers hold no window: its forward reads the config's at every call (Mistral-7B-v0.1: 4,096)
    mistral = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
    mistral |= {"intermediate_size": 64, "vocab_size": 64}
    assert decode_graph_support(MistralForCausalLM(MistralConfig(**mistral, sliding_window=4096))) == (
        "sliding-window attention"
    )
    assert decode_graph_support(MistralForCausalLM(MistralConfig(**mistral, sliding_window=None))) is None


def test_auto_decodes_eagerly_off_cuda_and_true_refuses(smollm2_tokenizer_dir: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from posttrain.errors import ConfigError
    from posttrain.models.tiny import make_tiny_model
    from posttrain.rollout.graphed_decode import decode_graphs_choice

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(str(tmp_path), smollm2_tokenizer_dir))
    assert decode_graphs_choice("auto", model) == (
        False,
        "decode eager (rollout.cuda_graphs=auto: the model is not on CUDA)",
    )
    assert decode_graphs_choice(False, model)[0] is False
    with pytest.raises(
        ConfigError, match=r"rollout\.cuda_graphs=true cannot graph this decode: the model is not on CUDA"
    ):
        decode_graphs_choice(True, model)


def test_the_preflight_refuses_rollout_cuda_graphs_where_it_cannot_run(
    smollm2_tokenizer_dir: str, tmp_path: Path
) -> None:
    from posttrain.config.schema import GRPOConfig
    from posttrain.models.tiny import make_tiny_model
    from posttrain.preflight.cuda_graphs import check_rollout_cuda_graphs
    from posttrain.preflight.findings import Findings

    cfg = GRPOConfig()
    cfg.model.name_or_path = make_tiny_model(str(tmp_path), smollm2_tokenizer_dir)
    cfg.rollout.cuda_graphs = True
    cfg.model.device = "cpu"
    out = Findings()
    check_rollout_cuda_graphs(cfg, out, cuda_major=13)
    assert len(out.errors) == 1 and "rollout.cuda_graphs=true records CUDA graphs, but" in out.errors[0]
    cfg.model.device = "auto"
    out = Findings()
    check_rollout_cuda_graphs(cfg, out, cuda_major=13)  # a CUDA build, a llama: nothing to say
    assert out.errors == []
    cfg.rollout.backend = "vllm"
    out = Findings()
    check_rollout_cuda_graphs(cfg, out, cuda_major=13)
    assert out.errors == [
        "rollout.cuda_graphs=true graphs the hf engine's decode; rollout.backend=vllm records its own; "
        "set rollout.cuda_graphs=auto"
    ]
    cfg.rollout.cuda_graphs = "auto"  # auto is never refused
    out = Findings()
    check_rollout_cuda_graphs(cfg, out, cuda_major=None)
    assert out.errors == []


def test_a_failed_recording_decodes_eagerly_under_auto_and_raises_under_true(
    smollm2_tokenizer_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto``: the call that could not record its step decodes eagerly, as the engine without graphs does,
    and later calls too; ``true``: the run stops with the knob named."""
    from posttrain.errors import TrainingError
    from posttrain.rollout.graphed_decode import DecodeGraphs
    from posttrain.rollout.hf_engine import _graph_draw

    def fail(_self: Any, _static: Any) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "_record", fail)
    eager, static = _engines("llama", smollm2_tokenizer_dir, tmp_path)
    model = static.model
    static.graphs = DecodeGraphs(model, None, static.eos_ids, _graph_draw)  # auto: record, which fails
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=2)
    assert _tokens(static.generate(PROMPTS, 2, params)) == _tokens(eager.generate(PROMPTS, 2, params))
    assert static.graphs is None
    static.graphs = DecodeGraphs(model, None, static.eos_ids, _graph_draw, forced=True)
    with pytest.raises(TrainingError, match=r"rollout\.cuda_graphs=true: recording the decode step failed"):
        static.generate(PROMPTS, 2, params)


def _tokens(batch: Any) -> list[list[int]]:
    return [c.token_ids for c in batch.completions]


def test_mixed_precision_copies_follow_replaced_parameters(smollm2_tokenizer_dir: str, tmp_path: Path) -> None:
    """fp32 weights computing in bf16: the decode reads the engine's bf16 copies, refreshed every call; a
    parameter replaced by a new object (a load with ``assign=True``, say) gets a new copy and drops the
    recorded shapes instead of reading the old one."""
    from torch import nn

    from posttrain.models.precision import Precision
    from posttrain.rollout.graphed_decode import DecodeGraphs
    from posttrain.rollout.hf_engine import HFRolloutEngine, _graph_draw

    eager, _ = _engines("llama", smollm2_tokenizer_dir, tmp_path)
    model, precision = eager.model, Precision(torch.float32, torch.bfloat16)
    graphed = HFRolloutEngine(model, eager.tokenizer, precision=precision)
    graphed.graphs = DecodeGraphs(model, precision, graphed.eos_ids, _graph_draw, record=False)
    reference = HFRolloutEngine(model, eager.tokenizer, precision=precision)  # compute_weights' fresh copies
    params = SamplingParams(max_tokens=8, temperature=0.0, seed=0)
    assert _tokens(graphed.generate(PROMPTS, 1, params)) == _tokens(reference.generate(PROMPTS, 1, params))
    assert len(graphed.graphs.graphs) == 1
    with torch.no_grad():
        model.lm_head.weight = nn.Parameter(torch.randn_like(model.lm_head.weight) * 2.0)
    assert _tokens(graphed.generate(PROMPTS, 1, params)) == _tokens(reference.generate(PROMPTS, 1, params))
    assert id(model.lm_head.weight) in graphed.graphs.copies
