"""``model.lora``: the section's own validation and the preflight's cross-field rules
(``preflight/lora.py``), all before any model loads; the recipe passes them."""

from __future__ import annotations

import pytest

from posttrain.config.loading import build_config
from posttrain.config.lora import VLLM_LORA_RANKS, LoraConfig
from posttrain.config.opd import OPDConfig
from posttrain.errors import ConfigError
from posttrain.preflight.grpo import grpo_preflight
from posttrain.preflight.opd import opd_preflight

ON = ["model.lora.rank=8"]


def _errors(*overrides: str) -> list[str]:
    return [e for e in grpo_preflight(build_config(None, list(overrides))).errors if "model.lora" in e]


def test_defaults_are_off_and_change_nothing() -> None:
    lora = LoraConfig()
    assert (lora.rank, lora.enabled, lora.dropout, lora.target_modules, lora.modules_to_save) == (
        0,
        False,
        0.0,
        "all-linear",
        [],
    )
    findings = grpo_preflight(build_config(None, []))
    assert not [m for m in findings.errors + findings.warnings if "lora" in m]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora.rank=-1", "greater than or equal to 0"),
        ("model.lora.alpha=0", "greater than 0"),
        ("model.lora.dropout=1.0", "less than 1"),
        ("model.lora.target_modules=all_linear", "give 'all-linear' or a list of module names"),
        ("model.lora.target_modules=[]", "a list of non-empty module names"),
        ("model.lora.modules_to_save=['']", "module names must be non-empty"),
    ],
)
def test_the_section_refuses_bad_values(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(None, [override])


def test_a_list_of_target_modules_is_kept() -> None:
    cfg = build_config(None, [*ON, "model.lora.target_modules=[q_proj, v_proj]"])
    assert cfg.model.lora.target_modules == ["q_proj", "v_proj"]


def test_settings_without_a_rank_warn_that_lora_is_off() -> None:
    findings = grpo_preflight(build_config(None, ["model.lora.alpha=64"]))
    assert any("model.lora.alpha is set but model.lora.rank=0" in w for w in findings.warnings)
    assert not [e for e in findings.errors if "lora" in e]


def test_dropout_is_refused_where_forwards_must_repeat() -> None:
    drop = [*ON, "model.lora.dropout=0.1"]
    assert _errors(*drop) == []  # one optimizer step per batch, ratio against itself: allowed
    (probe,) = _errors(*drop, "rl.mini_batch_per_replica=16")
    assert "determinism probe" in probe and "set model.lora.dropout=0" in probe and "2 optimizer steps" in probe
    (centering,) = _errors(*drop, "rl.score_centering.enabled=true")
    assert "rl.score_centering" in centering and "set model.lora.dropout=0" in centering
    (sampler,) = _errors(*drop, "rl.use_rollout_logprobs_for_loss=true")
    assert "rl.use_rollout_logprobs_for_loss=true" in sampler
    # with the sampler's logprobs as pi_old there is no ahead pass, so no probe refusal on top
    assert len(_errors(*drop, "rl.use_rollout_logprobs_for_loss=true", "rl.mini_batch_per_replica=16")) == 1


def test_dropout_is_refused_in_opd_advantage_mode(tiny_model_dir: str) -> None:
    base = [f"rl.teacher.name_or_path={tiny_model_dir}", f"model.name_or_path={tiny_model_dir}"]
    base += ["rl.batch_per_replica=8", "rl.group_size=4"]
    direct = build_config("opd_direct", [*base, *ON, "model.lora.dropout=0.1"], OPDConfig)
    assert not [e for e in opd_preflight(direct).errors if "model.lora" in e]
    advantage = build_config("opd_direct", [*base, *ON, "model.lora.dropout=0.1", "rl.jsd_beta=null"], OPDConfig)
    advantage.rl.distillation_mode = "advantage"
    assert any("rl.distillation_mode=advantage" in e for e in opd_preflight(advantage).errors)


def test_muon_is_refused_with_its_reason() -> None:
    (muon,) = _errors(*ON, "rl.optimizer.name=muon")
    assert "rl.optimizer.name=muon" in muon and "use rl.optimizer.name=adamw" in muon and "B starts at zero" in muon


def test_vllm_limits_placement_and_checkpoint_format() -> None:
    vllm = "rollout.backend=vllm"
    assert any("modules_to_save" in e for e in _errors(*ON, vllm, "model.lora.modules_to_save=[model.norm]"))
    assert not any("model.lora.rank" in e for e in _errors(f"model.lora.rank={VLLM_LORA_RANKS[-1]}", vllm))
    assert any(
        f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}" in e
        for e in _errors(f"model.lora.rank={VLLM_LORA_RANKS[-1] + 1}", vllm)
    )
    assert not _errors(f"model.lora.rank={VLLM_LORA_RANKS[-1] + 1}")  # the transformers engine has no limit
    assert any("rl.checkpoint_format=consolidated" in e for e in _errors(*ON, "rl.checkpoint_format=dcp"))
    disaggregated = ["grid.gpu_placement=disaggregated", "grid.backend=ray", "rl.weight_sync_transport=object_store"]
    for transport in ("object_store", "nccl", "nixl"):  # replicas receive the adapter alone (rollout/replica_lora.py)
        assert _errors(*ON, *disaggregated[:2], f"rl.weight_sync_transport={transport}") == []


def test_a_module_both_adapted_and_trained_whole_is_refused() -> None:
    (both,) = _errors(*ON, "model.lora.target_modules=[q_proj, v_proj]", "model.lora.modules_to_save=[v_proj]")
    assert "['v_proj'] appear in both" in both


def test_the_lora_recipe_passes_the_preflight() -> None:
    cfg = build_config("lora", [])
    assert cfg.model.lora.enabled and cfg.model.lora.rank == 16
    findings = grpo_preflight(cfg)
    assert not [m for m in findings.errors if "lora" in m]
