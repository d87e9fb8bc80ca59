"""LoRA on a tiny random model (``model.lora``, ``models/lora.py``): only adapter tensors move, the
adapter-disabled reference equals a separate frozen copy, the transformers engine samples with the
current adapter, checkpoints hold the adapter alone and resume exactly, ``export-hf`` merges it, and
two gloo ranks (FSDP2 over the peft model) train and resume."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

pytest.importorskip("peft", reason="peft is not installed (pip install 'posttrain[lora]')")

from rank_runs import run_two_ranks

from posttrain.config.loading import build_config
from posttrain.config.schema import GRPOConfig
from posttrain.models.lora import apply_lora, checkpoint_module, is_lora
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.policy.objective import grpo_objective
from posttrain.policy.shared_prefix import build_grouped_batch, grouped_completion_logprobs
from posttrain.policy.train_batch import TrainBatch
from posttrain.policy.trainer import PolicyTrainer, build_reference
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf_engine import HFRolloutEngine

G = 4
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]
LENGTHS = [3, 5, 1, 4, 6, 2, 2, 3, 5, 5, 1, 2, 4, 4, 4, 7]
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def _batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    comps = [torch.randint(30, 900, (n,), generator=gen).tolist() for n in LENGTHS]
    return TrainBatch(
        prompt_ids=[p for p in PROMPTS for _ in range(G)],
        completion_ids=comps,
        advantages_B=torch.linspace(-1.5, 1.5, len(comps)),
        in_loss_B=torch.ones(len(comps), dtype=torch.bool),
        sampler_logprobs=[[-1.0] * len(c) for c in comps],
        group_size=G,
    )


def _config(*overrides: str) -> GRPOConfig:
    cfg = build_config(None, ["rl.batch_per_replica=16", "rl.group_size=4", "rl.optimizer.lr=1e-2", *overrides])
    assert isinstance(cfg, GRPOConfig)
    return cfg


def _lora_policy(model_dir: str, cfg: GRPOConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return apply_lora(model, cfg.model.lora)


def _trained(model_dir: str, *overrides: str) -> tuple[torch.nn.Module, PolicyTrainer, GRPOConfig]:
    cfg = _config(*LORA, *overrides)
    policy = _lora_policy(model_dir, cfg)
    objective = grpo_objective(cfg)
    trainer = PolicyTrainer(
        policy, cfg, objective=objective, pad_id=2, ref_model=build_reference(policy, cfg, objective)
    )
    trainer.train_on(_batch(), step=1)
    return policy, trainer, cfg


def _logprobs(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    pb = build_policy_batch(batch.prompt_ids, batch.completion_ids, pad_id=2, device="cpu")
    with torch.no_grad():
        out = completion_logprobs(model, pb, temperature=1.0, chunk_tokens=16)
    assert isinstance(out, torch.Tensor)
    return out


def test_only_adapter_tensors_change_and_only_they_are_optimised(tiny_model_dir: str) -> None:
    cfg = _config(*LORA, "model.lora.modules_to_save=[model.norm]")
    policy = _lora_policy(tiny_model_dir, cfg)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer = PolicyTrainer(policy, cfg, objective=grpo_objective(cfg), pad_id=2)
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert {n for n, p in policy.named_parameters() if id(p) in optimised} == trainable
    assert all(".lora_" in n or ".modules_to_save." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2 + 1  # A and B on 7 linear layers x 2 decoder layers, the norm copy
    trained = {k for k in before if ".lora_" in k or ".modules_to_save." in k}
    trainer.train_on(_batch(), step=1)
    moved = {k for k, v in policy.state_dict().items() if not torch.equal(before[k], v)}
    # step 1: B = 0, so A's gradient (through B) is exactly zero: every B and the norm copy move, no A
    assert moved == {k for k in trained if ".lora_A." not in k}
    trainer.train_on(_batch(), step=2)
    moved = {k for k, v in policy.state_dict().items() if not torch.equal(before[k], v)}
    assert moved == trained  # now A too; no base weight ever


def test_reference_by_disabling_equals_a_separate_frozen_copy(tiny_model_dir: str) -> None:
    policy, trainer, _ = _trained(tiny_model_dir, "rl.kl_beta=0.1", "rl.ref.build_ref=true", "rl.kl_coeff_clamp=5")
    reference = trainer.ref_model
    assert reference is not None and not is_lora(reference)
    assert {id(p) for p in reference.parameters()} == {id(p) for p in policy.parameters()}  # no second copy
    frozen = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = _batch()
    policy.eval()
    ref_BT, copy_BT, policy_BT = _logprobs(reference, batch), _logprobs(frozen, batch), _logprobs(policy, batch)
    torch.testing.assert_close(ref_BT, copy_BT, atol=1e-6, rtol=0)
    assert (policy_BT - copy_BT).abs().max() > 1e-3  # the adapter is on outside the reference
    grouped = build_grouped_batch(PROMPTS, batch.completion_ids, group_size=G, pad_id=2, device="cpu")
    with torch.no_grad():
        shared = grouped_completion_logprobs(reference, grouped, temperature=1.0)
    torch.testing.assert_close(shared, copy_BT, atol=1e-5, rtol=0)


def test_hf_engine_samples_with_the_current_adapter(tiny_model_dir: str) -> None:
    from posttrain.distributed.fsdp import PolicyWeights

    policy, _, _ = _trained(tiny_model_dir)
    engine = HFRolloutEngine(policy, _tokenizer(tiny_model_dir), batch_size=8)
    engine.receive_weights(PolicyWeights(policy), version=1)
    out = engine.generate(PROMPTS[:2], 2, SamplingParams(max_tokens=6, temperature=1.0, seed=0))
    assert out.weight_version == 1
    batch = TrainBatch(
        prompt_ids=[out.prompt_token_ids[c.prompt_index] for c in out.completions],
        completion_ids=[c.token_ids for c in out.completions],
        advantages_B=torch.zeros(4),
        in_loss_B=torch.ones(4, dtype=torch.bool),
        sampler_logprobs=[c.logprobs for c in out.completions],
        group_size=2,
    )
    trainer_BT = _logprobs(policy, batch)
    base_BT = _logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(), batch)
    for i, c in enumerate(out.completions):
        assert c.logprobs is not None
        torch.testing.assert_close(torch.tensor(c.logprobs), trainer_BT[i, : len(c.token_ids)], atol=1e-4, rtol=0)
    assert (trainer_BT - base_BT).abs().max() > 1e-3


def test_a_transformers_replica_takes_the_adapter_alone_and_samples_as_the_policy(tiny_model_dir: str) -> None:
    """A disaggregated replica's side (``rollout/replica_lora.py``), in this process: the policy sends
    its adapter alone; a partial adapter is refused before anything is copied; the whole one makes the
    replica (its own copy of the base, wrapped the same way) sample exactly what the policy does."""
    from posttrain.distributed.fsdp import PolicyWeights
    from posttrain.errors import TrainingError
    from posttrain.rollout.factory import build_hf_engine
    from posttrain.rollout.replica import build_replica
    from posttrain.rollout.replica_lora import sync_tensors

    policy, _, cfg = _trained(tiny_model_dir, f"model.name_or_path={tiny_model_dir}")
    replica = build_replica(cfg)
    sent = sync_tensors(PolicyWeights(policy))
    assert set(sent) == {n for n, p in policy.named_parameters() if p.requires_grad} and len(sent) == 28
    before = {k: v.clone() for k, v in replica.engine.model.state_dict().items()}
    with pytest.raises(TrainingError, match=r"version 1 does not fit the rollout replica's model\.lora: 1 missing"):
        replica.load_weights(dict(list(sent.items())[1:]), 1)
    assert all(torch.equal(v, before[k]) for k, v in replica.engine.model.state_dict().items())  # nothing copied
    replica.load_weights(sent, 1)
    assert replica.engine.weight_version == 1
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=0)
    got = replica.generate(0, PROMPTS[:2], 2, params)
    want = build_hf_engine(cfg, policy, _tokenizer(tiny_model_dir)).generate(PROMPTS[:2], 2, params)
    assert [c.token_ids for c in got.completions] == [c.token_ids for c in want.completions]
    assert [c.logprobs for c in got.completions] == [c.logprobs for c in want.completions]


def _tokenizer(model_dir: str):
    from posttrain.models.loading import load_tokenizer

    return load_tokenizer(model_dir)


def test_checkpoint_view_holds_the_adapter_alone(tiny_model_dir: str) -> None:
    policy, _, _ = _trained(tiny_model_dir)
    view = checkpoint_module(policy)
    names = set(view.state_dict())
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    copy = _lora_policy(tiny_model_dir, _config(*LORA))
    checkpoint_module(copy).load_state_dict(view.state_dict())
    for (n, a), b in zip(policy.state_dict().items(), copy.state_dict().values()):
        assert torch.equal(a, b), n
    other = _lora_policy(tiny_model_dir, _config("model.lora.rank=8"))
    with pytest.raises(RuntimeError, match="other shapes"):
        checkpoint_module(other).load_state_dict(view.state_dict())


def _frames(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(records: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not k.startswith(("timer/", "rollout/", "memory/"))} for r in records]


def test_lora_run_checkpoints_resume_exactly_and_export_merges(
    tiny_model_dir: str, tmp_path: Path, run_overrides: Callable[..., list[str]]
) -> None:
    from posttrain.checkpoint.export import export_hf
    from posttrain.loop.grpo import train

    common = [*LORA, "rl.optimizer.lr=1e-2", "rl.max_steps=3", "rl.save_every=1"]
    whole = train(build_config(None, run_overrides(tiny_model_dir, tmp_path, "whole", *common)))
    ckpt = whole / "checkpoints"
    adapter = load_file(str(ckpt / "iter_000000003" / "model.safetensors"))
    assert adapter and all(".lora_" in k for k in adapter)  # the adapter alone, no base weight
    assert (ckpt / "iter_000000003" / "hf" / "adapter_config.json").is_file()
    resumed_cfg = run_overrides(tiny_model_dir, tmp_path, "cut", *common, f"rl.resume={ckpt / 'iter_000000001'}")
    resumed = train(build_config(None, resumed_cfg))
    assert _comparable(_frames(resumed)) == _comparable(_frames(whole))
    again = load_file(str(resumed / "checkpoints" / "iter_000000003" / "model.safetensors"))
    assert all(torch.equal(adapter[k], again[k]) for k in adapter)

    out = export_hf(ckpt / "iter_000000003", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert not any("lora" in k for k in merged.state_dict())
    policy = _lora_policy(tiny_model_dir, _config(*LORA))
    checkpoint_module(policy).load_state_dict(adapter)
    policy.eval()
    batch = _batch()
    torch.testing.assert_close(_logprobs(merged, batch), _logprobs(policy, batch), atol=1e-5, rtol=0)


def test_two_gloo_ranks_train_lora_and_resume(
    tiny_model_dir: str, tmp_path: Path, run_overrides: Callable[..., list[str]]
) -> None:
    two = ["grid.shapes.policy=[1,2]", "grid.collective_timeout_s=60"]
    kl = ["rl.kl_beta=0.1", "rl.ref.build_ref=true", "rl.kl_coeff_clamp=5"]
    overrides = run_overrides(tiny_model_dir, tmp_path, "two", *LORA, *two, *kl, "rl.max_steps=3")
    res = run_two_ranks("posttrain.entrypoints.grpo", ["--", *overrides, "rl.save_every=2"], timeout_s=180)
    assert res.returncode == 0, res.stderr[-3000:]
    (run_dir,) = (tmp_path / "posttrain" / "grpo" / "two").iterdir()
    frames = _frames(run_dir)
    assert [f["step"] for f in frames] == [1, 2, 3]
    assert all(math.isfinite(f["train/loss_avg"]) and f["train/grad_norm"] > 0 for f in frames)
    assert frames[0]["train/kl_mean"] == pytest.approx(0.0, abs=1e-6)  # B = 0: the policy is its base
    assert frames[2]["train/kl_mean"] > 0
    resumed = run_two_ranks(
        "posttrain.entrypoints.grpo",
        ["--", *overrides, f"rl.resume={run_dir / 'checkpoints' / 'iter_000000002'}", "job.name=resumed"],
        timeout_s=180,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (again_dir,) = (tmp_path / "posttrain" / "grpo" / "resumed").iterdir()
    again = _frames(again_dir)
    for key in ("train/loss_avg", "train/grad_norm", "train/reward_mean", "train/kl_mean"):
        assert again[2][key] == pytest.approx(frames[2][key], rel=1e-6, abs=1e-9), key


def test_opd_trains_the_adapter_alone(tiny_model_dir: str, tmp_path: Path) -> None:
    from posttrain.entrypoints.opd import main as opd_main

    overrides = [
        f"model.name_or_path={tiny_model_dir}",
        f"rl.teacher.name_or_path={tiny_model_dir}",
        f"job.output_root={tmp_path}",
        "job.name=opd_lora",
        "rl.data.arithmetic_max=5",
        "rl.max_steps=2",
        "rl.save_every=2",
        "rl.batch_per_replica=8",
        "rl.group_size=4",
        "rollout.max_tokens=6",
        "rl.teacher.top_k=4",
        "rl.optimizer.lr=1e-2",
        *LORA,
    ]
    assert opd_main(["--config", "opd_direct", "--", *overrides]) == 0
    (run_dir,) = (tmp_path / "posttrain" / "opd" / "opd_lora").iterdir()
    frames = _frames(run_dir)
    assert [f["step"] for f in frames] == [1, 2] and all(f["train/grad_norm"] > 0 for f in frames)
    saved = load_file(str(run_dir / "checkpoints" / "iter_000000002" / "model.safetensors"))
    assert saved and all(".lora_" in k for k in saved)
    assert any(".lora_B." in k and bool(v.abs().sum() > 0) for k, v in saved.items())  # B left zero: it trained
