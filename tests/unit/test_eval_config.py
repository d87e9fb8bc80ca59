"""rl.eval: the config section, its preflight, the cadence, and the pass@k / mean@k math."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.algorithm.pass_at_k import eval_summary, pass_at_k, passing_counts
from posttrain.config.loading import build_config
from posttrain.errors import ConfigError
from posttrain.loop.evaluate import eval_sampling_params, eval_seed, eval_steps
from posttrain.metrics.report import summarize, write_report
from posttrain.preflight.grpo import grpo_preflight


def _pass_at_k_by_binomials(n: int, c: int, k: int) -> float:
    """Chen et al.'s estimator straight from its definition: 1 - C(n - c, k) / C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# -- the pure math -------------------------------------------------------------------------------


def test_pass_at_k_matches_hand_computed_binomials() -> None:
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10; k=1 is c/n; c=0 never passes; n - c < k always does.
    counts_N = torch.tensor([2, 0, 5, 4])
    assert pass_at_k(counts_N, 5, 2).tolist() == pytest.approx([0.7, 0.0, 1.0, 1.0])
    assert pass_at_k(counts_N, 5, 1).tolist() == pytest.approx([0.4, 0.0, 1.0, 0.8])
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                got = float(pass_at_k(torch.tensor([c]), n, k)[0])
                assert got == pytest.approx(_pass_at_k_by_binomials(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_k_beyond_the_samples() -> None:
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(torch.tensor([1]), 2, 3)


def test_eval_summary_by_hand() -> None:
    # Three prompts, k = 4 samples each, 0/1 rewards: 2/4, 0/4 and 4/4 pass.
    rewards_NK = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    s = {k: float(v) for k, v in eval_summary(rewards_NK, threshold=1.0).items()}
    assert s["reward_mean"] == pytest.approx(6 / 12)
    assert s["mean@k"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert s["pass@1"] == pytest.approx((2 / 4 + 0 / 4 + 4 / 4) / 3)
    assert s["pass@k"] == pytest.approx((1 + 0 + 1) / 3)  # any of the 4 passes


def test_eval_summary_real_valued_rewards_pass_at_the_threshold() -> None:
    rewards_NK = torch.tensor([[0.2, 0.6], [0.5, 0.9]])
    assert passing_counts(rewards_NK, 0.5).tolist() == [1, 2]  # >= threshold passes
    s = {k: float(v) for k, v in eval_summary(rewards_NK, threshold=0.5).items()}
    assert s["reward_mean"] == pytest.approx(2.2 / 4)
    assert s["pass@1"] == pytest.approx((1 / 2 + 2 / 2) / 2)
    assert s["pass@k"] == pytest.approx(1.0)
    # with the default threshold 1.0 nothing here passes
    assert float(eval_summary(rewards_NK, threshold=1.0)["pass@1"]) == 0.0


def test_eval_summary_refuses_an_empty_set() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        eval_summary(torch.zeros(0, 3), 1.0)


# -- cadence and sampling ------------------------------------------------------------------------


def test_eval_steps_are_zero_every_n_and_the_last() -> None:
    assert eval_steps(every_steps=2, max_steps=5) == [0, 2, 4, 5]
    assert eval_steps(every_steps=3, max_steps=6) == [0, 3, 6]
    assert eval_steps(every_steps=0, max_steps=4) == [0, 4]
    assert eval_steps(every_steps=10, max_steps=3) == [0, 3]


def test_eval_sampling_is_greedy_with_its_own_seed_by_default() -> None:
    cfg = build_config(None, ["rl.eval.enabled=true", "rollout.max_tokens=48", "rollout.seed=7", "rl.seed=3"])
    params = eval_sampling_params(cfg)
    assert params.temperature == 0.0 and params.max_tokens == 48
    assert params.seed == eval_seed(cfg) == 4  # the data seed (rl.seed=3) + 1, not rollout.seed
    assert eval_sampling_params(cfg, rank=2).seed == 6
    assert (params.top_p, params.top_k, params.repetition_penalty, params.sampler_logprobs_every) == (1.0, -1, 1.0, 0)
    cfg = build_config(None, ["rl.eval.seed=11", "rl.eval.max_tokens=5", "rl.eval.temperature=0.7"])
    params = eval_sampling_params(cfg)
    assert (params.seed, params.max_tokens, params.temperature) == (11, 5, 0.7)


# -- the section and the preflight ----------------------------------------------------------------


def test_defaults_are_off_and_greedy() -> None:
    ev = build_config(None, []).rl.eval
    assert (ev.enabled, ev.temperature, ev.max_tokens, ev.samples_per_prompt, ev.pass_threshold) == (
        False,
        0.0,
        None,
        1,
        1.0,
    )
    assert ev.data.kind == "arithmetic"


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("rl.eval.temperature=0.001", "rl.eval.temperature"),
        ("rl.eval.temperature=-1", "rl.eval.temperature"),
        ("rl.eval.num_prompts=0", "rl.eval.num_prompts"),
        ("rl.eval.samples_per_prompt=0", "rl.eval.samples_per_prompt"),
        ("rl.eval.every_steps=-1", "rl.eval.every_steps"),
        ("rl.eval.bogus=1", "rl.eval.bogus"),
    ],
)
def test_bad_values_are_refused_by_name(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        build_config(None, [override])


def test_preflight_names_a_missing_eval_file(tmp_path: Path) -> None:
    missing = tmp_path / "held_out.jsonl"
    cfg = build_config(None, ["rl.eval.enabled=true", f"rl.eval.data.path={missing}"])
    errors = grpo_preflight(cfg).errors
    assert any(e.startswith("rl.eval.data.path") and str(missing) in e for e in errors), errors
    # off: the same section is not checked
    cfg = build_config(None, ["rl.eval.enabled=false", f"rl.eval.data.path={missing}"])
    assert not any("rl.eval" in e for e in grpo_preflight(cfg).errors)


def test_preflight_names_a_bad_eval_row(tmp_path: Path) -> None:
    path = tmp_path / "held_out.jsonl"
    path.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps({"answer": "3"}) + "\n")
    cfg = build_config(None, ["rl.eval.enabled=true", f"rl.eval.data.path={path}"])
    errors = grpo_preflight(cfg).errors
    assert any(e.startswith(f"rl.eval.data: {path} line 2: missing prompt column") for e in errors), errors


def test_preflight_names_an_input_the_eval_source_lacks(tmp_path: Path) -> None:
    path = tmp_path / "prompts_only.jsonl"
    path.write_text(json.dumps({"prompt": "1+1?"}) + "\n")
    cfg = build_config(None, ["rl.eval.enabled=true", f"rl.eval.data.path={path}", "rl.eval.data.response_column=null"])
    errors = grpo_preflight(cfg).errors
    assert any("rl.eval.data" in e and "'ground_truth'" in e for e in errors), errors


def test_preflight_refuses_a_temperature_vllm_cannot_sample() -> None:
    cfg = build_config(None, ["rl.eval.enabled=true", "rl.eval.temperature=0.5", "rollout.backend=vllm"])
    assert any(e.startswith("rl.eval.temperature=0.5") for e in grpo_preflight(cfg).errors)
    cfg = build_config(None, ["rl.eval.enabled=true", "rl.eval.temperature=0", "rollout.backend=vllm"])
    assert not any("rl.eval" in e for e in grpo_preflight(cfg).errors)


def test_preflight_warns_about_a_cadence_longer_than_the_run() -> None:
    cfg = build_config(None, ["rl.eval.enabled=true", "rl.eval.every_steps=100", "rl.max_steps=5"])
    findings = grpo_preflight(cfg)
    assert any(w.startswith("rl.eval.every_steps=100") for w in findings.warnings)
    assert not any("rl.eval" in e for e in findings.errors)


# -- the report ------------------------------------------------------------------------------------


def test_report_draws_and_summarises_eval_curves(tmp_path: Path) -> None:
    frames = [{"step": 0, "eval/reward_mean": 0.1, "eval/pass@1": 0.0, "timer/eval_s": 1.0}]
    for step in range(1, 9):
        frame: dict[str, float] = {"step": step, "train/reward_mean": step / 10, "timer/e2e_step_s": 1.0}
        if step % 4 == 0:
            frame.update({"eval/reward_mean": step / 8, "eval/pass@1": step / 16, "timer/eval_s": 1.0})
        frames.append(frame)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(f) + "\n" for f in frames))
    summary = summarize([dict(f) for f in frames])
    assert summary["steps"] == 8 and summary["first_step"] == 1  # step 0's eval frame is not a step
    assert summary["reward_first_quarter_mean"] == pytest.approx(0.15)  # steps 1 and 2
    ev = summary["metrics"]["eval/reward_mean"]
    assert (ev["first_quarter_mean"], ev["final"]) == (pytest.approx(0.1), pytest.approx(1.0))
    assert summary["metrics"]["eval/pass@1"]["final"] == pytest.approx(0.5)
    png, text = write_report(tmp_path)
    assert png.stat().st_size > 10_000 and "eval/pass@1" in text
