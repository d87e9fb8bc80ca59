"""Shared test fixtures: the SmolLM2 tokenizer copy, a tiny random model built from it once per session, and
the trainer's logprobs of a rollout batch (what an engine's sampler logprobs are compared with)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
SMOLLM2_TOKENIZER_DIR = FIXTURES / "smollm2_tokenizer"


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> str:
    """The SmolLM2 tokenizer (49152 ids, ChatML template, ``<|im_end|>`` as EOS)."""
    return str(SMOLLM2_TOKENIZER_DIR)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama (hidden 64) with the SmolLM2 tokenizer, saved as a Hugging Face directory.

    Session-scoped: tests that change weights must load their own copy from this directory.
    """
    from posttrain.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny_model")
    return make_tiny_model(str(out), str(SMOLLM2_TOKENIZER_DIR))


@pytest.fixture
def trainer_logprobs() -> Callable[..., list[list[float]]]:
    """``trainer_logprobs(model, rollout_batch, pad_id)``: the trainer's logprob of each completion
    token of a ``RolloutBatch`` at temperature 1, on the model's device, one list per completion."""
    import torch

    from posttrain.policy.batching import build_policy_batch
    from posttrain.policy.logprobs import completion_logprobs

    def logprobs(model: torch.nn.Module, batch: Any, pad_id: int) -> list[list[float]]:
        pb = build_policy_batch(
            [batch.prompt_token_ids[c.prompt_index] for c in batch.completions],
            [c.token_ids for c in batch.completions],
            pad_id=pad_id,
            device=next(model.parameters()).device,
        )
        with torch.no_grad():
            out = completion_logprobs(model, pb, temperature=1.0, chunk_tokens=1024)
        assert isinstance(out, torch.Tensor)
        return [out[i, : len(c.token_ids)].float().tolist() for i, c in enumerate(batch.completions)]

    return logprobs


E2E_DIR = FIXTURES / "e2e"


def _tiny_run_overrides(model_dir: str, out: Path, name: str, *extra: str) -> list[str]:
    """A short GRPO run on a tiny model, scored by ``e2e_rewards:length_reward``; ``extra`` wins."""
    return [
        f"model.name_or_path={model_dir}",
        f"job.output_root={out}",
        f"job.name={name}",
        "rl.reward=e2e_rewards:length_reward",
        "rl.batch_per_replica=8",
        "rl.group_size=4",
        "rollout.max_tokens=12",
        "rl.optimizer.lr=1e-3",
        *extra,
    ]


@pytest.fixture
def run_overrides(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[str]]:
    """``run_overrides(model_dir, out, name, *extra)``: the overrides of a short tiny-model run, with
    ``tests/fixtures/e2e`` importable so that its rewards resolve."""
    monkeypatch.syspath_prepend(str(E2E_DIR))
    return _tiny_run_overrides


@pytest.fixture(scope="session")
def subprocess_run_overrides() -> Callable[..., list[str]]:
    """``run_overrides`` for a session-scoped fixture whose run is a subprocess that puts
    ``tests/fixtures/e2e`` on its own PYTHONPATH (``tests/integration/ray_runs.run_driver``)."""
    return _tiny_run_overrides


def _grpo_cli(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(E2E_DIR), os.environ.get("PYTHONPATH", "")])}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "posttrain.entrypoints.grpo", "--", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )


@pytest.fixture
def grpo_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``grpo_cli(overrides, env_extra=None)``: ``python -m posttrain.entrypoints.grpo -- ...`` in a
    subprocess (for runs that are killed, signalled, or must not share this process)."""
    return _grpo_cli
