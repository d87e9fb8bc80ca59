"""GPU-only checks (``pytest -m gpu`` on the device machine; deselected everywhere else)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")


def test_default_precision_on_cuda_is_mixed_and_a_run_trains(tiny_model_dir: str, grpo_run: Callable[..., Any]) -> None:
    cfg, run_dir, records = grpo_run(tiny_model_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0 for r in records)
    assert torch.cuda.max_memory_allocated() > 0
    # fp32 master weights by default on CUDA (the compute runs on bf16 copies of them)
    from posttrain.models.precision import resolve_precision

    assert "on cuda:0 in torch.float32" in (run_dir / "train.log").read_text()
    precision = resolve_precision(cfg.model.dtype, cfg.model.compute_dtype, torch.device("cuda"))
    assert (precision.param_dtype, precision.compute_dtype) == (torch.float32, torch.bfloat16)


def test_the_body_forward_of_padded_rows_makes_no_host_sync() -> None:
    # transformers' packing check reads the position ids on the host; padded rows skip it
    # (models.structure.rows_not_packed), so a micro-batch's forward queues behind the last backward
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.models.structure import body_hidden_states, split_body_and_head

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    body, _ = split_body_and_head(LlamaForCausalLM(config).cuda())
    ids_RL = torch.randint(0, 64, (4, 32), device="cuda")
    body_hidden_states(body, ids_RL)  # warm-up: lazy initialisations may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hidden = body_hidden_states(body, ids_RL)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert hidden.shape == (4, 32, 64)
