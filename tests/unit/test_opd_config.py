"""Every OPD config rejection of the spec, through ``posttrain opd --validate-manifest`` (no model loads),
and the shape of ``OPDConfig``: the shared run config without GRPO's own knobs."""

from __future__ import annotations

import pytest

from posttrain.entrypoints.opd import main as opd_main

DPCA = [
    "rl.teacher.input_mode=cross_token_text",
    "rl.teacher.signal_mode=dpca",
    "rl.teacher.top_k=0",
    "rl.distillation_mode=advantage",
    "rl.jsd_beta=null",
    "rl.reward=constant",
]


def _validate(capsys: pytest.CaptureFixture[str], model_dir: str, *overrides: str, recipe: str = "opd_direct") -> str:
    """Exit status and all output of ``--validate-manifest`` on the recipe with the demo paths replaced."""
    paths = [f"model.name_or_path={model_dir}", f"rl.teacher.name_or_path={model_dir}"]
    status = opd_main(["--config", recipe, "--validate-manifest", "--", *paths, *overrides])
    out = capsys.readouterr()
    text = out.out + out.err
    return f"status={status}\n{text}"


def test_shipped_recipes_are_valid(capsys: pytest.CaptureFixture[str], tiny_model_dir: str) -> None:
    assert "status=0" in _validate(capsys, tiny_model_dir)
    assert "status=0" in _validate(capsys, tiny_model_dir, recipe="opd_dpca")
    assert "status=0" in _validate(capsys, tiny_model_dir, *DPCA)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        # GRPO's own knobs are unknown keys under OPD, each saying why
        (["rl.min_informative_groups=2"], ["unknown key 'rl.min_informative_groups'", "GRPO-only"]),
        (["rl.min_informative_groups_frac=0.5"], ["unknown key 'rl.min_informative_groups_frac'", "GRPO-only"]),
        (["rl.importance_sampling_level=sequence"], ["unknown key 'rl.importance_sampling_level'", "per token"]),
        (["rl.kl_beta=0.1", "rl.ref.build_ref=true"], ["'rl.kl_beta'", "'rl.ref.build_ref'", "no reference role"]),
        (["rl.score_centering.enabled=true"], ["score centering is a GRPO correction"]),
        (["rl.teacher.name_or_path=null"], ["rl.teacher.name_or_path is required"]),
        (["rl.teacher.input_mode=shared_vocab_multimodal"], ["needs a vision-language student", "=shared_vocab"]),
        (["rl.teacher.scoring_temperature=0.7"], ["rl.teacher.scoring_temperature=0.7", "must be 1"]),
        (["rl.teacher.tensor_parallel_size=2"], ["needs grid.backend=ray"]),
        (["rl.teacher.conditional_think_prefix=<think>"], ["cross_token_text / cross_token_multimodal only"]),
        # direct mode
        (["rl.teacher.top_k=0"], ["rl.teacher.top_k=0", "top-k support"]),
        (["rl.jsd_beta=null"], ["rl.jsd_beta=null", "direct mode needs a beta"]),
        (["rl.temperature=0.8"], ["rl.temperature=0.8", "scoring temperature must be 1"]),
        (["rl.teacher.signal_mode=dpca"], ["distillation_mode=direct needs rl.teacher.signal_mode=topk"]),
        (["rl.teacher.input_mode=cross_token_text"], ["signal_mode=topk with input_mode=cross_token_text"]),
        # same-token advantage mode
        (["rl.distillation_mode=advantage"], ["rl.jsd_beta=1.0", "advantage mode forms no divergence"]),
        (
            ["rl.distillation_mode=advantage", "rl.jsd_beta=null", "rollout.temperature=0.7"],
            ["rollout.temperature=0.7", "advantage-mode OPD needs 1"],
        ),
    ],
)
def test_direct_and_same_token_rejections(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: str, overrides: list[str], needles: list[str]
) -> None:
    report = _validate(capsys, tiny_model_dir, *overrides)
    assert "status=1" in report and "manifest INVALID" in report
    for needle in needles:
        assert needle in report


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["rl.teacher.top_k=4"], ["rl.teacher.top_k=4", "DPCA scores realized tokens only"]),
        (["rl.jsd_beta=0.5"], ["rl.jsd_beta=0.5", "advantage mode forms no divergence"]),
        (["rl.distillation_mode=direct", "rl.jsd_beta=1"], ["DPCA is advantage-only"]),
        (["rl.kl_beta=0.2"], ["unknown key 'rl.kl_beta'", "no reference role"]),
        (["rollout.temperature=0.9"], ["rollout.temperature=0.9", "DPCA needs 1"]),
        (["rollout.top_p=0.9"], ["rollout.top_p=0.9", "DPCA needs 1"]),
        (["rollout.top_k=20"], ["rollout.top_k=20", "DPCA needs -1 (disabled)"]),
        (["rollout.repetition_penalty=1.1"], ["rollout.repetition_penalty=1.1", "DPCA needs 1"]),
        (["rl.temperature=0.9"], ["rl.temperature=0.9", "DPCA needs 1"]),
        (["rl.teacher.input_mode=shared_vocab"], ["signal_mode=dpca with input_mode=shared_vocab"]),
        (["rl.teacher.input_mode=cross_token_multimodal"], ["needs a vision-language student", "=cross_token_text"]),
    ],
)
def test_dpca_rejections(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: str, overrides: list[str], needles: list[str]
) -> None:
    report = _validate(capsys, tiny_model_dir, *DPCA, *overrides)
    assert "status=1" in report
    for needle in needles:
        assert needle in report


def test_every_problem_is_reported_at_once(capsys: pytest.CaptureFixture[str], tiny_model_dir: str) -> None:
    report = _validate(
        capsys, tiny_model_dir, "rl.min_informative_groups=1", "rl.teacher.top_k=0", "rl.teacher.scoring_temperature=2"
    )
    assert "manifest INVALID (3 problem(s))" in report


def test_grpo_and_opd_recipes_are_not_interchangeable(capsys: pytest.CaptureFixture[str]) -> None:
    from posttrain.entrypoints.grpo import main as grpo_main

    assert opd_main(["--config", "default", "--validate-manifest"]) == 1
    assert "expected OPDConfig; run it with `posttrain grpo`" in capsys.readouterr().err
    assert grpo_main(["--config", "opd_dpca", "--validate-manifest"]) == 1
    assert "expected GRPOConfig; run it with `posttrain opd`" in capsys.readouterr().err


def test_unknown_teacher_key_suggests_the_nearest(capsys: pytest.CaptureFixture[str], tiny_model_dir: str) -> None:
    report = _validate(capsys, tiny_model_dir, "rl.teacher.topk=4")
    assert "unknown key 'rl.teacher.topk'" in report and "rl.teacher.top_k" in report


def test_missing_demo_students_say_how_to_make_them(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    assert opd_main(["--config", "opd_direct", "--validate-manifest"]) == 1
    assert "python -m posttrain.models.opd_demo" in capsys.readouterr().err


GRPO_ONLY_WHY = {
    "rl.min_informative_groups": "dynamic sampling is GRPO-only",
    "rl.min_informative_groups_frac": "dynamic sampling is GRPO-only",
    "rl.importance_sampling_level": "OPD's ratio is always per token",
    "rl.kl_beta": "OPD has no reference role: the teacher is the anchor",
    "rl.ref.build_ref": "OPD has no reference role: the teacher is the anchor",
    "rl.score_centering.enabled": "score centering is a GRPO correction",
    # the rest of GRPO's own knobs (no-ops under OPD before, unknown keys now)
    "rl.kl_coeff_clamp": "OPD has no reference role",
    "rl.ref.model_dir": "OPD has no reference role",
    "rl.score_centering.compose": "score centering is a GRPO correction",
    "rl.dynamic_sampling_max_extra_rollouts": "dynamic sampling is GRPO-only",
}


@pytest.mark.parametrize(("key", "why"), list(GRPO_ONLY_WHY.items()))
def test_grpo_knobs_are_unknown_keys_that_say_why(key: str, why: str) -> None:
    from posttrain.config.loading import apply_overrides
    from posttrain.config.opd import OPDConfig
    from posttrain.config.schema import GRPOConfig
    from posttrain.errors import ConfigError

    value = {
        "rl.importance_sampling_level": "token",
        "rl.ref.model_dir": "/m",
        "rl.score_centering.compose": "tis",
    }.get(key, 1)
    with pytest.raises(ConfigError) as info:
        apply_overrides(OPDConfig(), [(key, value)])
    [problem] = info.value.problems
    assert problem.startswith(f"unknown key {key!r}: {key} is a GRPO knob; ") and problem.endswith(". Remove it")
    assert why in problem
    assert apply_overrides(GRPOConfig(), [(key, value)]) is not None  # a GRPO run still has it


def test_grpo_knob_in_an_opd_recipe_says_why(tmp_path: object) -> None:
    from pathlib import Path

    from posttrain.config.loading import load_recipe
    from posttrain.config.opd import OPDConfig
    from posttrain.errors import ConfigError

    recipe = Path(str(tmp_path)) / "r.py"
    recipe.write_text(
        "from posttrain.config.opd import OPDConfig\n"
        "def make_config():\n    return OPDConfig(rl={'kl_beta': 0.1, 'teacher': {'top_k': 4}})\n"
    )
    with pytest.raises(ConfigError) as info:
        load_recipe(str(recipe), OPDConfig)
    assert info.value.problems == [
        "unknown key 'rl.kl_beta': rl.kl_beta is a GRPO knob; OPD has no reference role: the teacher is the "
        "anchor. Remove it"
    ]


def test_opd_config_is_the_shared_config_without_grpo_knobs() -> None:
    from posttrain.config.loading import known_keys
    from posttrain.config.opd import OPDConfig
    from posttrain.config.schema import GRPOConfig, RunConfig

    assert issubclass(OPDConfig, RunConfig) and not issubclass(OPDConfig, GRPOConfig)
    grpo, opd = set(known_keys(GRPOConfig)), set(known_keys(OPDConfig))
    only_grpo = {k for k in grpo - opd if k.count(".") == 1}
    assert only_grpo == {
        "rl.importance_sampling_level",
        "rl.kl_beta",
        "rl.kl_coeff_clamp",
        "rl.ref",
        "rl.score_centering",
        "rl.routing_replay",
        "rl.min_informative_groups",
        "rl.min_informative_groups_frac",
        "rl.dynamic_sampling_max_extra_rollouts",
        "rl.dynamic_sampling_on_budget_exhausted",
        "rl.dynamic_sampling_refill_dispatch",
        "rl.dynamic_sampling_refill_mode",
    }
    only_opd = {k for k in opd - grpo if k.count(".") == 1}
    assert only_opd == {
        "rl.teacher",
        "rl.distillation_mode",
        "rl.jsd_beta",
        "rl.kl_penalty_coef",
        "rl.n_ignore_prefix_tokens",
    }
    dumped = OPDConfig().model_dump(mode="json")["rl"]
    assert not set(dumped) & {k.removeprefix("rl.") for k in only_grpo}


def test_what_shared_code_reads_on_an_opd_run() -> None:
    """Transitional read-only properties (config/opd.py): OPD's fixed values of GRPO's knobs, equal to
    GRPO's defaults, so an OPD run's objective and resume identity are what they were."""
    from posttrain.config.opd import OPDConfig
    from posttrain.config.schema import GRPOConfig

    opd, grpo = OPDConfig().rl, GRPOConfig().rl
    for name in ("importance_sampling_level", "kl_beta", "kl_coeff_clamp", "effective_min_informative_groups"):
        assert getattr(opd, name) == getattr(grpo, name), name
    assert opd.ref == grpo.ref and opd.ref.build_ref is False and opd.ref.model_dir is None
    assert opd.score_centering == grpo.score_centering and opd.score_centering.enabled is False
    with pytest.raises(AttributeError):
        opd.kl_beta = 0.1  # type: ignore[misc]
