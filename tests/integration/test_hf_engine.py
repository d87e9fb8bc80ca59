"""The transformers rollout engine on tiny random models: shapes, stops, logprobs, seeds, weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.distributed.fsdp import PolicyWeights
from posttrain.errors import TrainingError
from posttrain.models.chat import render_prompt_ids
from posttrain.models.tiny import make_tiny_model
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.rollout.base import RolloutBatch, SamplingParams
from posttrain.rollout.hf_engine import HFRolloutEngine, draw_tokens, plan_chunks, warp_logits

EOS = 2  # <|im_end|> in the SmolLM2 tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture()
def model(tiny_model_dir: str):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    out = tmp_path_factory.mktemp("tiny_untied")
    return make_tiny_model(str(out), smollm2_tokenizer_dir, tie_word_embeddings=False, seed=1)


@pytest.fixture()
def eos_model(untied_dir: str):
    """A model whose LM head carries a bias toward EOS: ~15 % of the mass per step, so some
    completions stop early and some run to the length limit."""
    model = AutoModelForCausalLM.from_pretrained(untied_dir, dtype=torch.float32).eval()
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = 9.0
    model.lm_head.bias = nn.Parameter(bias)
    return model


@pytest.fixture()
def diverse_model(untied_dir: str):
    """Untied and with weights scaled up: peaked, prompt-dependent distributions (the default random
    init with tied embeddings mostly repeats the last input token)."""
    model = AutoModelForCausalLM.from_pretrained(untied_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = ["What is 2 + 3?", "Name a colour.", "Say hi"]
    return [render_prompt_ids(tokenizer, t, use_chat_template=True) for t in texts]


def _policy_logprobs(model, batch: RolloutBatch, temperature: float, pad_id: int) -> list[list[float]]:
    pb = build_policy_batch(
        [batch.prompt_token_ids[c.prompt_index] for c in batch.completions],
        [c.token_ids for c in batch.completions],
        pad_id=pad_id,
        device="cpu",
    )
    with torch.no_grad():
        out = completion_logprobs(model, pb, temperature=temperature, chunk_tokens=16)
    assert isinstance(out, torch.Tensor)
    return [out[i, : len(c.token_ids)].tolist() for i, c in enumerate(batch.completions)]


def _tokens(batch: RolloutBatch) -> list[list[int]]:
    return [c.token_ids for c in batch.completions]


def test_shapes_grouping_text_and_stats(model, tokenizer, prompts) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    out = engine.generate(prompts, 4, SamplingParams(max_tokens=6, seed=0))
    assert out.prompt_token_ids == prompts
    assert [c.prompt_index for c in out.completions] == [0] * 4 + [1] * 4 + [2] * 4
    for c in out.completions:
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if c.finish_reason == "length":
            assert len(c.token_ids) == 6 and EOS not in c.token_ids
    assert set(out.stats) >= {"rollout/tokens_per_s", "rollout/gen_s"}
    assert out.stats["rollout/gen_s"] > 0
    assert out.stats["rollout/generated_tokens"] == sum(len(c.token_ids) for c in out.completions)
    assert out.weight_version == 0


def test_stop_and_length_finish_reasons(eos_model, tokenizer, prompts) -> None:
    engine = HFRolloutEngine(eos_model, tokenizer)
    out = engine.generate(prompts, 6, SamplingParams(max_tokens=5, seed=3))
    reasons = {c.finish_reason for c in out.completions}
    assert reasons == {"stop", "length"}
    for c in out.completions:
        if c.finish_reason == "stop":
            # The EOS is kept as the last token, and nothing follows it.
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 5 and EOS not in c.token_ids
    assert any(len(c.token_ids) < 5 for c in out.completions)


def test_extra_eos_ids_stop_generation(model, tokenizer, prompts) -> None:
    """Every id in ``eos_ids`` stops a sequence: with the whole vocabulary as EOS, one token each."""
    engine = HFRolloutEngine(model, tokenizer, eos_ids=list(range(model.config.vocab_size)))
    out = engine.generate(prompts, 2, SamplingParams(max_tokens=5, seed=0))
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for c in out.completions)


@pytest.mark.parametrize("which", ["eos_model", "diverse_model"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_policy_logprobs(request, which: str, tokenizer, prompts, temperature: float) -> None:
    model = request.getfixturevalue(which)
    engine = HFRolloutEngine(model, tokenizer, batch_size=5)  # chunks split a prompt's group
    out = engine.generate(prompts, 3, SamplingParams(max_tokens=8, temperature=temperature, seed=1))
    if which == "eos_model":
        assert len({len(c.token_ids) for c in out.completions}) > 1  # ragged rows are exercised
    expected = _policy_logprobs(model, out, temperature, tokenizer.pad_token_id)
    for c, ref in zip(out.completions, expected):
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(ref), atol=2e-5, rtol=1e-5)


def test_left_padding_matches_hf_greedy_generate(diverse_model, tokenizer, prompts) -> None:
    """Greedy decoding of a prompt batched with longer ones equals transformers' own generate alone
    (this model's output changes when padding is attended, so a wrong mask fails here)."""
    engine = HFRolloutEngine(diverse_model, tokenizer)
    out = engine.generate(prompts, 1, SamplingParams(max_tokens=6, temperature=0.0))
    assert len({t for c in out.completions for t in c.token_ids}) > 6  # not a degenerate repeat
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = diverse_model.generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=EOS, pad_token_id=EOS
            )
        assert out.completions[i].token_ids == ref[0, len(prompt) :].tolist()


def test_top_k_and_top_p_only_sample_from_the_kept_head(model, tokenizer, prompts) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    for params in (SamplingParams(max_tokens=4, top_k=3, seed=0), SamplingParams(max_tokens=4, top_p=0.01, seed=0)):
        out = engine.generate(prompts[:2], 3, params)
        for c in out.completions:
            ids = torch.tensor([out.prompt_token_ids[c.prompt_index] + c.token_ids])
            with torch.no_grad():
                probs_LV = torch.softmax(model(ids).logits[0].float(), dim=-1)
            start = len(out.prompt_token_ids[c.prompt_index])
            for t, tok in enumerate(c.token_ids):
                row = probs_LV[start + t - 1]
                if params.top_k > 0:
                    assert tok in torch.topk(row, 3).indices.tolist()
                else:
                    # The token's rank: the mass strictly above it must be below top_p.
                    assert row[row > row[tok]].sum().item() < 0.01


def test_warp_logits_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    seen = torch.tensor([[True, True, False, False]])
    penalized = warp_logits(logits, SamplingParams(max_tokens=1, repetition_penalty=2.0), seen)
    assert penalized.tolist() == [[1.0, -2.0, 0.5, 1.0]]
    tempered = warp_logits(logits, SamplingParams(max_tokens=1, temperature=0.5), None)
    assert tempered.tolist() == [[4.0, -2.0, 1.0, 2.0]]
    top2 = warp_logits(logits, SamplingParams(max_tokens=1, top_k=2), None)
    assert top2.tolist() == [[2.0, float("-inf"), float("-inf"), 1.0]]
    # softmax([2, -1, 0.5, 1]) = [0.609, 0.030, 0.136, 0.224]: top_p=0.7 keeps 2.0 and 1.0 (0.83).
    nucleus = warp_logits(logits, SamplingParams(max_tokens=1, top_p=0.7), None)
    assert nucleus.tolist() == [[2.0, float("-inf"), float("-inf"), 1.0]]
    assert warp_logits(logits, SamplingParams(max_tokens=1, top_p=0.5), None).tolist() == [
        [2.0, float("-inf"), float("-inf"), float("-inf")]
    ]


def test_sampler_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits_BV = probs.log().expand(20000, 4).contiguous()
    gen = torch.Generator().manual_seed(0)
    ids, logprobs_BV = draw_tokens(logits_BV, SamplingParams(max_tokens=1), gen)
    logprobs = logprobs_BV.gather(-1, ids[:, None]).squeeze(-1)
    freq = torch.bincount(ids, minlength=4).float() / ids.numel()
    assert freq[3] == 0  # probability zero is never drawn
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, probs.log()[ids])


def test_sampler_cdf_is_the_float64_copys_cumsum_bitwise() -> None:
    """The CDF accumulates the float32 probabilities in float64 as it goes (``cumsum(dtype=)``): the same
    sums, and so the same draws, as the float64 copy's cumsum it replaced, at the default job's shape."""
    gen = torch.Generator().manual_seed(3)
    logits_BV = torch.randn(32, 49152, generator=gen) * 4
    logits_BV[:, :100] = float("-inf")  # ids of probability zero
    probs_BV = torch.softmax(logits_BV, dim=-1)
    assert torch.equal(torch.cumsum(probs_BV, dim=-1, dtype=torch.float64), probs_BV.double().cumsum(dim=-1))
    ids, _ = draw_tokens(logits_BV, SamplingParams(max_tokens=1), torch.Generator().manual_seed(5))
    u_B1 = torch.rand((32, 1), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    cdf_BV = probs_BV.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf_BV, u_B1 * cdf_BV[:, -1:], right=True).squeeze(-1)
    assert torch.equal(ids, expected)
    assert bool((ids >= 100).all())


def test_plan_chunks_groups_by_prompt() -> None:
    chunks = plan_chunks(3, 4, 5)
    assert [(c.prompt_index_U, c.counts_U) for c in chunks] == [([0, 1], [4, 1]), ([1, 2], [3, 2]), ([2], [2])]


def test_seeded_sampling_is_reproducible_and_isolated(model, tokenizer, prompts) -> None:
    params = SamplingParams(max_tokens=6, seed=7)
    engine = HFRolloutEngine(model, tokenizer)
    saved = engine.state_dict()
    rng_before = torch.get_rng_state()
    first = engine.generate(prompts, 3, params)
    second = engine.generate(prompts, 3, params)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global RNG is never used
    assert _tokens(first) != _tokens(second)  # the call index moves the stream on

    other = HFRolloutEngine(model, tokenizer)
    torch.manual_seed(123)  # training code drawing from the global RNG changes nothing
    assert _tokens(other.generate(prompts, 3, params)) == _tokens(first)
    other.load_state_dict(engine.state_dict())
    engine.load_state_dict(saved)
    assert _tokens(engine.generate(prompts, 3, params)) == _tokens(first)
    assert _tokens(other.generate(prompts, 3, params)) != _tokens(first)
    reseeded = HFRolloutEngine(model, tokenizer).generate(prompts, 3, SamplingParams(max_tokens=6, seed=8))
    assert _tokens(reseeded) != _tokens(first)


def test_generate_restores_train_mode(model, tokenizer, prompts) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    model.train()
    engine.generate(prompts[:1], 1, SamplingParams(max_tokens=2, seed=0))
    assert model.training
    model.eval()
    engine.generate(prompts[:1], 1, SamplingParams(max_tokens=2, seed=0))
    assert not model.training


def test_received_weights_are_copied_and_stamped(model, tokenizer, prompts) -> None:
    policy = copy.deepcopy(model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine = HFRolloutEngine(model, tokenizer)
    before = engine.generate(prompts, 2, SamplingParams(max_tokens=5, seed=0))
    engine.receive_weights(PolicyWeights(policy), version=3)  # its own module: the policy's tensors copied in
    assert engine.weight_version == 3
    for (name, p), q in zip(model.named_parameters(), policy.parameters()):
        assert torch.equal(p, q), name
    engine.load_state_dict({"generate_calls": 0})
    after = engine.generate(prompts, 2, SamplingParams(max_tokens=5, seed=0))
    assert after.weight_version == 3
    assert _tokens(after) != _tokens(before)
    # Colocated: the engine shares the policy module, so only the version is stamped.
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(1.0)
    engine.receive_weights(PolicyWeights(model), version=4)
    assert engine.weight_version == 4
    assert not torch.equal(model.get_input_embeddings().weight, policy.get_input_embeddings().weight)
    # A list of named tensors goes in as it is (what a replica receives).
    engine.load_weights(list(policy.named_parameters()), version=5)
    assert engine.weight_version == 5 and torch.equal(
        model.get_input_embeddings().weight, policy.get_input_embeddings().weight
    )


def test_a_replica_keeps_one_sampling_stream_per_cell(model, tokenizer, prompts) -> None:
    """``rollout/replica.py``: one engine serving two policy ranks (cells) draws for each the stream
    that rank's own engine would, however their calls interleave; each cell's stream checkpoints."""
    from posttrain.rollout.replica import Replica

    params = SamplingParams(max_tokens=5, seed=3)
    replica = Replica(HFRolloutEngine(model, tokenizer), torch.device("cpu"))
    own = [HFRolloutEngine(model, tokenizer) for _ in range(2)]
    for cell in (0, 1, 1, 0, 1):
        assert _tokens(replica.generate(cell, prompts, 2, params)) == _tokens(own[cell].generate(prompts, 2, params))
    assert [replica.state_dict(c) for c in (0, 1, 7)] == [{"generate_calls": n} for n in (2, 3, 0)]
    replica.load_state_dict(1, {"generate_calls": 0})
    first = HFRolloutEngine(model, tokenizer).generate(prompts, 2, params)
    assert _tokens(replica.generate(1, prompts, 2, params)) == _tokens(first)


def test_failed_load_poisons_the_engine(model, tokenizer, prompts) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    engine.receive_weights(PolicyWeights(model), version=1)
    good = dict(model.named_parameters())
    name = next(iter(good))
    bad = [(name, good[name].detach().clone()), ("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))]
    with pytest.raises(TrainingError, match="version 2 failed after 1 tensor"):
        engine.load_weights(bad, version=2)
    assert engine.weight_version == 1  # never stamped
    with pytest.raises(TrainingError, match=r"Resume from the last checkpoint"):
        engine.generate(prompts, 1, SamplingParams(max_tokens=2, seed=0))

    unknown = HFRolloutEngine(model, tokenizer)
    with pytest.raises(TrainingError, match=r"no tensor named 'not\.a\.weight'"):
        unknown.load_weights({"not.a.weight": torch.zeros(1)}, version=5)


def test_rejects_bad_inputs(model, tokenizer, prompts) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([prompts[0], []], 1, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="must be >= 1"):
        engine.generate(prompts, 0, SamplingParams(max_tokens=2))
