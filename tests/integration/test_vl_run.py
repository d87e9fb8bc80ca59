"""Multimodal GRPO runs through the real entrypoint on a tiny random Qwen3-VL (CPU, transformers engine).

The built-in shape-count task (``posttrain.data.visual:shape_count_rows``, images as bytes) and a
JSONL file of image rows (paths) feed a run of a few steps: the vision tower and the language
model move, the sampler's logprobs agree with the trainer's first forward on the image prompts,
an interrupted run resumed from its step-2 checkpoint reproduces step 3 of the uninterrupted run
(metrics and weights, bitwise: CPU, one process), and ``model.freeze_vision_tower`` leaves the
tower bitwise unchanged while the language model trains and the optimizer holds no tower parameter
(that run also draws with dynamic sampling, which carries each group's images, and evaluates on
image prompts at step 0 and at the end).

A random model never counts right, so the runs are scored by the e2e length reward (a signal for
every group); the count reward itself is tested in tests/unit/test_vl_data.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.entrypoints.grpo import main

E2E_DIR = Path(__file__).parent.parent / "fixtures" / "e2e"
VISUAL = "model.visual."
TEXT = "model.language_model."


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    from posttrain.models.tiny import make_tiny_vl_model

    return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")), smollm2_tokenizer_dir)


def _overrides(vl_dir: str, out: Path, name: str, *extra: str) -> list[str]:
    return [
        f"model.name_or_path={vl_dir}",
        f"job.output_root={out}",
        f"job.name={name}",
        "rl.data.factory=posttrain.data.visual:shape_count_rows",
        "rl.reward=e2e_rewards:length_reward",
        "rl.batch_per_replica=8",
        "rl.group_size=4",
        "rollout.max_tokens=6",
        "rl.optimizer.lr=1e-3",
        "rl.max_steps=3",
        *extra,
    ]


def _run(overrides: list[str]) -> Path:
    assert main(["--", *overrides]) == 0
    job = next(o.split("=", 1)[1] for o in overrides if o.startswith("job.name="))
    root = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("job.output_root=")))
    return sorted((root / "posttrain" / "grpo" / job).iterdir())[-1]


def _frames(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"iter_{step:09d}" / "model.safetensors"))


def _moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], prefix: str) -> bool:
    keys = [k for k in before if k.startswith(prefix)]
    assert keys, prefix
    return any(not torch.equal(before[k], after[k]) for k in keys)


@pytest.fixture(scope="module")
def whole_run(vl_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three uninterrupted steps with a checkpoint after each and the completions logged."""
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(E2E_DIR))
    try:
        out = tmp_path_factory.mktemp("vl_runs")
        return _run(_overrides(vl_dir, out, "whole", "rl.save_every=1", "job.log_completions_every=1"))
    finally:
        mp.undo()


def test_multimodal_grpo_run_trains_tower_and_language_model(vl_dir: str, whole_run: Path) -> None:
    frames = _frames(whole_run)
    assert [f["step"] for f in frames] == [1, 2, 3]
    for f in frames:
        assert f["train/grad_norm"] > 0 and f["optim/step"] == f["step"]
        # engine (image sampler) and trainer (image forward) score the same tokens alike
        assert f["train/logprob_gap_max"] < 1e-4
    before = load_file(str(Path(vl_dir) / "model.safetensors"))
    after = _weights(whole_run, 3)
    assert _moved(before, after, VISUAL) and _moved(before, after, TEXT)
    # completions.jsonl names each image by its size instead of holding its bytes
    first = json.loads((whole_run / "completions.jsonl").read_text().splitlines()[0])
    image_part = first["prompt"][0]["content"][0]
    assert image_part["type"] == "image" and image_part["image"].endswith(" bytes>")


def test_resumed_multimodal_run_equals_the_uninterrupted_one(vl_dir: str, whole_run: Path, tmp_path: Path) -> None:
    resume = f"rl.resume={whole_run / 'checkpoints' / 'iter_000000002'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(E2E_DIR))
        resumed = _run(_overrides(vl_dir, tmp_path, "resumed", resume, "rl.save_every=1"))
    a, b = _frames(whole_run), _frames(resumed)
    assert [f["step"] for f in b] == [1, 2, 3]

    def comparable(frame: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in frame.items() if not k.startswith(("timer/", "rollout/", "memory/"))}

    assert comparable(b[2]) == comparable(a[2])
    whole, again = _weights(whole_run, 3), _weights(resumed, 3)
    assert whole.keys() == again.keys() and all(torch.equal(whole[k], again[k]) for k in whole)


def test_frozen_vision_tower_on_jsonl_rows_with_dynamic_sampling_and_eval(vl_dir: str, tmp_path: Path) -> None:
    rows = tmp_path / "rows"
    from posttrain.data.visual import write_dataset

    jsonl = write_dataset(str(rows), rows=8, seed=0)  # image rows naming PNG files by path
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(E2E_DIR))
        extra = [f"rl.data.path={jsonl}", "rl.data.prompt_column=messages"]
        extra += ["model.freeze_vision_tower=true", "rl.save_every=3", "rl.max_steps=2"]
        # dynamic sampling carries each group's images; the evaluation renders its own image prompts
        extra += ["rl.min_informative_groups_frac=1.0", "rl.eval.enabled=true", "rl.eval.num_prompts=2"]
        extra += ["rl.eval.data.factory=posttrain.data.visual:shape_count_rows", "rl.eval.every_steps=0"]
        run_dir = _run([o for o in _overrides(vl_dir, tmp_path, "frozen", *extra) if "rl.data.factory" not in o])
    before = load_file(str(Path(vl_dir) / "model.safetensors"))
    after = _weights(run_dir, 2)
    frozen = [k for k in before if k.startswith(VISUAL)]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert _moved(before, after, TEXT)
    evaluated = [f["step"] for f in _frames(run_dir) if "eval/reward_mean" in f]
    assert evaluated == [0, 2]

    from posttrain.config.loading import build_config
    from posttrain.loop.vision import prepare_vision_policy
    from posttrain.metrics.sinks import OffRankLogger
    from posttrain.models.loading import load_model_and_tokenizer
    from posttrain.policy.optim import build_optimizer

    cfg = build_config(None, [f"model.name_or_path={vl_dir}", "model.freeze_vision_tower=true"])
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    prepare_vision_policy(cfg, model, tokenizer, OffRankLogger())
    optimizer = build_optimizer(model, cfg.rl.optimizer, torch.device("cpu"))
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    tower = [p for n, p in model.named_parameters() if n.startswith(VISUAL)]
    assert tower and not any(id(p) in in_optimizer for p in tower)
    assert len(in_optimizer) == sum(1 for p in model.parameters() if p.requires_grad)
