"""Chunked completion logprobs against a naive full-vocabulary log_softmax, values and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.errors import ConfigError
from posttrain.policy.batching import build_policy_batch, pack_rows, packed_cells, packed_micro_batches
from posttrain.policy.logprobs import check_packing_isolates, completion_logprobs

PROMPTS = [[5, 9, 3], [7], [11, 2, 8, 4, 6], [1, 1]]
COMPLETIONS = [[4, 4, 2, 9], [3, 10, 12, 1, 5, 7], [], [8]]


def _model(vocab: int = 32, *, tie: bool = True, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        max_position_embeddings=2048,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init make the distributions non-flat
        for p in model.parameters():
            p.mul_(4.0)
    return model.eval()


def _naive_logprobs(model: LlamaForCausalLM, prompts, completions, temperature: float) -> torch.Tensor:
    """Straightforward reference: full forward with the padding mask, log_softmax over all positions."""
    batch = build_policy_batch(prompts, completions, pad_id=0, device="cpu")
    logits_BLV = model(input_ids=batch.input_ids_RL, attention_mask=batch.attention_mask_RL).logits.float()
    logp_BLV = torch.log_softmax(logits_BLV / temperature, dim=-1)
    rows, pos, toks, cols = [], [], [], []
    for b, (p, c) in enumerate(zip(prompts, completions)):
        for t, tok in enumerate(c):
            rows.append(b), pos.append(len(p) + t - 1), toks.append(tok), cols.append(t)
    picked = logp_BLV[torch.tensor(rows), torch.tensor(pos), torch.tensor(toks)]
    out = torch.zeros(len(prompts), max(len(c) for c in completions))
    return out.index_put((torch.tensor(rows), torch.tensor(cols)), picked)


def test_build_policy_batch_layout() -> None:
    batch = build_policy_batch([[5, 6], [7]], [[1, 2, 3], []], pad_id=0, device="cpu")
    assert batch.input_ids_RL.tolist() == [[5, 6, 1, 2, 3], [7, 0, 0, 0, 0]]
    assert batch.attention_mask_RL.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert batch.position_ids_RL is None
    assert batch.completion_ids_BT.tolist() == [[1, 2, 3], [0, 0, 0]]
    assert batch.completion_mask_BT.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # completion tokens (0,0) (0,1) (0,2), predicted from flat positions 1, 2, 3 of row 0
    assert (batch.row_N.tolist(), batch.col_N.tolist(), batch.source_N.tolist()) == ([0, 0, 0], [0, 1, 2], [1, 2, 3])


def test_pack_rows_is_first_fit_decreasing() -> None:
    assert pack_rows([3, 7, 5, 2, 7, 12], 12) == [[5], [1, 2], [4, 0, 3]]
    assert pack_rows([4, 4, 4], 4) == [[0], [1], [2]]
    assert pack_rows([], 4) == []
    with pytest.raises(ValueError, match=r"sequence\(s\) \[1\] are longer than the packing capacity 4"):
        pack_rows([4, 5], 4)


def test_packed_micro_batches_take_the_split_with_fewer_cells() -> None:
    lengths = [3, 7, 5, 2, 7, 12]
    assert packed_cells(lengths) == 3 * 12  # rows [12], [7, 5], [7, 3, 2]
    assert packed_cells([5, 5, 2]) == 3 * 5 and packed_cells([4, 3, 1]) == 2 * 4 and packed_cells([]) == 0
    # size 3: the runs by length, [2, 3, 5] and [7, 7, 12], pack into 2 x 5 + 3 x 12 = 46 cells; the
    # rows packed at 12, [12] [7, 5] [7, 3, 2], dealt to 2 micro-batches: [12, 7, 3, 2] packs into
    # 2 x 12 and [7, 5] into 2 x 7, 38 cells
    assert packed_micro_batches(lengths, 3) == [[5, 4, 0, 3], [1, 2]]
    assert sorted(packed_micro_batches(lengths, 6)[0]) == list(range(6))  # one micro-batch
    # [4, 4] + [9, 9] = 8 + 18 cells beat the dealt [9, 4, 4] + [9] = 18 + 9: the runs
    assert packed_micro_batches([9, 4, 9, 4], 2) == [[1, 3], [0, 2]]
    # 2 packed rows ([4], [1, 1, 1]) for 4 micro-batches: the runs
    assert packed_micro_batches([1, 1, 1, 4], 1) == [[0], [1], [2], [3]]


def test_build_packed_batch_layout() -> None:
    # lengths 5, 2, 3 -> capacity 5: row 0 holds sequence 0, row 1 holds sequence 2 then sequence 1
    batch = build_policy_batch([[5, 6], [7], [8, 9]], [[1, 2, 3], [4], [10]], pad_id=0, device="cpu", pack_capacity=0)
    assert batch.input_ids_RL.tolist() == [[5, 6, 1, 2, 3], [8, 9, 10, 7, 4]]
    assert batch.attention_mask_RL.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.position_ids_RL is not None
    assert batch.position_ids_RL.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert batch.completion_ids_BT.tolist() == [[1, 2, 3], [4, 0, 0], [10, 0, 0]]
    assert batch.row_N.tolist() == [0, 0, 0, 1, 2]
    assert batch.col_N.tolist() == [0, 1, 2, 0, 0]
    # row 0 positions 1-3; sequence 1 starts at flat 5 + 3 = 8 (predicted from 8); sequence 2 from 5 + 1
    assert batch.source_N.tolist() == [1, 2, 3, 8, 6]
    assert batch.num_rows == 3
    wider = build_policy_batch([[5, 6], [7], [8, 9]], [[1, 2, 3], [4], [10]], pad_id=0, device="cpu", pack_capacity=8)
    assert wider.input_ids_RL.tolist() == [[5, 6, 1, 2, 3, 8, 9, 10], [7, 4, 0, 0, 0, 0, 0, 0]]
    assert wider.source_N.tolist() == [1, 2, 3, 8, 6]
    tail = build_policy_batch([[5, 6, 7]], [[1]], pad_id=0, device="cpu", pack_capacity=0)  # nothing to pack
    assert tail.input_ids_RL.tolist() == [[5, 6, 7, 1]] and tail.position_ids_RL.tolist() == [[0, 1, 2, 3]]
    short = build_policy_batch([[5, 6, 7, 8], [1], [2]], [[1], [], []], pad_id=0, device="cpu", pack_capacity=0)
    assert short.input_ids_RL.tolist() == [[5, 6, 7, 8, 1], [1, 2, 0, 0, 0]]
    assert short.position_ids_RL.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]  # the padding: a sequence apart


PACKED_PROMPTS = [*PROMPTS, [3, 3, 3, 3, 3, 3, 3, 3]]
PACKED_COMPLETIONS = [*COMPLETIONS, [2, 2, 6, 2]]  # lengths 7, 7, 5, 3, 12: rows [12], [7, 5], [7, 3]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_values_and_gradients_match_naive(attention: str) -> None:
    model = _model()
    model.config._attn_implementation = attention
    batch = build_policy_batch(PACKED_PROMPTS, PACKED_COMPLETIONS, pad_id=0, device="cpu", pack_capacity=0)
    assert batch.input_ids_RL.shape == (3, 12)
    _assert_matches_naive(model, PACKED_PROMPTS, PACKED_COMPLETIONS, batch, 0.9)


def test_packing_probe_passes_transformers_models_and_fails_a_model_that_mixes_sequences() -> None:
    model = _model()
    check_packing_isolates(model)  # a transformers Llama masks by position ids
    forward = model.model.forward

    def ignores_position_ids(*args, position_ids=None, **kwargs):  # what a model unaware of packing does
        return forward(*args, **kwargs)

    model.model.forward = ignores_position_ids
    with pytest.raises(ConfigError, match=r"lets packed sequences attend to each other.*sequence_packing=false"):
        check_packing_isolates(model)


def test_build_policy_batch_rejects_bad_rows() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        build_policy_batch([[1], []], [[2], [3]], pad_id=0, device="cpu")
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        build_policy_batch([[1], [2]], [[3]], pad_id=0, device="cpu")


def _assert_matches_naive(model: LlamaForCausalLM, prompts, completions, batch, temperature: float) -> torch.Tensor:
    """``completion_logprobs`` on ``batch`` equals the naive reference, values and gradients (of a
    random weighting of the logprobs); returns the logprobs."""
    weights_BT = torch.randn(len(prompts), max(map(len, completions)), generator=torch.Generator().manual_seed(1))
    expected = _naive_logprobs(model, prompts, completions, temperature)
    (expected * weights_BT).sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # 5-token chunks: chunk boundaries fall inside rows, and the last chunk is ragged.
    got = completion_logprobs(model, batch, temperature=temperature, chunk_tokens=5)
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    (got * weights_BT).sum().backward()
    for name, param in model.named_parameters():
        # Gradients reach ~70 here, so fp32 rounding of the two summation orders is judged against
        # the tensor's scale: the largest difference must stay below 1e-5 of the largest entry.
        scale = max(1.0, expected_grads[name].abs().max().item())
        assert (param.grad - expected_grads[name]).abs().max().item() <= 1e-5 * scale, name
    return got


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tie", [True, False])
def test_values_and_gradients_match_naive(temperature: float, tie: bool) -> None:
    model = _model(tie=tie)
    batch = build_policy_batch(PROMPTS, COMPLETIONS, pad_id=0, device="cpu")
    got = _assert_matches_naive(model, PROMPTS, COMPLETIONS, batch, temperature)
    assert got.dtype == torch.float32
    assert got.shape == (4, 6)
    assert (got[batch.completion_mask_BT == 0] == 0).all()


def test_head_ids_return_policy_logprobs_at_those_ids() -> None:
    model = _model()
    batch = build_policy_batch(PROMPTS, COMPLETIONS, pad_id=0, device="cpu")
    head_ids_BTK = torch.randint(0, 32, (4, 6, 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logprobs_BT, head_BTK = completion_logprobs(
            model, batch, temperature=0.8, chunk_tokens=4, head_ids_BTK=head_ids_BTK
        )
        logits_BLV = model(input_ids=batch.input_ids_RL, attention_mask=batch.attention_mask_RL).logits
        logp_BLV = torch.log_softmax(logits_BLV / 0.8, dim=-1)
    for b, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        for t in range(6):
            if t < len(c):
                row = logp_BLV[b, len(p) + t - 1]
                torch.testing.assert_close(head_BTK[b, t], row[head_ids_BTK[b, t]], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(logprobs_BT[b, t], row[c[t]], atol=1e-5, rtol=1e-5)
            else:
                assert (head_BTK[b, t] == 0).all()


def test_no_grad_path_equals_grad_path() -> None:
    model = _model()
    batch = build_policy_batch(PROMPTS, COMPLETIONS, pad_id=0, device="cpu")
    with torch.no_grad():
        a = completion_logprobs(model, batch, chunk_tokens=3)
    b = completion_logprobs(model, batch, chunk_tokens=1024)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    torch.testing.assert_close(a, b.detach(), atol=1e-6, rtol=1e-6)


def _largest_allocation(fn) -> int:
    """Largest net allocation (bytes) any single CPU op made while ``fn`` ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(int(e.self_cpu_memory_usage) for e in prof.events())


def test_chunked_head_never_sees_more_than_chunk_tokens_rows() -> None:
    vocab, chunk = 49152, 64
    model = _model(vocab=vocab)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (10,), generator=gen).tolist() for _ in range(6)]
    completions = [torch.randint(0, vocab, (50,), generator=gen).tolist() for _ in range(6)]
    batch = build_policy_batch(prompts, completions, pad_id=0, device="cpu")
    tokens = 6 * 50
    full_logits_bytes = tokens * vocab * 4

    rows_seen: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _out: rows_seen.append(args[0].shape[0]))

    def chunked() -> None:
        out = completion_logprobs(model, batch, chunk_tokens=chunk)
        assert isinstance(out, torch.Tensor)
        out.sum().backward()

    peak_chunked = _largest_allocation(chunked)
    hook.remove()
    # Forward: 5 chunks (4 x 64 + 44); backward recomputes each chunk once more.
    assert sorted(rows_seen) == sorted([64, 64, 64, 64, 44] * 2)
    assert max(rows_seen) <= chunk

    model.zero_grad()

    def naive() -> None:
        _naive_logprobs(model, prompts, completions, 1.0).sum().backward()

    peak_naive = _largest_allocation(naive)
    # The profiler does see the full logits in the naive path, so its silence on the chunked one means something.
    assert peak_naive >= full_logits_bytes
    assert peak_chunked < full_logits_bytes / 4


@pytest.mark.parametrize(("temperature", "softcap"), [(1.0, None), (0.7, None), (1.0, 3.0)])
def test_bf16_head_computes_in_fp32(temperature: float, softcap: float | None) -> None:
    """A bf16 head's logits are upcast before the softmax (``log_softmax(dtype=float32)`` at the
    default; after the softcap and the temperature otherwise): within fp32 rounding of a float64
    reference over the same bf16 logits, where a bf16 softmax would be off by ~1e-2."""
    from posttrain.policy.logprobs import chunked_head_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(64, 3000, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.mul_(8.0)  # logits of a few units: a peaked softmax, where rounding shows
    hidden = torch.randn(50, 64, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(3000, (50, 2))
    out = chunked_head_logprobs(hidden, ids, head, temperature=temperature, softcap=softcap, chunk_tokens=16)
    logits = head(hidden).double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    ref = logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)
    assert out.dtype == torch.float32
    assert (out.double() - ref).abs().max().item() < 1e-5
    grad, grad_ref = (torch.autograd.grad(x.sum(), hidden)[0].double() for x in (out.double(), ref))
    assert ((grad - grad_ref).norm() / grad_ref.norm()).item() < 2e-2
