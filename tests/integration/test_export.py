"""export-hf: a checkpoint becomes a directory transformers loads, with the saved model's exact logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from posttrain.checkpoint import CheckpointError, CheckpointWriter, TrainingState
from posttrain.checkpoint.export import export_hf, export_main

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "smollm2_tokenizer"


def training_state(step: int) -> TrainingState:
    return TrainingState(step, step, 0, {}, {}, {"format": 1}, {})


def save(
    root: Path, step: int, trio: tuple[nn.Module, torch.optim.Optimizer, Any], *, fmt: str = "consolidated", **kw: Any
) -> Path:
    """One synchronous save of ``trio`` (model, optimizer, scheduler), as the loop's writer makes it."""
    model, opt, sched = trio
    with CheckpointWriter(root, fmt=fmt) as writer:  # type: ignore[arg-type]
        return writer.save(step, model, opt, sched, training_state(step), **kw)


def trained_llama(tokenizer: object) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids = torch.randint(0, 500, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()  # move the weights away from any fresh init
    opt.step()
    return model, opt, sched


@pytest.mark.parametrize("fmt", ["consolidated", "dcp"])
def test_export_loads_with_identical_logits(tmp_path: Path, fmt: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    model, opt, sched = trained_llama(tokenizer)
    ckpt = save(tmp_path / "ckpts", 7, (model, opt, sched), fmt=fmt, tokenizer=tokenizer)
    out = export_hf(ckpt, tmp_path / "hf_out")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = tokenizer("What is 12 + 7?", return_tensors="pt").input_ids
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    exported_tok = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "hi"}]
    assert exported_tok.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    assert not list(tmp_path.glob("hf_out.tmp-*"))


def test_export_refusals_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    model, opt, sched = trained_llama(tokenizer)
    ckpt = save(tmp_path / "run" / "checkpoints", 3, (model, opt, sched))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        export_hf(ckpt, tmp_path / "busy")
    # a run directory resolves to its newest checkpoint; the tokenizer comes from the base model dir
    assert export_main([str(tmp_path / "run"), str(tmp_path / "cli_out"), "--base-model-dir", str(TOKENIZER_DIR)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "cli_out" / "tokenizer.json").is_file()

    plain = nn.Linear(2, 2)
    popt = torch.optim.AdamW(plain.parameters())
    bare = save(tmp_path / "plain", 1, (plain, popt, None))
    with pytest.raises(CheckpointError, match=r"stores no Hugging Face config .* pass base_model_dir"):
        export_hf(bare, tmp_path / "plain_out")
    assert export_main([str(tmp_path / "nowhere"), str(tmp_path / "o")]) == 1
    assert "neither a checkpoint" in capsys.readouterr().err
