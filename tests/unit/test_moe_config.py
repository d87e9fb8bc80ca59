"""The MoE knobs in the config and the preflight: ``rollout.moe_backend`` / ``rl.teacher.moe_backend``
(independent, ``auto`` passes nothing to vLLM), ``rl.routing_replay``'s refusals by name, OPD
refusing it, its place in the exact-resume identity, and the CPU engine's refusal to capture."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.checkpoint import CheckpointError
from posttrain.checkpoint.layout import TrainingState
from posttrain.config.loading import build_config
from posttrain.config.opd import OPDConfig
from posttrain.errors import ConfigError, PosttrainError
from posttrain.loop.resume import check_resume_compatible, resume_identity
from posttrain.models.tiny import make_tiny_model, make_tiny_moe_model
from posttrain.preflight.grpo import grpo_preflight
from posttrain.preflight.moe import model_is_sparse_moe
from posttrain.rollout.vllm_moe import moe_backend_args, routed_experts_args


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    return make_tiny_moe_model(str(tmp_path_factory.mktemp("moe")), smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("dense")), smollm2_tokenizer_dir)


def _errors(model_dir: str, *overrides: str) -> list[str]:
    cfg = build_config(None, [f"model.name_or_path={model_dir}", *overrides])
    return [e for e in grpo_preflight(cfg).errors if "routing_replay" in e]


REPLAY = ("rl.routing_replay=rollout", "rollout.backend=vllm")


def test_moe_backend_defaults_and_independence() -> None:
    cfg = build_config(None, ["rollout.moe_backend=triton"])
    assert cfg.rollout.moe_backend == "triton"
    opd = build_config(None, ["rollout.moe_backend=triton"], OPDConfig)
    assert opd.rl.teacher.moe_backend == "auto"  # the teacher does not inherit the rollout's
    assert build_config(None, ["rl.teacher.moe_backend=marlin"], OPDConfig).rl.teacher.moe_backend == "marlin"
    assert moe_backend_args("auto") == {} and moe_backend_args("triton") == {"moe_backend": "triton"}
    with pytest.raises(ConfigError, match="moe_backend"):
        build_config(None, ["rollout.moe_backend="])


def test_routing_replay_is_off_by_default_and_a_moe_run_with_vllm_passes(moe_dir: str) -> None:
    assert build_config(None, []).rl.routing_replay == "off"
    assert _errors(moe_dir, *REPLAY) == []


def test_routing_replay_refusals_name_the_conflicting_knob(moe_dir: str, dense_dir: str) -> None:
    (hf,) = _errors(moe_dir, "rl.routing_replay=rollout")
    assert "needs rollout.backend=vllm" in hf and "rollout.backend=hf" in hf
    (pg,) = _errors(moe_dir, *REPLAY, "rl.grpo_surrogate=legacy_pg")
    assert "needs rl.grpo_surrogate=clipped" in pg and "legacy_pg" in pg
    (gc,) = _errors(moe_dir, *REPLAY, "model.gradient_checkpointing=true")
    assert "model.gradient_checkpointing=true" in gc
    (compiled,) = _errors(moe_dir, *REPLAY, "model.compile=true")
    assert "model.compile=true" in compiled
    (dense,) = _errors(dense_dir, *REPLAY)
    assert "needs a sparse-MoE policy" in dense and "dense llama" in dense


def test_rollout_logprob_modes_need_unwarped_temperature_one_sampling_with_replay(moe_dir: str) -> None:
    cfg = build_config(
        None,
        [f"model.name_or_path={moe_dir}", *REPLAY, "rl.use_rollout_logprobs_for_loss=true", "rollout.temperature=0.7"],
    )
    errors = grpo_preflight(cfg).errors
    assert any("rl.use_rollout_logprobs_for_loss uses the sampler's raw logprobs" in e for e in errors)


def test_opd_refuses_the_knob_by_name() -> None:
    with pytest.raises(ConfigError, match=r"rl\.routing_replay is a GRPO knob; MoE routing replay pins"):
        build_config(None, ["rl.routing_replay=rollout"], OPDConfig)
    assert build_config(None, [], OPDConfig).rl.routing_replay == "off"


def test_routing_replay_joins_the_exact_resume_identity(tmp_path: Path) -> None:
    off, on = build_config(None, []), build_config(None, ["rl.routing_replay=rollout"])
    assert "rl.routing_replay" not in resume_identity(off)  # older checkpoints keep matching

    def saved(cfg) -> TrainingState:
        return TrainingState(1, 1, 0, {}, {}, {}, resume_identity(cfg))

    for saved_cfg, now_cfg in ((off, on), (on, off)):
        with pytest.raises(CheckpointError, match=r"rl\.routing_replay changed"):
            check_resume_compatible(saved(saved_cfg), resume_identity(now_cfg), n_mini=1)
    check_resume_compatible(saved(on), resume_identity(on), n_mini=1)


def test_sparse_moe_detection_reads_the_config() -> None:
    assert model_is_sparse_moe({"num_experts": 8, "num_experts_per_tok": 2})
    assert model_is_sparse_moe({"num_local_experts": 8, "num_experts_per_tok": 2})  # what transformers 5 writes
    assert model_is_sparse_moe({"text_config": {"num_experts": 128, "num_experts_per_tok": 8}})
    assert not model_is_sparse_moe({"model_type": "llama"})


def test_the_cpu_engine_refuses_to_capture_routing_with_the_reason() -> None:
    assert routed_experts_args(False, cuda=False) == {}
    assert routed_experts_args(True, cuda=True) == {"enable_return_routed_experts": True}
    with pytest.raises(PosttrainError, match=r"vLLM's CPU build cannot .*Model Runner V2 needs Triton"):
        routed_experts_args(True, cuda=False)
