"""GRPO updates on image prompts, below the loop: the shape-count task, the transformers engine's
image sampler, a ``TrainBatch`` carrying ``ImageInputs``, and ``PolicyTrainer.train_on``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from posttrain.config.loading import build_config
from posttrain.data.visual import ShapeCountSource
from posttrain.errors import TrainingError
from posttrain.models.vision import VISION_TOKENS, VisionProcessor
from posttrain.policy.images import ImageInputs, freeze_vision_tower
from posttrain.policy.objective import grpo_objective
from posttrain.policy.train_batch import TrainBatch
from posttrain.policy.trainer import PolicyTrainer
from posttrain.rewards.base import RewardInput
from posttrain.rewards.registry import get_reward
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf_engine import HFRolloutEngine
from posttrain.rollout.vl_sampling import generate_image_prompts

G = 4
PROMPTS = 2


def _load(path: str) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, dtype=torch.float32)


@pytest.fixture(scope="module")
def collected(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> tuple[str, TrainBatch]:
    """One collected batch: 2 shape-count prompts x 4 samples, rewarded by ``arithmetic``; the
    advantages are fixed by hand (a random model earns no reward, and a zero advantage trains nothing)."""
    from posttrain.models.tiny import make_tiny_vl_model

    path = make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")), smollm2_tokenizer_dir)
    vp = VisionProcessor.from_dir(path)
    samples = ShapeCountSource(seed=0).next_batch(PROMPTS)
    prompts = [vp.render(s.prompt) for s in samples]  # type: ignore[arg-type]
    engine = HFRolloutEngine(_load(path), vp.tokenizer)
    vision = [int(vp.tokenizer.convert_tokens_to_ids(t)) for t in VISION_TOKENS]
    rollout = generate_image_prompts(
        engine, prompts, G, SamplingParams(max_tokens=5, seed=3), image_pad_id=vp.image_pad_id, vision_token_ids=vision
    )
    reward = get_reward("arithmetic")
    comps = rollout.completions
    scores = [
        reward(
            RewardInput(
                prompt=samples[c.prompt_index].prompt,
                completion=c.text,
                ground_truth=samples[c.prompt_index].ground_truth,
            )
        )
        for c in comps
    ]
    assert all(s in (0.0, 1.0) for s in scores)
    batch = TrainBatch(
        prompt_ids=[rollout.prompt_token_ids[c.prompt_index] for c in comps],
        completion_ids=[c.token_ids for c in comps],
        advantages_B=torch.linspace(-1.0, 1.0, len(comps)),
        in_loss_B=torch.ones(len(comps), dtype=torch.bool),
        sampler_logprobs=[c.logprobs for c in comps],
        group_size=G,
        images=ImageInputs.repeat([p.pixel_values_P for p in prompts], [p.image_grid_thw_I3 for p in prompts], G),
    )
    return path, batch


def _train(path: str, batch: TrainBatch, overrides: list[str], *, freeze: bool = False):
    torch.manual_seed(0)
    # AdamW's eps at 1e-4, not 1e-8: its first step moves a weight by lr * g / (|g| + eps), whose
    # slope lr / eps turns summation-order noise in a near-zero gradient into weight differences of
    # 1e-4 at eps 1e-8 (one element of 2,048 did so on one CPU); a wrong normaliser still moves
    # weights by O(lr) and fails the comparison below.
    adam = ["rl.optimizer.lr=1e-2", "rl.optimizer.eps=1e-4"]
    cfg = build_config(None, [f"rl.batch_per_replica={PROMPTS * G}", f"rl.group_size={G}", *adam, *overrides])
    model = _load(path)
    if freeze:
        freeze_vision_tower(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=2).train_on(batch, step=1)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return before, after, metrics


def _moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], prefix: str) -> bool:
    return any(not torch.equal(before[n], after[n]) for n in before if n.startswith(prefix))


def test_grpo_update_on_image_prompts_trains_tower_and_language_model(collected: tuple[str, TrainBatch]) -> None:
    path, batch = collected
    before, after, metrics = _train(path, batch, [])
    assert _moved(before, after, "model.visual.") and _moved(before, after, "model.language_model.")
    # The sampler's logprobs (engine) and the trainer's first forward agree on these image prompts.
    assert metrics["train/logprob_gap_max"] < 1e-4


def test_micro_batches_and_a_pi_old_pass_stay_exact(collected: tuple[str, TrainBatch]) -> None:
    path, batch = collected
    _, whole, _ = _train(path, batch, [])
    _, split, _ = _train(path, batch, ["rl.micro_batch_per_replica=3"])
    # Equal up to float summation order (the text trainer's invariance test uses the same bound).
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=2e-5, rtol=1e-4)
    # n_mini = 2: a frozen pi_old pass over the image rows first, then two optimizer steps.
    before, after, metrics = _train(path, batch, ["rl.mini_batch_per_replica=4"])
    assert _moved(before, after, "model.visual.") and all(torch.isfinite(p).all() for p in after.values())
    assert metrics["train/clip_frac"] >= 0.0


def test_frozen_vision_tower_keeps_its_weights(collected: tuple[str, TrainBatch]) -> None:
    path, batch = collected
    before, after, _ = _train(path, batch, [], freeze=True)
    assert not _moved(before, after, "model.visual.")
    assert _moved(before, after, "model.language_model.")


def test_shared_prompt_forward_is_refused_with_images(collected: tuple[str, TrainBatch]) -> None:
    path, batch = collected
    with pytest.raises(TrainingError, match=r"model\.share_prompt_prefix=true: the shared-prompt forward"):
        _train(path, batch, ["model.share_prompt_prefix=true"])
    text_only = replace(batch, images=None)
    assert text_only.images is None  # the payload is optional: a text batch is unchanged
