"""``rollout.vllm_model_runner``: which vLLM model runner an engine asks for (``vllm_runtime.model_runner_for``),
how the choice reaches vLLM (its environment variable) and where the architecture is read from."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from posttrain.rollout.vllm_runtime import RUNNER_ENV, choose_model_runner, model_architectures, model_runner_for

QWEN2 = ["Qwen2ForCausalLM"]
LLAMA = ["LlamaForCausalLM"]


def _choice(requested: str = "auto", **kw: object) -> str | None:
    args: dict = dict(cuda=True, architectures=QWEN2, plain_text_engine=True, seeded=True, environment={}) | kw
    return model_runner_for(requested, **args)


def test_auto_asks_for_v2_only_for_a_checked_architecture_in_a_plain_seeded_cuda_engine() -> None:
    assert _choice() == "v2"  # Qwen2 (Qwen2.5): vLLM 0.24 would run it on V1
    assert _choice(architectures=LLAMA) is None  # vLLM's own choice (V2 for a Llama already)
    assert _choice(architectures=[]) is None
    assert _choice(cuda=False) is None  # vLLM's CPU build: nothing set
    assert _choice(plain_text_engine=False) is None  # LoRA, images, several GPUs, routed experts
    assert _choice(seeded=False) is None  # rollout.seed=null: V1 samples unseeded rows at once
    # a variable the user set wins over auto
    assert _choice(environment={RUNNER_ENV: "0"}) is None


def test_an_explicit_runner_is_asked_for_whatever_the_architecture() -> None:
    assert _choice("v1") == "v1"
    assert _choice("v2", architectures=LLAMA, plain_text_engine=False) == "v2"
    assert _choice("v1", environment={RUNNER_ENV: "1"}) == "v1"
    assert _choice("v2", cuda=False) is None  # the CPU build is left alone


def test_the_architecture_comes_from_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": QWEN2, "model_type": "qwen2"}))
    assert model_architectures(str(tmp_path)) == QWEN2
    assert model_architectures(str(tmp_path / "missing")) == []
    (tmp_path / "config.json").write_text("{not json")
    assert model_architectures(str(tmp_path)) == []


def test_choosing_a_runner_sets_vllms_variable_for_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm import envs

    monkeypatch.delenv(RUNNER_ENV, raising=False)
    choose_model_runner(None)
    assert RUNNER_ENV not in os.environ  # leave vLLM's choice: nothing written
    choose_model_runner("v2")
    assert os.environ[RUNNER_ENV] == "1" and envs.VLLM_USE_V2_MODEL_RUNNER is True
    choose_model_runner("v1")
    assert os.environ[RUNNER_ENV] == "0" and envs.VLLM_USE_V2_MODEL_RUNNER is False
