"""Routing replay on a tiny random Qwen3-MoE: the gating formula, record -> pin reproduces the
forward exactly, a different routing changes only the MoE outputs, and the trace alignment through
padding, packing and the shared-prompt forward, checked position by position at the experts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from posttrain.errors import TrainingError
from posttrain.models.moe import checkpoint_layout, is_sparse_moe, moe_routers
from posttrain.models.routing_replay import pin_routing, pinned_gate_weights, record_routing
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.policy.routing import batch_routing, sequence_routing
from posttrain.policy.shared_prefix import build_grouped_batch, grouped_completion_logprobs
from posttrain.policy.train_batch import RoutingTrace

E, K, LAYERS, VOCAB = 8, 2, 2, 97


@pytest.fixture(scope="module")
def model() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=True,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(config)
    for router in moe_routers(m):
        torch.nn.init.normal_(router.weight, std=0.5)  # well-separated scores: no near-ties in fp32
    return m.eval()


@contextmanager
def seen_experts(model) -> Iterator[list[list[torch.Tensor]]]:
    """Per body call, per MoE layer, the top-k indices the experts module actually received."""
    calls: list[list[torch.Tensor]] = []
    body = model.model
    handles = [body.register_forward_pre_hook(lambda *_: calls.append([]))]
    for layer in body.layers:
        handles.append(layer.mlp.experts.register_forward_pre_hook(lambda mod, args: calls[-1].append(args[1].clone())))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def random_routing(n: int, seed: int) -> torch.Tensor:
    """``[n, LAYERS, K]`` distinct random experts per position and layer."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, LAYERS, E, generator=gen).argsort(-1)[..., :K]


SEQS = [([3, 4, 5, 6], [7, 8, 9]), ([10, 11], [12, 13, 14, 15, 16]), ([17, 18, 19], [20])]


def test_pinned_gate_weights_are_the_full_softmax_gathered_and_renormalised() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    pinned = torch.tensor([[3, 0]])
    raw = pinned_gate_weights(logits, pinned, norm_topk_prob=False)
    torch.testing.assert_close(raw, torch.stack([probs[3], probs[0]])[None])
    normed = pinned_gate_weights(logits, pinned, norm_topk_prob=True)
    torch.testing.assert_close(normed, torch.stack([probs[3], probs[0]])[None] / (probs[3] + probs[0]))


def test_pinning_to_the_recorded_routing_reproduces_the_forward_exactly(model) -> None:
    ids = torch.tensor([[5, 9, 2, 33, 41, 7, 60]])
    with record_routing(model) as recorded, torch.no_grad():
        free = model(ids).logits
    assert len(recorded) == 1 and recorded[0].shape == (7, LAYERS, K)
    with pin_routing(model, recorded), seen_experts(model) as seen, torch.no_grad():
        pinned = model(ids).logits
    assert torch.equal(pinned, free)
    for m in range(LAYERS):
        assert torch.equal(seen[0][m], recorded[0][:, m])


def test_a_different_routing_changes_only_the_moe_outputs(model) -> None:
    """Attention and norms see nothing of the routing: layer 0's attention output is bitwise the
    same, its MoE output differs, and the experts get exactly the given indices."""
    ids = torch.tensor([[5, 9, 2, 33, 41, 7, 60]])
    outputs: dict[str, torch.Tensor] = {}
    layer0 = model.model.layers[0]
    hooks = [
        layer0.self_attn.register_forward_hook(lambda m, a, o: outputs.__setitem__("attn", o[0].clone())),
        layer0.mlp.register_forward_hook(lambda m, a, o: outputs.__setitem__("moe", o.clone())),
    ]
    try:
        with torch.no_grad():
            free = model(ids).logits
        free_out = dict(outputs)
        routing = random_routing(7, seed=1)
        with pin_routing(model, [routing]), seen_experts(model) as seen, torch.no_grad():
            pinned = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(outputs["attn"], free_out["attn"])
    assert not torch.allclose(outputs["moe"], free_out["moe"])
    assert not torch.allclose(pinned, free)
    assert all(torch.equal(seen[0][m], routing[:, m]) for m in range(LAYERS))


def test_pinning_keeps_the_router_gradient(model) -> None:
    ids = torch.tensor([[5, 9, 2, 33]])
    model.zero_grad()
    with pin_routing(model, [random_routing(4, seed=2)]):
        model(ids).logits.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(model))
    model.zero_grad()


def _traces(seed: int) -> list[torch.Tensor]:
    """A sampler-like trace per sequence: [P + C - 1, M, K], random so misplacement cannot hide."""
    return [random_routing(len(p) + len(c) - 1, seed=seed + i) for i, (p, c) in enumerate(SEQS)]


@pytest.mark.parametrize("packed", [False, True])
def test_traces_follow_their_tokens_through_padding_and_packing(model, packed: bool) -> None:
    traces = _traces(10)
    prompts, completions = [p for p, _ in SEQS], [c for _, c in SEQS]
    pb = build_policy_batch(prompts, completions, pad_id=0, device="cpu", pack_capacity=0 if packed else None)
    calls = batch_routing(pb, RoutingTrace(traces), prompts, completions)
    with pin_routing(model, calls), seen_experts(model) as seen, torch.no_grad():
        completion_logprobs(model, pb)
    width = pb.input_ids_RL.shape[1]
    for b, (p, c) in enumerate(SEQS):
        start = pb.seq_start_B[b]
        row, col = divmod(start, width)
        assert pb.input_ids_RL[row, col : col + len(p) + len(c)].tolist() == p + c  # the tokens sit there
        for m in range(LAYERS):
            got = seen[0][m][start : start + len(p) + len(c) - 1]
            assert torch.equal(got, traces[b][:, m]), f"sequence {b} layer {m}"


def test_pinned_logprobs_do_not_depend_on_the_layout(model) -> None:
    """The same traces pinned in the padded, packed and shared-prompt layouts give the same logprobs."""
    seqs = [([3, 4, 5, 6], [7, 8, 9]), ([3, 4, 5, 6], [12, 13])]  # one group of two
    prompts, completions = [p for p, _ in seqs], [c for _, c in seqs]
    shared = random_routing(4, seed=3)
    traces = [torch.cat([shared, random_routing(len(c) - 1, seed=4 + i)]) for i, c in enumerate(completions)]
    results = []
    for packed in (None, 0):
        pb = build_policy_batch(prompts, completions, pad_id=0, device="cpu", pack_capacity=packed)
        with pin_routing(model, batch_routing(pb, RoutingTrace(traces), prompts, completions)), torch.no_grad():
            results.append(completion_logprobs(model, pb))
    gb = build_grouped_batch(prompts[:1], completions, group_size=2, pad_id=0, device="cpu")
    calls = batch_routing(gb, RoutingTrace(traces), prompts, completions)
    with pin_routing(model, calls), seen_experts(model) as seen, torch.no_grad():
        results.append(grouped_completion_logprobs(model, gb))
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], atol=1e-5, rtol=1e-5)
    assert all(torch.equal(seen[0][m], shared[:, m]) for m in range(LAYERS))  # the prompt pass
    for b, c in enumerate(completions):  # the completion pass: [B, T] right-padded
        width_t = gb.completion_ids_BT.shape[1]
        for m in range(LAYERS):
            got = seen[1][m][b * width_t : b * width_t + len(c) - 1]
            assert torch.equal(got, traces[b][4:, m])


def test_sequence_routing_checks_the_trace_length() -> None:
    trace = random_routing(5, seed=0)
    assert torch.equal(sequence_routing(trace, 6)[:5], trace)
    assert torch.equal(sequence_routing(trace, 6)[5], trace[4])  # placeholder for the never-run last token
    with pytest.raises(TrainingError, match=r"has 8 prompt \+ completion tokens but a routing trace of shape"):
        sequence_routing(trace, 8)


def test_pinning_refuses_a_layout_mismatch_and_extra_calls(model) -> None:
    ids = torch.tensor([[5, 9, 2]])
    too_long = pytest.raises(TrainingError, match="does not match the batch layout")
    with too_long, pin_routing(model, [random_routing(4, seed=0)]), torch.no_grad():
        model(ids)
    twice = pytest.raises(TrainingError, match="ran 2 times")
    with twice, pin_routing(model, [random_routing(3, seed=0)]), torch.no_grad():
        model(ids)
        model(ids)


def test_moe_structure_and_checkpoint_layout(model) -> None:
    assert is_sparse_moe(model) and len(moe_routers(model)) == LAYERS
    experts = model.model.layers[0].mlp.experts
    names = {
        f"model.layers.0.mlp.experts.{e}.{w}.weight" for e in range(E) for w in ("gate_proj", "up_proj", "down_proj")
    }
    named = dict(
        checkpoint_layout(
            [("model.layers.0.mlp.experts.gate_up_proj", experts.gate_up_proj), ("model.norm.weight", torch.ones(3))],
            names,
        )
    )
    half = experts.gate_up_proj.shape[1] // 2
    assert torch.equal(named["model.layers.0.mlp.experts.3.gate_proj.weight"], experts.gate_up_proj[3, :half])
    assert torch.equal(named["model.layers.0.mlp.experts.3.up_proj.weight"], experts.gate_up_proj[3, half:])
    assert "model.norm.weight" in named and len(named) == 2 * E + 1
    # a checkpoint that holds the stack itself gets it whole
    kept = dict(checkpoint_layout([("x.experts.down_proj", experts.down_proj)], {"x.experts.down_proj"}))
    assert kept == {"x.experts.down_proj": experts.down_proj}
