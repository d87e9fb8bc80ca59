"""``--config FILE.yaml|.yml|.json`` and ``--print-config``: config trees load by the override rules,
the file's algorithm picks the command, errors name the file and the key (or line), a resolved
config loads back equal, printing imports no torch; and ``model.chat_template_kwargs`` reaches the
chat template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config.loading import RESOLVED_EXTRA_KEYS, build_config, config_yaml, resolved_tree
from posttrain.config.opd import OPDConfig
from posttrain.config.schema import GRPOConfig
from posttrain.errors import ConfigError

TREE = {
    "algorithm": "dr_grpo",
    "model": {"name_or_path": "/models/tiny", "chat_template_kwargs": {"enable_thinking": False}},
    "rl": {"max_steps": 7, "group_size": 4, "optimizer": {"lr": 3.0e-4, "lr_schedule": "cosine"}},
    "rollout": {"max_tokens": 32},
}

YAML_TEXT = """\
# a hand-written run
algorithm: dr_grpo
model:
  name_or_path: /models/tiny
  chat_template_kwargs: {enable_thinking: false}
rl:
  max_steps: 7
  group_size: 4
  optimizer:
    lr: 3.0e-4
    lr_schedule: cosine
rollout:
  max_tokens: 32
"""


def _check(cfg: GRPOConfig) -> None:
    assert cfg.algorithm == "dr_grpo"
    assert cfg.model.name_or_path == "/models/tiny"
    assert cfg.model.chat_template_kwargs == {"enable_thinking": False}
    assert (cfg.rl.max_steps, cfg.rl.group_size, cfg.rollout.max_tokens) == (7, 4, 32)
    assert cfg.rl.optimizer.lr == 3e-4 and cfg.rl.optimizer.lr_schedule == "cosine"
    assert cfg.rl.batch_per_replica == GRPOConfig().rl.batch_per_replica  # unset: the field's default


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_yaml_file_loads_and_overrides_apply_on_top(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"run{suffix}"
    path.write_text(YAML_TEXT)
    _check(build_config(str(path)))
    cfg = build_config(str(path), ["rl.max_steps=2", "model.chat_template_kwargs={enable_thinking: true}"])
    assert cfg.rl.max_steps == 2 and cfg.model.chat_template_kwargs == {"enable_thinking": True}


def test_json_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(TREE))
    _check(build_config(str(path)))


def test_yaml_values_follow_yaml_1_2(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("job:\n  name: 010\n  group: 1:30\nrl:\n  seed: 010\n")
    with pytest.raises(ConfigError, match=r"job\.name=10: Input should be a valid string"):
        build_config(str(path))  # 010 is the integer 10 (YAML 1.2: decimal), not text, not octal 8
    path.write_text("job:\n  name: '010'\n  group: 1:30\nrl:\n  seed: 010\n")
    cfg = build_config(str(path))
    assert (cfg.job.name, cfg.job.group, cfg.rl.seed) == ("010", "1:30", 10)


def test_wrong_algorithm_is_refused_with_the_right_command(tmp_path: Path) -> None:
    opd = tmp_path / "opd.yaml"
    opd.write_text("algorithm: opd\nrl:\n  max_steps: 3\n")
    with pytest.raises(ConfigError) as caught:
        build_config(str(opd))
    assert caught.value.problems == [
        f"--config {opd}: algorithm='opd' is an OPD run, which this command does not train; run it with "
        f"`posttrain opd --config {opd}`"
    ]
    assert build_config(str(opd), (), OPDConfig).rl.max_steps == 3
    grpo = tmp_path / "grpo.json"
    grpo.write_text('{"algorithm": "gspo"}')
    with pytest.raises(ConfigError, match=r"is a GRPO run, .*run it with `posttrain grpo --config"):
        build_config(str(grpo), (), OPDConfig)


def test_bad_keys_and_values_are_named_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("rl:\n  max_stepz: 3\n  group_size: many\nmodel:\n  dtype: float64\n")
    with pytest.raises(ConfigError) as caught:
        build_config(str(path))
    problems = caught.value.problems
    assert len(problems) == 3
    assert all(p.startswith(f"--config {path}: ") for p in problems)
    joined = "\n".join(problems)
    assert "unknown key 'rl.max_stepz'; did you mean rl.max_steps" in joined
    assert "rl.group_size='many': Input should be a valid integer" in joined
    assert "model.dtype='float64'" in joined


def test_an_opd_file_with_a_grpo_knob_says_why(tmp_path: Path) -> None:
    path = tmp_path / "opd.yaml"
    path.write_text("algorithm: opd\nrl:\n  kl_beta: 0.1\n")
    with pytest.raises(
        ConfigError, match=r"--config .*opd\.yaml: unknown key 'rl\.kl_beta': rl\.kl_beta is a GRPO knob"
    ):
        build_config(str(path), (), OPDConfig)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("dup.yaml", "rl:\n  max_steps: 1\n  max_steps: 2\n", r"dup\.yaml line 3: key 'max_steps' is given twice"),
        ("dup.json", '{"rl": {"seed": 1,\n "seed": 2}}', r"dup\.json: key 'seed' is given twice"),
        ("broken.yaml", "rl:\n  max_steps: [1\n", r"broken\.yaml line 3: not valid YAML"),
        ("broken.json", '{\n"rl": {"max_steps": 2,}}', r"broken\.json line 2: not valid JSON"),
        ("anchor.yaml", "rl:\n  seed: &s 1\n", r"anchor\.yaml line 2: anchors and aliases"),
        ("tag.yaml", "rl:\n  seed: !!str 1\n", r"tag\.yaml line 2: tag '!!str'"),
        ("list.yaml", "- rl\n- model\n", r"list\.yaml: holds a list; a config file is a map of sections"),
    ],
)
def test_unreadable_files_are_named_with_their_line(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        build_config(str(path))


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--config '.*nope\.yaml': no such file"):
        build_config(str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize("config_type", [GRPOConfig, OPDConfig])
def test_a_resolved_config_loads_back_equal(tmp_path: Path, config_type: type) -> None:
    """What config_resolved.yaml holds (with argv and provenance) reads back to the same config."""
    cfg = build_config(
        None,
        ["rl.max_steps=3", "job.name='0o17'", "rl.data.system_prompt='1e5'", "model.chat_template_kwargs={x: null}"],
        config_type,
    )
    tree = {**resolved_tree(cfg), "argv": ["posttrain", "grpo"], "provenance": {"tree_hash": "abc"}}
    assert set(tree) - set(cfg.model_dump()) == set(RESOLVED_EXTRA_KEYS)
    path = tmp_path / "config_resolved.yaml"
    path.write_text(config_yaml(tree))
    again = build_config(str(path), (), config_type)
    assert again == cfg
    assert again.job.name == "0o17" and again.rl.data.system_prompt == "1e5"  # text stays text


def test_reserved_chat_template_kwargs_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"add_generation_prompt is set by posttrain itself"):
        build_config(None, ["model.chat_template_kwargs={add_generation_prompt: false}"])


def test_print_config_prints_yaml_that_loads_back_and_imports_no_torch(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(YAML_TEXT)
    code = (
        "import sys\n"
        "from posttrain.entrypoints.grpo import main\n"
        f"status = main(['--config', {str(path)!r}, '--print-config', '--', 'rl.max_steps=5'])\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n"
        "sys.exit(status)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "NO-TORCH"
    assert "max_steps: 5\n" in out.stdout and "resolved:\n" in out.stdout
    printed = tmp_path / "printed.yaml"
    printed.write_text(out.stdout)
    assert build_config(str(printed)) == build_config(str(path), ["rl.max_steps=5"])


def test_print_config_reports_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from posttrain.entrypoints.grpo import main

    path = tmp_path / "bad.json"
    path.write_text('{"rl": {"max_stepz": 1}}')
    assert main(["--config", str(path), "--print-config"]) == 1
    err = capsys.readouterr().err
    assert f"--config {path}: unknown key 'rl.max_stepz'" in err


def test_chat_template_kwargs_reach_the_template(smollm2_tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer

    from posttrain.models.chat import render_prompt_ids

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
    )
    plain = tok.decode(render_prompt_ids(tok, "hi", use_chat_template=True))
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    off = render_prompt_ids(tok, "hi", use_chat_template=True, chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(off) == plain + "<think></think>"
    on = render_prompt_ids(tok, "hi", use_chat_template=True, chat_template_kwargs={"enable_thinking": True})
    assert tok.decode(on) == plain
