"""The per-step waste removed from the CPU default job computes exactly what it replaced.

Each speedup here is meant to be bitwise: grouped-query SDPA in CPU forwards without autograd
(``models/cpu_attention.py``), the chunked LM head kept instead of recomputed when it is one chunk
and not divided by a temperature of 1 (``policy/logprobs.py``), the transformers engine's draw at
temperature 1 (``rollout/hf_engine.py``), and the freed tensor memory kept in the heap on a CPU
(``models/cpu_heap.py``). Each test compares against the old computation written out here.
"""

from __future__ import annotations

import resource
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import sdpa_attention

from posttrain.models.cpu_attention import use_grouped_sdpa_on_cpu
from posttrain.models.cpu_heap import keep_freed_memory_in_heap
from posttrain.policy.logprobs import chunked_head_logprobs
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf_engine import draw_tokens


def _tiny_gqa_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # two query heads per key/value head: transformers would repeat_kv
        max_position_embeddings=128,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def _left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: transformers passes a mask, the case it repeats heads for
    mask[1, :2] = 0
    return ids, mask


def _with_decision(decide: object, fn: object) -> object:
    saved = sdpa_attention.use_gqa_in_sdpa
    sdpa_attention.use_gqa_in_sdpa = decide  # type: ignore[assignment]
    try:
        return fn()  # type: ignore[operator]
    finally:
        sdpa_attention.use_gqa_in_sdpa = saved


def test_grouped_sdpa_forward_without_autograd_is_bitwise_the_repeated_one() -> None:
    assert use_grouped_sdpa_on_cpu()
    assert use_grouped_sdpa_on_cpu()  # idempotent: the second call wraps nothing again
    patched = sdpa_attention.use_gqa_in_sdpa
    model = _tiny_gqa_model()
    ids, mask = _left_padded_batch()
    key = torch.zeros(1, 2, 3, 16)
    with torch.no_grad():
        assert patched(torch.ones(1, 1, 3, 3, dtype=torch.bool), key, key) is True

    def repeat_always(*_args: object, **_kw: object) -> bool:
        return False

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask).logits

    grouped = _with_decision(patched, logits)
    repeated = _with_decision(repeat_always, logits)
    assert torch.equal(grouped, repeated)  # type: ignore[arg-type]


def test_grouped_sdpa_leaves_autograd_forwards_to_transformers() -> None:
    use_grouped_sdpa_on_cpu()
    patched = sdpa_attention.use_gqa_in_sdpa
    key = torch.zeros(1, 2, 3, 16, requires_grad=True)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    # with autograd on, the grouped kernel's backward sums the heads' gradients in another order:
    # transformers' own answer (repeat the heads when a mask is passed) stands
    assert patched(mask, key, key) is False
    assert patched(None, key, key) is True  # no mask: transformers itself groups


def _old_chunked(hidden: torch.Tensor, ids: torch.Tensor, head: torch.nn.Module, temperature: float) -> torch.Tensor:
    """The head's math with every chunk checkpointed and always divided by the temperature (as it ran
    before a single chunk skipped the recompute and a temperature of 1 the division)."""

    def chunk(h: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        logits = head(h).float() / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, i)

    return torch.cat([checkpoint(chunk, hidden, ids, use_reentrant=False)])


def test_single_chunk_head_without_recompute_has_bitwise_the_same_values_and_gradients() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 500, bias=False)
    hidden = torch.randn(40, 32)
    ids = torch.randint(0, 500, (40, 1))
    upstream = torch.randn(40, 1)
    results = []
    for compute in (
        lambda h: _old_chunked(h, ids, head, 1.0),
        lambda h: chunked_head_logprobs(h, ids, head, temperature=1.0, softcap=None, chunk_tokens=64),
    ):
        head.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_(True)
        out = compute(h)
        out.backward(upstream)
        assert head.weight.grad is not None and h.grad is not None
        results.append((out.detach(), h.grad, head.weight.grad))
    for old, new in zip(*results):
        assert torch.equal(old, new)


def test_several_chunks_still_recompute_and_match_the_temperature_division() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    hidden = torch.randn(25, 16, requires_grad=True)
    ids = torch.randint(0, 300, (25, 1))
    out = chunked_head_logprobs(hidden, ids, head, temperature=0.7, softcap=None, chunk_tokens=10)
    logits = head(hidden).float() / 0.7
    expected = logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)
    assert torch.allclose(out, expected, atol=1e-6)
    assert out.grad_fn is not None and "Cat" in type(out.grad_fn).__name__


def test_draw_at_temperature_one_is_bitwise_the_divided_draw() -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=5)
    ids, logprobs = draw_tokens(logits, params, torch.Generator().manual_seed(9))
    # what the engine computed before: the same draw from softmax(logits / 1), log_softmax(logits / 1)
    probs = torch.softmax(logits / 1.0, dim=-1)
    cdf = probs.double().cumsum(-1)
    u = torch.rand((6, 1), generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    old_ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp(max=999)
    assert torch.equal(ids, old_ids)
    assert torch.equal(logprobs, torch.log_softmax(logits / 1.0, dim=-1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_big_tensors_come_back_without_page_faults() -> None:
    assert keep_freed_memory_in_heap()
    assert keep_freed_memory_in_heap()  # idempotent
    words = 64 * 2**20 // 4  # 64 MiB: above glibc's largest mmap threshold, so mmap'd by default
    first = torch.empty(words + words // 2)  # room for torch's alignment of the next block
    first.fill_(1.0)
    del first
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    second = torch.empty(words)
    second.fill_(2.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # a fresh mapping faults in every one of its 16,384 4-KiB pages; the kept heap block none of them
    assert faults < 1000, faults
    assert float(second[-1]) == 2.0
