"""Score centering end to end: the engine's top-k head, the trainer's use of it, the config rule."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.config.loading import build_config
from posttrain.loop.grpo import train
from posttrain.models.chat import render_prompt_ids
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.preflight.grpo import grpo_preflight as preflight
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf_engine import HFRolloutEngine

EOS = 2  # <|im_end|> in the SmolLM2 tokenizer
K = 8


@pytest.fixture(scope="module")
def peaked_model(tiny_model_dir: str):
    """The tiny model with weights scaled up (peaked distributions, so sampled tokens fall both inside
    and outside the top-8) and an EOS bias (so completions stop at different lengths)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = 9.0
    model.lm_head.bias = nn.Parameter(bias)
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_head_matches_the_trainer_logprobs(peaked_model, tiny_model_dir: str, temperature: float) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [
        render_prompt_ids(tokenizer, t, use_chat_template=True) for t in ["What is 2 + 3?", "Name a colour.", "Hi"]
    ]
    engine = HFRolloutEngine(peaked_model, tokenizer, batch_size=5)  # chunks split a prompt's group
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=1, logprobs_topk=K)
    out = engine.generate(prompts, 3, params)
    assert len({len(c.token_ids) for c in out.completions}) > 1  # ragged rows are exercised

    inside = outside = 0
    for c in out.completions:
        ids, lps = c.extra["head_ids"], c.extra["head_logprobs"]
        assert len(ids) == len(lps) == len(c.token_ids)
        for t, tok in enumerate(c.token_ids):
            assert len(ids[t]) == len(lps[t]) == K and len(set(ids[t])) == K
            assert lps[t] == sorted(lps[t], reverse=True) and all(math.isfinite(x) and x <= 0 for x in lps[t])
            if c.logprobs[t] >= lps[t][-1]:  # the sampled token ranks within the top-k
                inside += 1
                assert tok in ids[t]
                assert lps[t][ids[t].index(tok)] == pytest.approx(c.logprobs[t], abs=1e-6)
            else:
                outside += 1
                assert tok not in ids[t]
    assert inside > 0 and outside > 0  # both branches of the check ran

    # The trainer's logprobs at the head ids, same weights, full (uncached, right-padded) forward.
    width = max(len(c.token_ids) for c in out.completions)
    head_ids_BTK = torch.zeros((len(out.completions), width, K), dtype=torch.long)
    engine_BTK = torch.zeros((len(out.completions), width, K))
    for b, c in enumerate(out.completions):
        head_ids_BTK[b, : len(c.token_ids)] = torch.tensor(c.extra["head_ids"])
        engine_BTK[b, : len(c.token_ids)] = torch.tensor(c.extra["head_logprobs"])
    pb = build_policy_batch(
        [out.prompt_token_ids[c.prompt_index] for c in out.completions],
        [c.token_ids for c in out.completions],
        pad_id=tokenizer.pad_token_id,
        device="cpu",
    )
    with torch.no_grad():
        res = completion_logprobs(peaked_model, pb, temperature=temperature, chunk_tokens=16, head_ids_BTK=head_ids_BTK)
    assert isinstance(res, tuple)
    trainer_BTK = res[1]
    mask_BT1 = pb.completion_mask_BT[..., None] > 0
    torch.testing.assert_close(trainer_BTK * mask_BT1, engine_BTK * mask_BT1, atol=2e-5, rtol=1e-5)


def test_no_head_without_the_request(peaked_model, tiny_model_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = HFRolloutEngine(peaked_model, tokenizer).generate([[1, 2, 3]], 2, SamplingParams(max_tokens=3, seed=0))
    assert all(c.extra == {} for c in out.completions)


# score centering on top of the shared tiny-run overrides (tests/conftest.py)
SC_OVERRIDES = (
    "rollout.max_tokens=8",
    "rl.max_steps=2",
    "rl.save_every=2",
    "rl.score_centering.enabled=true",
    f"rl.score_centering.top_k={K}",
)


@pytest.mark.parametrize(
    ("compose", "extra"),
    [
        ("none", []),
        # two optimizer steps per batch: the frozen pi_old pass and its probe run with the heads
        ("tis", ["rl.mini_batch_per_replica=4"]),
        # micro-batches of 2 rows: heads padded per micro-batch
        ("mis", ["rl.micro_batch_per_replica=2"]),
    ],
)
def test_two_steps_with_score_centering(
    tiny_model_dir: str, tmp_path: Path, run_overrides: Callable[..., list[str]], compose: str, extra: list[str]
) -> None:
    cfg = build_config(
        None,
        run_overrides(
            tiny_model_dir, tmp_path, f"sc_{compose}", *SC_OVERRIDES, f"rl.score_centering.compose={compose}", *extra
        ),
    )
    assert preflight(cfg).errors == []
    run_dir = train(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0.0 < r["train/sc_head_mass_q"] <= 1.0 + 1e-6
        assert math.isfinite(r["train/sc_rho_max"]) and r["train/sc_rho_max"] > 0
        assert math.isfinite(r["train/sc_kl_head"]) and r["train/sc_kl_head"] >= -1e-6
        assert ("train/sc_mis_drop_frac" in r) == (compose == "mis")
    before = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    after = load_file(str(run_dir / "checkpoints" / "iter_000000002" / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k].to(before[k].dtype))]
    assert len(changed) > len(before) // 2, "the update moved too few tensors"


def test_config_refuses_warped_sampling_and_compose_without_centering(tiny_model_dir: str) -> None:
    base = [f"model.name_or_path={tiny_model_dir}"]
    ok = preflight(build_config(None, [*base, "rl.score_centering.enabled=true"]))
    assert ok.errors == []
    hot = preflight(build_config(None, [*base, "rl.score_centering.enabled=true", "rollout.temperature=0.7"]))
    assert any("rl.score_centering" in e and "rollout.temperature=0.7" in e for e in hot.errors), hot.errors
    orphan = preflight(build_config(None, [*base, "rl.score_centering.compose=tis"]))
    assert any("rl.score_centering.compose=tis needs rl.score_centering.enabled=true" in e for e in orphan.errors)
