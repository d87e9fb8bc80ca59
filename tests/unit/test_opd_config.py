"""Every OPD config rejection of the spec, through ``posttrain opd --validate-manifest`` (no model loads)."""

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
        (["rl.min_informative_groups=2"], ["rl.min_informative_groups=2", "GRPO-only"]),
        (["rl.min_informative_groups_frac=0.5"], ["rl.min_informative_groups_frac=0.5", "GRPO-only"]),
        (["rl.importance_sampling_level=sequence"], ["rl.importance_sampling_level=sequence", "needs token"]),
        (["rl.kl_beta=0.1", "rl.ref.build_ref=true"], ["no reference role"]),
        (["rl.score_centering.enabled=true"], ["score centering is a GRPO correction"]),
        (["rl.teacher.name_or_path=null"], ["rl.teacher.name_or_path is required"]),
        (["rl.teacher.input_mode=shared_vocab_multimodal"], ["takes no media", "input_mode=shared_vocab"]),
        (["rl.teacher.scoring_temperature=0.7"], ["rl.teacher.scoring_temperature=0.7", "must be 1"]),
        (["rl.teacher.tensor_parallel_size=2"], ["needs grid.backend=ray"]),
        (["rl.teacher.conditional_think_prefix=<think>"], ["cross_token_text only"]),
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
        (["rl.kl_beta=0.2"], ["rl.kl_beta=0.2", "no reference role"]),
        (["rollout.temperature=0.9"], ["rollout.temperature=0.9", "DPCA needs 1"]),
        (["rollout.top_p=0.9"], ["rollout.top_p=0.9", "DPCA needs 1"]),
        (["rollout.top_k=20"], ["rollout.top_k=20", "DPCA needs -1 (disabled)"]),
        (["rollout.repetition_penalty=1.1"], ["rollout.repetition_penalty=1.1", "DPCA needs 1"]),
        (["rl.temperature=0.9"], ["rl.temperature=0.9", "DPCA needs 1"]),
        (["rl.teacher.input_mode=shared_vocab"], ["signal_mode=dpca with input_mode=shared_vocab"]),
        (["rl.teacher.input_mode=cross_token_multimodal"], ["takes no media", "input_mode=cross_token_text"]),
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
