"""A tiny random Qwen3-MoE policy trained through posttrain's loop with the transformers engine."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from rank_runs import run_two_ranks
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from posttrain.config.loading import build_config
from posttrain.errors import TrainingError
from posttrain.models.routing_replay import record_routing
from posttrain.models.tiny import make_tiny_moe_model
from posttrain.policy.objective import grpo_objective
from posttrain.policy.train_batch import RoutingTrace, TrainBatch
from posttrain.policy.trainer import PolicyTrainer, build_reference
from tiny_models import tiny_qwen3_moe


def _checkpoint_state(iter_dir: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights in transformers' stacked expert layout, whether the checkpoint holds
    the trainer's state dict or is a Hugging Face model directory (per-expert names)."""
    if (iter_dir / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(str(iter_dir), dtype=torch.float32).state_dict()
    return load_file(str(iter_dir / "model.safetensors"))


def test_grpo_steps_on_a_moe_policy_with_the_transformers_engine(
    tmp_path: Path,
    smollm2_tokenizer_dir: str,
    run_overrides: Callable[..., list[str]],
    grpo_cli: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    """Two collected batches, two optimizer steps each (so the pi_old pass and its determinism probe
    run on the MoE too): experts and routers of every layer move."""
    model_dir = make_tiny_moe_model(str(tmp_path / "m"), smollm2_tokenizer_dir)
    extra = ("rl.max_steps=2", "rl.save_every=2", "rl.mini_batch_per_replica=4", "rl.micro_batch_per_replica=2")
    res = grpo_cli(run_overrides(model_dir, tmp_path / "out", "moe_hf", *extra))
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = next((tmp_path / "out" / "posttrain" / "grpo").glob("*/*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["optim/step"] == 2 * r["step"] and r["train/grad_norm"] > 0 for r in records)
    before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    after = _checkpoint_state(run_dir / "checkpoints" / "iter_000000002")
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    for layer in range(2):
        owner = f"model.layers.{layer}.mlp"
        assert {f"{owner}.experts.gate_up_proj", f"{owner}.experts.down_proj", f"{owner}.gate.weight"} <= moved


# -- routing replay in the trainer (traces built here: vLLM's CPU build cannot return them) ---------

G = 4
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
LENGTHS = [3, 5, 1, 4, 6, 2, 2, 3]


def _batch(traces: str) -> TrainBatch:
    """One collected batch; ``traces``: ``natural`` (the policy's own routing, recorded one sequence
    at a time as a sampler would) or ``random`` (experts the policy would not choose)."""
    gen = torch.Generator().manual_seed(0)
    comps = [torch.randint(30, 900, (n,), generator=gen).tolist() for n in LENGTHS]
    prompts = [p for p in PROMPTS for _ in range(G)]
    experts = []
    model = tiny_qwen3_moe().eval()
    for p, c in zip(prompts, comps):
        if traces == "natural":
            with record_routing(model) as rec, torch.no_grad():
                model(torch.tensor([p + c]))
            experts.append(rec[0][:-1].to(torch.int16))  # vLLM's shape: the last token never ran
        else:
            experts.append(torch.rand(len(p) + len(c) - 1, 2, 8, generator=gen).argsort(-1)[..., :2].to(torch.int16))
    return TrainBatch(
        prompt_ids=prompts,
        completion_ids=comps,
        advantages_B=torch.linspace(-1.5, 1.5, len(comps)),
        in_loss_B=torch.ones(len(comps), dtype=torch.bool),
        sampler_logprobs=[[-1.0] * len(c) for c in comps],
        group_size=G,
        routing=RoutingTrace(experts),
    )


def _train(batch: TrainBatch, overrides: list[str]) -> tuple[list[torch.Tensor], dict[str, float]]:
    torch.manual_seed(0)
    cfg = build_config(None, ["rl.batch_per_replica=8", f"rl.group_size={G}", "rl.optimizer.lr=1e-2", *overrides])
    model = tiny_qwen3_moe()
    objective = grpo_objective(cfg)
    trainer = PolicyTrainer(model, cfg, objective=objective, pad_id=0, ref_model=build_reference(model, cfg, objective))
    metrics = trainer.train_on(batch, step=1)
    return [p.detach().clone() for p in model.parameters()], metrics


KL = ["rl.kl_beta=0.1", "rl.ref.build_ref=true", "rl.kl_coeff_clamp=5.0"]
LAYOUTS = {
    "padded": ["model.share_prompt_prefix=false"],
    "shared_prompt": ["model.share_prompt_prefix=true"],
    "packed": ["model.share_prompt_prefix=false", "model.sequence_packing=true"],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replaying_the_policys_own_routing_changes_nothing(layout: str) -> None:
    """Pinned to the routing the policy would choose anyway, an update over two micro-batches with
    the KL reference equals the unpinned one: the replay touches routing only. (One optimizer step:
    after it the policy's own routing moves away from the recorded one, as a sampler's would.)"""
    batch = _batch("natural")
    common = ["rl.micro_batch_per_replica=4", *KL, *LAYOUTS[layout]]
    free, free_metrics = _train(batch, common)
    pinned, metrics = _train(batch, [*common, "rl.routing_replay=rollout"])
    for a, b in zip(free, pinned):
        # Adam turns float rounding in near-zero gradient entries into up to ~1e-5 of a step (lr 1e-2)
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert metrics["train/routing_replay_pinned_tokens"] == sum(
        len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids)
    )
    assert "train/routing_replay_pinned_tokens" not in free_metrics
    for key in ("train/loss_avg", "train/kl_mean", "train/grad_norm"):
        assert metrics[key] == pytest.approx(free_metrics[key], rel=1e-5, abs=1e-7)


def test_replay_pins_the_training_forward_pi_old_and_the_reference() -> None:
    """Random routing: the update differs from the unpinned one; with two optimizer steps the pi_old
    pass is pinned like the first mini-batch (the determinism probe passes); with one, the reference
    routes as the policy does, so the KL at the unmoved policy is exactly zero."""
    batch = _batch("random")
    two_steps = ["rl.mini_batch_per_replica=4", *KL]
    free, _ = _train(batch, two_steps)
    pinned, _ = _train(batch, [*two_steps, "rl.routing_replay=rollout"])  # the probe would raise if unpinned
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(free, pinned))
    _, one_step = _train(batch, [*KL, "rl.routing_replay=rollout"])
    assert one_step["train/kl_max"] == 0.0  # a pinned policy against an unpinned reference would not be


def test_replay_without_traces_is_refused() -> None:
    batch = _batch("random")
    batch.routing = None
    with pytest.raises(TrainingError, match="carries no routing trace"):
        _train(batch, ["rl.routing_replay=rollout"])


def test_traces_that_do_not_fit_the_policy_are_refused() -> None:
    batch = _batch("random")
    wrong_layers = RoutingTrace([t[:, :1] for t in batch.routing.experts])
    with pytest.raises(TrainingError, match="but the policy has 2 MoE layers with top-2"):
        _train(dataclasses.replace(batch, routing=wrong_layers), ["rl.routing_replay=rollout"])
    out_of_range = RoutingTrace([t + 8 for t in batch.routing.experts])
    with pytest.raises(TrainingError, match="outside the policy's 8 experts"):
        _train(dataclasses.replace(batch, routing=out_of_range), ["rl.routing_replay=rollout"])


@pytest.mark.slow
def test_grpo_steps_on_a_moe_policy_with_two_gloo_ranks(
    tmp_path: Path, smollm2_tokenizer_dir: str, run_overrides: Callable[..., list[str]]
) -> None:
    """torchrun, two FSDP2 policy ranks (each shards the stacked expert parameters as it shards any
    other): both ranks train, the gathered checkpoint's experts and routers moved."""
    model_dir = make_tiny_moe_model(str(tmp_path / "m"), smollm2_tokenizer_dir)
    two_ranks = ("grid.shapes.policy=[1,2]", "grid.collective_timeout_s=60", "rl.max_steps=2", "rl.save_every=2")
    args = run_overrides(model_dir, tmp_path / "out", "moe_two", *two_ranks)
    res = run_two_ranks("posttrain.entrypoints.grpo", ["--", *args], timeout_s=180)
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = next((tmp_path / "out" / "posttrain" / "grpo").glob("*/*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["train/grad_norm"] > 0 for r in records)
    before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    after = _checkpoint_state(run_dir / "checkpoints" / "iter_000000002")
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight"} <= moved
