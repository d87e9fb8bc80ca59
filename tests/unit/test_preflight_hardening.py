"""Inputs a careful user (or a fuzzer) can give that used to escape as raw tracebacks, pass the preflight
and fail steps later, or be refused wrongly (issue 15): each is now a named ``ConfigError`` or preflight
error that says which key, which value and what to write instead."""

from __future__ import annotations

import json
import math
import os
import textwrap
import typing
from pathlib import Path

import pytest

from posttrain.config.loading import apply_overrides, build_config, load_recipe, parse_overrides
from posttrain.config.opd import OPDConfig
from posttrain.config.schema import GRPOConfig
from posttrain.entrypoints.opd import main as opd_main
from posttrain.errors import ConfigError
from posttrain.loop.collect import sampling_params
from posttrain.preflight.grpo import grpo_preflight

DPCA = [
    "rl.teacher.input_mode=cross_token_text",
    "rl.teacher.signal_mode=dpca",
    "rl.teacher.top_k=0",
    "rl.distillation_mode=advantage",
    "rl.jsd_beta=null",
    "rl.reward=constant",
]
SAME_TOKEN_ADVANTAGE = ["rl.distillation_mode=advantage", "rl.jsd_beta=null"]


def _errors(overrides: list[str]) -> list[str]:
    return grpo_preflight(build_config(None, overrides)).errors


def _config_problems(overrides: list[str], config_type: type = GRPOConfig) -> list[str]:
    with pytest.raises(ConfigError) as info:
        build_config(None, overrides, config_type)
    return info.value.problems


def _model_dir(root: Path, name: str = "model", config: str | None = '{"model_type": "llama"}') -> Path:
    """A directory that passes the model checks (a config.json naming a model type, a weights file);
    the preflight reads no weights, so the file's bytes do not matter."""
    path = root / name
    path.mkdir(parents=True)
    if config is not None:
        (path / "config.json").write_text(config)
    (path / "model.safetensors").write_bytes(b"\0" * 8)
    return path


def _opd_report(capsys: pytest.CaptureFixture[str], model_dir: str, *overrides: str) -> str:
    paths = [f"model.name_or_path={model_dir}", f"rl.teacher.name_or_path={model_dir}"]
    status = opd_main(["--config", "opd_direct", "--validate-manifest", "--", *paths, *overrides])
    out = capsys.readouterr()
    return f"status={status}\n{out.out}{out.err}"


# -- 1. OPD advantage mode needs the rollout's logprobs at every step ------------------------------


@pytest.mark.parametrize("mode", [DPCA, SAME_TOKEN_ADVANTAGE], ids=["dpca", "same_token_advantage"])
@pytest.mark.parametrize("every", [0, 2])
def test_opd_advantage_mode_needs_sampler_logprobs_at_every_step(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, mode: list[str], every: int
) -> None:
    model = str(_model_dir(tmp_path))
    vllm = ["rollout.backend=vllm", f"rollout.sampler_logprobs_every={every}"]
    report = _opd_report(capsys, model, *mode, *vllm)
    assert "status=1" in report
    assert "rl.distillation_mode=advantage reads the student's rollout logprobs of every completion" in report
    assert f"rollout.sampler_logprobs_every={every}" in report and "set rollout.sampler_logprobs_every=1" in report
    # recorded at every step, or by the transformers engine (which always records them): no such error
    assert "reads the student's rollout logprobs" not in _opd_report(
        capsys, model, *mode, "rollout.backend=vllm", "rollout.sampler_logprobs_every=1"
    )
    assert "reads the student's rollout logprobs" not in _opd_report(
        capsys, model, *mode, f"rollout.sampler_logprobs_every={every}"
    )


@pytest.mark.parametrize("mode", [DPCA, SAME_TOKEN_ADVANTAGE], ids=["dpca", "same_token_advantage"])
def test_opd_advantage_mode_needs_sampler_logprobs_of_every_sample(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, mode: list[str]
) -> None:
    model = str(_model_dir(tmp_path))
    report = _opd_report(capsys, model, *mode, "rollout.backend=vllm", "rollout.sampler_logprobs_samples=1")
    assert "status=1" in report
    assert "rollout.sampler_logprobs_samples=1 records them for 1 sample(s) per prompt only" in report
    assert "set rollout.sampler_logprobs_samples=null" in report
    # the transformers engine records every sample whatever the knob says
    assert "reads the student's rollout logprobs" not in _opd_report(
        capsys, model, *mode, "rollout.sampler_logprobs_samples=1"
    )


@pytest.mark.parametrize(
    ("config_type", "overrides", "resolved"),
    [
        (GRPOConfig, [], 1),  # the default GRPO loss reads none of them: each group's first sample records
        (GRPOConfig, ["rl.use_rollout_logprobs_for_loss=true"], None),
        (GRPOConfig, ["rl.score_centering.enabled=true"], None),
        (GRPOConfig, ["rl.use_rollout_logprobs_for_loss=true", "rollout.sampler_logprobs_samples=null"], None),
        (GRPOConfig, ["rollout.sampler_logprobs_samples=3"], 3),
        (GRPOConfig, ["rollout.sampler_logprobs_samples=null"], None),
        (OPDConfig, [], 1),  # direct mode reads no rollout logprobs
        (OPDConfig, SAME_TOKEN_ADVANTAGE, None),
        (OPDConfig, DPCA, None),
    ],
)
def test_sampler_logprobs_samples_auto_records_every_sample_only_where_the_objective_reads_them(
    config_type: type, overrides: list[str], resolved: int | None
) -> None:
    cfg = build_config(None, ["rollout.backend=vllm", *overrides], config_type)
    assert cfg.sampler_logprobs_samples == resolved
    assert sampling_params(cfg).sampler_logprobs_samples == resolved  # what the engine is asked for


def test_sampler_logprobs_samples_below_one_is_refused_by_name() -> None:
    (problem,) = _config_problems(["rollout.sampler_logprobs_samples=0"])
    assert "rollout.sampler_logprobs_samples" in problem and "at least 1" in problem


def test_auto_sampler_logprobs_samples_passes_where_the_objective_reads_every_sample(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``auto`` is never refused: a loss that reads the rollout's logprobs gets them all."""
    assert not [e for e in _errors(["rl.use_rollout_logprobs_for_loss=true"]) if "sampler_logprobs" in e]
    report = _opd_report(capsys, str(_model_dir(tmp_path)), *SAME_TOKEN_ADVANTAGE, "rollout.backend=vllm")
    assert "reads the student's rollout logprobs" not in report


def test_opd_direct_mode_does_not_need_sampler_logprobs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report = _opd_report(capsys, str(_model_dir(tmp_path)), "rollout.backend=vllm", "rollout.sampler_logprobs_every=0")
    assert "rollout logprobs" not in report


# -- 2. override values are YAML 1.2 core-schema scalars ------------------------------------------


def test_override_values_follow_the_yaml_1_2_core_schema() -> None:
    parsed = dict(
        parse_overrides(
            [
                "job.name=2024-02-30",  # YAML 1.1 timestamp (an invalid date): a plain string
                "job.group=2024-02-28",
                "rl.max_steps=1:30",  # YAML 1.1 base 60 (90): a plain string, refused by the schema below
                "rl.seed=010",  # YAML 1.1 octal (8): decimal 10
                "rl.group_size=0o17",
                "rollout.max_tokens=0x1F",
                "rollout.top_k=-3",
                "job.tensorboard=yes",  # YAML 1.1 bool: a string (pydantic reads it as a bool)
                "job.wandb=False",
                "rl.optimizer.lr=1e-5",
                "rl.optimizer.eps=.5",
                "rl.temperature=+2.",
                "rl.epsilon_high=.inf",
                "rl.epsilon_low=-.Inf",
                "rl.advantage_eps=.NaN",
                "rl.data.path=~",
                "rl.data.name=null",
                "grid.shapes.policy=[1, 2]",
                "rl.optimizer={lr: 0.1, betas: [0.5, 0.6]}",
                "job.project='quoted: yes'",
                "job.output_root=1_000",  # YAML 1.1 int with underscores: a string in 1.2
                "rl.data.system_prompt=",
            ]
        )
    )
    assert parsed["job.name"] == "2024-02-30" and parsed["job.group"] == "2024-02-28"
    assert parsed["rl.max_steps"] == "1:30"
    assert (parsed["rl.seed"], parsed["rl.group_size"], parsed["rollout.max_tokens"]) == (10, 15, 31)
    assert parsed["rollout.top_k"] == -3
    assert parsed["job.tensorboard"] == "yes" and parsed["job.wandb"] is False
    assert (parsed["rl.optimizer.lr"], parsed["rl.optimizer.eps"], parsed["rl.temperature"]) == (1e-5, 0.5, 2.0)
    assert parsed["rl.epsilon_high"] == math.inf and parsed["rl.epsilon_low"] == -math.inf
    assert math.isnan(parsed["rl.advantage_eps"])
    assert parsed["rl.data.path"] is None and parsed["rl.data.name"] is None
    assert parsed["grid.shapes.policy"] == [1, 2]
    assert parsed["rl.optimizer"] == {"lr": 0.1, "betas": [0.5, 0.6]}
    assert parsed["job.project"] == "quoted: yes" and parsed["job.output_root"] == "1_000"
    assert parsed["rl.data.system_prompt"] == ""
    assert build_config(None, ["job.name=2024-02-30"]).job.name == "2024-02-30"


def test_sexagesimal_is_refused_with_its_decimal_spelling() -> None:
    [problem] = _config_problems(["rl.max_steps=1:30"])
    assert problem.startswith("rl.max_steps='1:30'") and "write 90" in problem


def test_an_override_key_too_long_to_be_one_is_named_shortened() -> None:
    with pytest.raises(ConfigError) as info:
        parse_overrides(["k" * 5000 + "=1"])
    [problem] = info.value.problems
    assert "5000 characters" in problem and len(problem) < 300


@pytest.mark.parametrize(
    ("raw", "needles"),
    [
        ("9" * 5000, ["5000 digits", "signed 64-bit"]),
        ("-" + "9" * 400, ["400 digits"]),
        ("[" * 1100, ["nested deeper than"]),
        ("{a: " * 200 + "1" + "}" * 200, ["nested deeper than"]),
        ("!!int x", ["tag '!!int'", "tags are not read"]),
        ("!!bool maybe", ["tag '!!bool'"]),
        ("!!python/object/apply:os.system [ls]", ["tag '!!python/object/apply:os.system'"]),
        ("! 12", ["tag '!'"]),
        ("&anchor [1]", ["anchors and aliases"]),
        ("*alias", ["anchors and aliases"]),
        ("[1, *a]", ["anchors and aliases"]),
        ("x" * 70_000, ["70000 characters", "at most 65536"]),
        ("[1, 2", ["not valid YAML"]),
        ("a: b: c", ["not valid YAML"]),
        ("%TAG ! x", ["not valid YAML"]),
        ("@at", ["not valid YAML"]),
        ("a\x07", ["not valid YAML"]),
        ("{[1]: 2}", ["not valid YAML"]),
        ("a\n---\nb", ["not valid YAML"]),
    ],
)
def test_bad_override_values_are_named_config_errors(raw: str, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_overrides([f"rl.max_steps={raw}"])
    [problem] = info.value.problems
    assert problem.startswith("override rl.max_steps="), problem
    assert "quote" in problem or "write" in problem, problem  # what to write instead
    assert len(problem) < 600  # a huge value is shortened, not echoed whole
    for needle in needles:
        assert needle in problem, problem


@pytest.mark.parametrize(
    ("override", "want"),
    [
        ("rl.optimizer.betas=[0.9]", "rl.optimizer.betas=[0.9]: too few values (none at position 1, counting from 0)"),
        ("rl.optimizer.betas=[]", "rl.optimizer.betas=[]: too few values (none at positions 0, 1, counting from 0)"),
    ],
)
def test_a_tuple_given_too_few_values_is_named_by_its_key(override: str, want: str) -> None:
    """Pydantic reports a short fixed-length tuple as a missing field named by index (betas.1)."""
    with pytest.raises(ConfigError) as info:
        build_config(None, [override])
    assert info.value.problems == [want]


def test_unreadable_invalid_and_refused_overrides_are_reported_together(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from posttrain.entrypoints.grpo import main as grpo_main

    overrides = ["rl.seed=!!int x", "rl.max_steps=1:30", "rl.optimizer.lr=.inf", f"rl.resume={tmp_path}"]
    status = grpo_main(["--validate-manifest", "--", *overrides])
    err = capsys.readouterr().err
    assert status == 1 and "manifest INVALID (4 problem(s))" in err, err
    for needle in ("override rl.seed=", "rl.max_steps='1:30'", "rl.optimizer.lr=inf", f"rl.resume={tmp_path}"):
        assert needle in err


# -- 3. paths the operating system cannot hold ------------------------------------------------------

LONG = "a" * 300


@pytest.mark.parametrize(
    "overrides",
    [
        [f"model.name_or_path=/tmp/{LONG}"],
        [f"model.name_or_path={LONG}/model"],
        ["rl.kl_beta=0.1", "rl.ref.build_ref=true", f"rl.ref.model_dir=/tmp/{LONG}"],
        [f"rl.resume=/tmp/{LONG}/iter_000000002"],
        [f"job.output_root=/tmp/{LONG}"],
    ],
)
def test_path_components_over_name_max_are_named(overrides: list[str]) -> None:
    key = overrides[-1].partition("=")[0]
    errors = _errors(overrides)
    assert any(e.startswith(f"{key}=") and "300 bytes" in e and "255" in e for e in errors), errors


def test_teacher_path_over_name_max_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = str(_model_dir(tmp_path))
    status = opd_main(
        [
            "--config",
            "opd_direct",
            "--validate-manifest",
            "--",
            f"model.name_or_path={model}",
            f"rl.teacher.name_or_path=/tmp/{LONG}",
        ]
    )
    err = capsys.readouterr().err
    assert status == 1 and "rl.teacher.name_or_path=" in err and "300 bytes" in err


def test_a_whole_path_over_path_max_is_named() -> None:
    deep = "/tmp/" + "d/" * 2100 + "model"
    errors = _errors([f"model.name_or_path={deep}"])
    assert any(e.startswith("model.name_or_path=") and "4096" in e for e in errors), errors


@pytest.mark.parametrize("key", ["job.name", "job.group", "job.project"])
@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (LONG, "300 bytes"),
        ('"a\\0b"', "NUL"),
        ("a/b", "path separator"),
        ("..", "'..'"),
        ('"\\ud800x"', "lone surrogate"),
    ],
)
def test_job_names_must_be_one_directory_name(key: str, value: str, needle: str) -> None:
    errors = _errors([f"{key}={value}"])
    assert any(e.startswith(f"{key}=") and needle in e for e in errors), errors


def test_a_home_directory_that_does_not_exist_is_named() -> None:
    """``Path.expanduser`` raises RuntimeError for ``~user`` of an unknown user."""
    from posttrain.preflight.findings import Findings
    from posttrain.preflight.paths import check_model_path

    found = Findings()
    check_model_path("rl.teacher.name_or_path", "~posttrain_no_such_user/x", found)
    [problem] = found.errors
    assert problem.startswith("rl.teacher.name_or_path=~posttrain_no_such_user/x") and "no such user" in problem
    errors = _errors(["rl.resume=~posttrain_no_such_user/x"])
    assert any(e.startswith("rl.resume=~posttrain_no_such_user/x") and "no such user" in e for e in errors), errors
    # the run directory takes the output root as written (loop/run_dir.py does not expand ~)
    assert _errors(["job.output_root=~posttrain_no_such_user/x"]) == []


def test_a_nul_byte_in_a_model_path_is_named() -> None:
    errors = _errors(['model.name_or_path="/tmp/a\\0b"'])
    assert any(e.startswith("model.name_or_path=") and "NUL" in e for e in errors), errors


def test_an_output_root_with_a_file_in_the_way(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for root in (blocker, blocker / "sub"):
        errors = _errors([f"job.output_root={root}"])
        assert any(e.startswith("job.output_root=") and f"{blocker} is a file" in e for e in errors), errors
    # the job's own directories under the root, too
    (tmp_path / "root" / "posttrain").mkdir(parents=True)
    (tmp_path / "root" / "posttrain" / "grpo").write_text("x")
    errors = _errors([f"job.output_root={tmp_path / 'root'}"])
    assert any("grpo is a file" in e for e in errors), errors
    assert _errors([f"job.output_root={tmp_path / 'new' / 'deeper'}"]) == []  # would be created: fine


def test_the_output_root_comes_from_the_environment_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("POSTTRAIN_OUTPUT_ROOT", str(blocker))
    errors = _errors([])
    assert any("POSTTRAIN_OUTPUT_ROOT" in e and "is a file" in e for e in errors), errors


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_output_root_without_permission(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        errors = _errors([f"job.output_root={locked / 'runs'}"])
    finally:
        locked.chmod(0o700)
    assert any(e.startswith("job.output_root=") and "not writable" in e for e in errors), errors


def test_an_unwritable_output_root_is_found_by_access(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As root the permission bits do not stop a write, so the check is exercised through os.access."""
    real_access = os.access
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    errors = _errors([f"job.output_root={locked / 'runs'}"])
    assert any(e.startswith("job.output_root=") and f"{locked} is not writable" in e for e in errors), errors


# -- 4. a recipe whose make_config() raises -----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        ("def make_config():\n    raise RuntimeError('boom')\n", ["RuntimeError('boom')", "line 3"]),
        ("def make_config(size):\n    return GRPOConfig()\n", ["TypeError", "make_config()"]),
        ("def make_config():\n    cfg = GRPOConfig()\n    return cfg.nope\n", ["AttributeError", "line 4"]),
        (
            "def make_config():\n    cfg = GRPOConfig()\n    cfg.rl.group_sise = 4\n    return cfg\n",
            ["unknown key 'rl.group_sise'", "rl.group_size"],
        ),
        (
            "def make_config():\n    cfg = GRPOConfig()\n    cfg.rl.optimizer.lr = -1\n    return cfg\n",
            ["rl.optimizer.lr=-1"],
        ),
        ("import sys\nsys.exit(3)\n", ["SystemExit(3)"]),
        ("def make_config():\n    return 1 / 0\n", ["ZeroDivisionError"]),
        # a recipe that does not parse: the parser's line and column, not SyntaxError's tuple repr
        ("def make_config(:\n    return GRPOConfig()\n", ["line 2:", "SyntaxError: ", "at column 17"]),
        ("def make_config():\nreturn GRPOConfig()\n", ["line 3:", "IndentationError: expected an indented block"]),
    ],
)
def test_a_recipe_that_raises_is_a_named_config_error(tmp_path: Path, body: str, needles: list[str]) -> None:
    recipe = tmp_path / "recipe.py"
    recipe.write_text("from posttrain.config.schema import GRPOConfig\n" + body)
    with pytest.raises(ConfigError) as info:
        load_recipe(str(recipe))
    text = str(info.value)
    assert str(recipe) in text or "rl." in text, text
    for needle in needles:
        assert needle in text, text


def test_an_opd_recipe_setting_a_grpo_knob_says_why(tmp_path: Path) -> None:
    recipe = tmp_path / "opd_recipe.py"
    recipe.write_text(
        textwrap.dedent("""
        from posttrain.config.opd import OPDConfig
        def make_config():
            cfg = OPDConfig()
            cfg.rl.kl_beta = 0.1
            return cfg
        """)
    )
    with pytest.raises(ConfigError) as info:
        load_recipe(str(recipe), OPDConfig)
    [problem] = info.value.problems
    assert str(recipe) in problem and "line 5" in problem
    assert "unknown key 'rl.kl_beta'" in problem and "OPD has no reference role" in problem


def test_a_config_argument_too_long_for_a_file_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_recipe(LONG)


# -- 5. seeds and integers that fit what reads them ----------------------------------------------------


def test_seeds_must_fit_what_torch_accepts() -> None:
    import torch

    bound = 2**63
    torch.manual_seed(bound - 1)  # the largest seed the schema accepts is one torch takes
    assert build_config(None, [f"rl.seed={bound - 1}", f"rollout.seed={bound - 1}"]).rl.seed == bound - 1
    for key, value in (("rl.seed", bound), ("rl.seed", 2**64), ("rl.seed", -1), ("rollout.seed", bound)):
        [problem] = _config_problems([f"{key}={value}"])
        assert problem.startswith(f"{key}={value}"), problem


def test_every_integer_setting_fits_64_bits() -> None:
    [problem] = _config_problems([f"rl.max_steps={2**70}"])
    assert problem.startswith(f"rl.max_steps={2**70}") and "signed 64-bit" in problem
    [problem] = _config_problems([f"grid.shapes.policy=[1, {2**64}]"])
    assert problem.startswith("grid.shapes.policy=") and "signed 64-bit" in problem


def test_a_huge_integer_set_by_a_recipe_is_shown_shortened(tmp_path: Path) -> None:
    recipe = tmp_path / "r.py"
    recipe.write_text(
        "from posttrain.config.schema import GRPOConfig\n"
        "def make_config():\n    c = GRPOConfig()\n    c.rl.seed = 10**5000\n    return c\n"
    )
    with pytest.raises(ConfigError) as info:
        load_recipe(str(recipe))
    [problem] = info.value.problems
    assert problem.startswith("rl.seed=") and "5001 digits" in problem and len(problem) < 400


# -- 6. the arithmetic template is formatted with values of the right types ----------------------------


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("{op:d} {a} {b}", "Unknown format code 'd'"),
        ("{a:s} + {b}", "Unknown format code 's'"),
        ("{a!z} + {b}", "conversion"),
        ("{op:.3f} {a} {b}", "Unknown format code 'f'"),
        ("{a:>100000000} + {b}", "width or precision above 1000"),
        ("{a:.5000f}", "width or precision above 1000"),
        ("{a:{b}}", "nested"),
        ("{c}", "unknown fields"),
        ("{", "not a valid format string"),
    ],
)
def test_arithmetic_template_is_tried_before_the_run(template: str, needle: str) -> None:
    errors = _errors([f"rl.data.arithmetic_template='{template}'"])
    matching = [e for e in errors if "rl.data.arithmetic_template" in e]
    assert len(matching) == 1 and needle in matching[0], errors


def test_valid_arithmetic_templates_pass() -> None:
    for template in ("{a}{op}{b}=?", "{a:>3} {op:^3} {b:03d} {{literal}}", "{b:x} {a:.2f}"):
        assert _errors([f"rl.data.arithmetic_template='{template}'"]) == []


# -- 7. model directories -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ("{not json", "config.json is not JSON"),
        ("[1, 2]", "config.json holds a list, not a JSON object"),
        ('{"architectures": ["LlamaForCausalLM"]}', "config.json has no model_type"),
        ('{"model_type": 7}', "config.json has no model_type"),
        (None, "holds no config.json"),
    ],
)
def test_broken_model_config_is_named(tmp_path: Path, config: str | None, needle: str) -> None:
    model = _model_dir(tmp_path, config=config)
    for overrides in (
        [f"model.name_or_path={model}"],
        ["rl.kl_beta=0.1", "rl.ref.build_ref=true", f"rl.ref.model_dir={model}"],
    ):
        key = overrides[-1].partition("=")[0]
        errors = _errors(overrides)
        assert any(e.startswith(f"{key}={model}") and needle in e for e in errors), errors


def test_a_model_directory_without_weights_is_named(tmp_path: Path) -> None:
    model = tmp_path / "no_weights"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    errors = _errors([f"model.name_or_path={model}"])
    assert any("no weights" in e and "*.safetensors" in e and str(model) in e for e in errors), errors
    for weights in ("pytorch_model.bin", "model-00001-of-00002.safetensors"):
        (model / weights).write_bytes(b"\0")
        assert _errors([f"model.name_or_path={model}"]) == []
        (model / weights).unlink()


def test_a_sharded_index_naming_a_missing_shard_is_named(tmp_path: Path) -> None:
    model = tmp_path / "sharded"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model-00001-of-00002.safetensors").write_bytes(b"\0")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    errors = _errors([f"model.name_or_path={model}"])
    assert any("model-00002-of-00002.safetensors" in e and "missing" in e for e in errors), errors
    (model / "model.safetensors.index.json").write_text("{broken")
    errors = _errors([f"model.name_or_path={model}"])
    assert any("model.safetensors.index.json is not JSON" in e for e in errors), errors


def test_broken_teacher_config_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    student = _model_dir(tmp_path, "student")
    teacher = _model_dir(tmp_path, "teacher", config="{}")
    status = opd_main(
        [
            "--config",
            "opd_direct",
            "--validate-manifest",
            "--",
            f"model.name_or_path={student}",
            f"rl.teacher.name_or_path={teacher}",
        ]
    )
    err = capsys.readouterr().err
    assert status == 1 and f"rl.teacher.name_or_path={teacher}" in err and "no model_type" in err


def test_the_embedded_model_cache_is_checked_when_it_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    assert _errors([]) == []  # no cache yet: the first run converts it
    cache = tmp_path / "models" / "smollm2-135m-instruct-bf16"
    cache.mkdir(parents=True)
    # the marker a finished conversion of the installed GGUF file writes (models/embedded.py)
    from posttrain.models.embedded import _fingerprint, find_gguf

    (cache / ".posttrain_complete.json").write_text(json.dumps(_fingerprint(find_gguf())))
    (cache / "config.json").write_text("{broken")
    errors = _errors([])
    assert any(
        e.startswith("model.name_or_path=embedded:smollm2-135m-instruct") and str(cache) in e and "not JSON" in e
        for e in errors
    ), errors
    (cache / ".posttrain_complete.json").unlink()  # an unfinished conversion is redone, not read
    assert _errors([]) == []


# -- 8. rl.resume must name a checkpoint -------------------------------------------------------------


def _checkpoint(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    (path / "training_state.json").write_text("{}")
    return path


def test_resume_from_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    errors = _errors([f"rl.resume={empty}"])
    assert any(e.startswith(f"rl.resume={empty}") and "not a checkpoint" in e and "manifest.json" in e for e in errors)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert any(e.startswith(f"rl.resume={a_file}") and "not a directory" in e for e in _errors([f"rl.resume={a_file}"]))


def test_resume_from_a_run_or_job_directory_names_the_checkpoint_to_use(tmp_path: Path) -> None:
    job = tmp_path / "job"
    run = job / "20250101-000000"
    _checkpoint(run / "checkpoints" / "iter_000000002")
    newest = _checkpoint(run / "checkpoints" / "iter_000000004")
    (run / "checkpoints" / "iter_000000006.tmp-123").mkdir()  # an unfinished save is no candidate
    for given in (run, run / "checkpoints", job):
        errors = _errors([f"rl.resume={given}"])
        assert any(e.startswith(f"rl.resume={given}") and f"did you mean {newest}" in e for e in errors), errors


def test_resume_from_an_unfinished_save_is_named(tmp_path: Path) -> None:
    tmp = _checkpoint(tmp_path / "checkpoints" / "iter_000000002.tmp-77")
    errors = _errors([f"rl.resume={tmp}"])
    assert any(e.startswith(f"rl.resume={tmp}") and "unfinished save" in e for e in errors), errors


def test_resume_accepts_off_auto_and_a_checkpoint(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "checkpoints" / "iter_000000002")
    for value in ("off", "auto", str(ckpt)):
        assert _errors([f"rl.resume={value}"]) == []


# -- 9. every number is finite, and sampling controls keep logits finite ------------------------------


def _holds_float(annotation: object) -> bool:
    return annotation is float or any(_holds_float(arg) for arg in typing.get_args(annotation))


def _float_fields(model: type, prefix: str = "") -> list[tuple[str, object]]:
    """Every float-typed field of a config tree, with its default."""
    found = []
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        ann = field.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            found += _float_fields(ann, f"{prefix}{name}.")
        elif _holds_float(ann):
            found.append((prefix + name, field.default))
    return found


@pytest.mark.parametrize("config_type", [GRPOConfig, OPDConfig])
def test_no_float_field_takes_inf_or_nan(config_type: type) -> None:
    fields = _float_fields(config_type)
    assert len(fields) >= 20 and ("rl.optimizer.betas", (0.9, 0.999)) in fields
    for key, default in fields:
        for bad in (math.inf, -math.inf, math.nan):
            value = [0.5, bad] if isinstance(default, tuple) else bad
            with pytest.raises(ConfigError) as info:
                apply_overrides(config_type(), [(key, value)])
            assert any(p.startswith(key) and "finite" in p for p in info.value.problems), info.value.problems


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("rl.optimizer.lr=.inf", "finite"),
        ("rl.optimizer.lr=.nan", ""),
        ("rl.optimizer.weight_decay=.inf", "finite"),
        ("rl.optimizer.eps=.inf", "finite"),
        ("rl.optimizer.eps=1e-300", "greater than or equal to 1e-30"),
        ("rl.kl_beta=.inf", "finite"),
        ("rl.kl_beta=.nan", ""),
        ("rl.optimizer.muon_rms_match=.inf", "finite"),
        ("rollout.temperature=.inf", "finite"),
        ("rollout.temperature=1e-300", "greater than or equal to 0.01"),
        ("rollout.temperature=1000", "less than or equal to 100"),
        ("rl.temperature=1e-300", "greater than or equal to 0.01"),
        ("rl.temperature=.inf", "finite"),
        ("rollout.repetition_penalty=.inf", "finite"),
        ("rollout.repetition_penalty=1e-300", "greater than or equal to 0.01"),
        ("rl.advantage_eps=1e-300", "greater than or equal to 1e-30"),
        ("grid.collective_timeout_s=1e300", "less than or equal to"),
    ],
)
def test_non_finite_and_degenerate_numbers_are_refused_by_name(override: str, needle: str) -> None:
    key = override.partition("=")[0]
    [problem] = _config_problems([override])
    assert problem.startswith(f"{key}="), problem
    assert needle in problem, problem


def test_sampling_controls_in_range_are_accepted() -> None:
    ok = ["rollout.temperature=0.01", "rl.temperature=100", "rollout.repetition_penalty=1.3"]
    assert build_config(None, ok).rollout.temperature == 0.01


# -- 10. fields every reward input has ------------------------------------------------------------------


@pytest.mark.parametrize("requires", [{"prompt", "completion"}, {"finish_reason"}, {"completion", "metadata"}])
def test_reward_inputs_every_sample_has_are_always_provided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requires: set[str]
) -> None:
    module = f"h15_reward_{'_'.join(sorted(requires))}"
    (tmp_path / f"{module}.py").write_text(
        f"def score(sample):\n    return 1.0\nscore.requires = {sorted(requires)!r}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    overrides = [f"rl.data.path={data}", "rl.data.response_column=null", f"rl.reward={module}:score"]
    assert _errors(overrides) == []
    # ground truth still has to come from the data
    (tmp_path / "gt_reward.py").write_text("def score(sample):\n    return 1.0\nscore.requires = ['ground_truth']\n")
    errors = _errors([*overrides[:2], "rl.reward=gt_reward:score"])
    assert any("needs the input 'ground_truth'" in e for e in errors), errors


def test_always_provided_fields_are_the_reward_input_fields_but_ground_truth() -> None:
    import dataclasses

    from posttrain.preflight.common import ALWAYS_PROVIDED
    from posttrain.rewards.base import RewardInput

    every_input_has = {f.name for f in dataclasses.fields(RewardInput)} - {"ground_truth"}
    assert every_input_has == ALWAYS_PROVIDED


def test_a_reward_module_raising_anything_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "odd_reward.py").write_text(
        "class Score:\n    @property\n    def requires(self):\n        raise RuntimeError('nope')\n"
        "    def __call__(self, sample):\n        return 1.0\nscore = Score()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    errors = _errors(["rl.reward=odd_reward:score"])
    assert any(e.startswith("rl.reward=odd_reward:score") and "RuntimeError('nope')" in e for e in errors), errors


def test_rollout_max_model_len_must_hold_a_prompt_and_is_read_by_vllm_only() -> None:
    from posttrain.preflight.common import check_engine_context
    from posttrain.preflight.findings import Findings

    def findings(*overrides: str) -> Findings:
        out = Findings()
        check_engine_context(build_config(None, list(overrides)), out)
        return out

    full = findings("rollout.backend=vllm", "rollout.max_model_len=64", "rollout.max_tokens=64")
    assert full.errors == [
        "rollout.max_model_len=64 leaves no room for a prompt beside rollout.max_tokens=64; "
        "raise rollout.max_model_len or lower rollout.max_tokens"
    ]
    roomy = findings("rollout.backend=vllm", "rollout.max_model_len=65", "rollout.max_tokens=64")
    assert (roomy.errors, roomy.warnings) == ([], [])
    ignored = findings("rollout.backend=hf", "rollout.max_model_len=64", "rollout.max_tokens=64")
    assert ignored.errors == []
    assert ignored.warnings == ["rollout.max_model_len=64 sets vLLM's context; rollout.backend=hf ignores it"]
    assert any("rollout.max_model_len" in p for p in _config_problems(["rollout.max_model_len=0"]))
