"""Config files train: a hand-written YAML file runs a tiny job and the run's own
``config_resolved.yaml``, given back as ``--config``, reproduces its metrics exactly (timers aside);
a JSON file trains with ``model.chat_template_kwargs`` reaching the policy's chat template."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from posttrain.config.loading import build_config
from posttrain.loop.grpo import train

RunOverrides = Callable[..., list[str]]


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timers(records: list[dict[str, float]]) -> list[dict[str, float]]:
    """Every key but wall-clock measurements (``timer/*``, seconds ``*_s`` and throughputs ``*_per_s``)."""
    return [{k: v for k, v in r.items() if not k.startswith("timer/") and not k.endswith("_s")} for r in records]


def test_yaml_run_relaunched_from_its_config_resolved_yaml_gives_identical_metrics(
    tiny_model_dir: str, tmp_path: Path, run_overrides: RunOverrides
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"""\
algorithm: grpo
job:
  output_root: {tmp_path / "out"}
  name: from_yaml
model:
  name_or_path: {tiny_model_dir}
rollout:
  max_tokens: 12
rl:
  max_steps: 2
  batch_per_replica: 8
  group_size: 4
  reward: e2e_rewards:length_reward
  optimizer:
    lr: 1.0e-3
    warmup_steps: 1
"""
    )
    first = train(build_config(str(path)), argv=["posttrain", "grpo", "--config", str(path)])
    resolved = first / "config_resolved.yaml"
    assert "argv:" in resolved.read_text() and "provenance:" in resolved.read_text()
    again = train(build_config(str(resolved)), argv=["posttrain", "grpo", "--config", str(resolved)])
    assert again != first and again.parent == first.parent  # a new attempt of the same job
    records = read_metrics(first)
    assert [r["step"] for r in records] == [1, 2]
    assert without_timers(read_metrics(again)) == without_timers(records)
    assert any(k.startswith("timer/") for k in records[0])  # the timers exist; only they are left out


TEMPLATE = (
    "{% if enable_thinking is not defined %}{{ raise_exception('enable_thinking was not passed') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


def test_json_run_passes_chat_template_kwargs_to_the_template(
    tiny_model_dir: str, tmp_path: Path, run_overrides: RunOverrides
) -> None:
    """The template refuses to render unless ``enable_thinking`` is passed: the run trains only
    because the loop hands the model's kwargs to it."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    tree = {
        "algorithm": "grpo",
        "job": {"output_root": str(tmp_path / "out"), "name": "from_json"},
        "model": {"name_or_path": str(model_dir), "chat_template_kwargs": {"enable_thinking": False}},
        "rollout": {"max_tokens": 8},
        "rl": {"max_steps": 1, "batch_per_replica": 4, "group_size": 2, "reward": "e2e_rewards:length_reward"},
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(tree))
    run_dir = train(build_config(str(path)))
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    with pytest.raises(Exception, match="enable_thinking was not passed"):
        train(build_config(str(path), ["model.chat_template_kwargs={}", "job.name=no_kwargs"]))
