"""The update with tied groups (policy/free_rows.py) on a tiny model: their rows run in a pass of
their own without autograd, the backward covers the rest, and the update and its metrics are the
ones of the plain update (every row in the backward) up to the rounding of smaller products."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config.loading import build_config
from posttrain.errors import TrainingError
from posttrain.policy.objective import grpo_objective
from posttrain.policy.train_batch import TrainBatch
from posttrain.policy.trainer import PolicyTrainer, build_reference

G = 4
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]
LENGTHS = [3, 5, 1, 4, 6, 2, 2, 3, 5, 5, 1, 2, 4, 4, 4, 7]
# groups 0 and 2 tied (not adjacent: a shared prompt pass must still get whole groups)
ADVANTAGES = [0.0] * 4 + [1.2, -0.4, -0.4, -0.4] + [0.0] * 4 + [-1.0, 1.0, 0.5, -0.5]
COMMON = ["rl.batch_per_replica=16", "rl.group_size=4", "rl.optimizer.lr=1e-3"]


def _batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    comps = [torch.randint(30, 900, (n,), generator=gen).tolist() for n in LENGTHS]
    return TrainBatch(
        prompt_ids=[p for p in PROMPTS for _ in range(G)],
        completion_ids=comps,
        advantages_B=torch.tensor(ADVANTAGES),
        in_loss_B=torch.ones(len(comps), dtype=torch.bool),
        sampler_logprobs=[[-7.0] * len(c) for c in comps],
        group_size=G,
    )


def _update(model_dir: str, overrides: list[str], *, split: bool = True, objective_loss=None):  # type: ignore[no-untyped-def]
    """One ``train_on``: the weights after it, its metrics and the body's forwards as (rows, grad)."""
    torch.manual_seed(0)
    cfg = build_config(None, [*COMMON, *overrides])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    objective = grpo_objective(cfg)
    objective = dataclasses.replace(
        objective, zero_advantage_rows_learn_nothing=split and objective.zero_advantage_rows_learn_nothing
    )
    if objective_loss is not None:
        objective = dataclasses.replace(objective, loss=objective_loss(objective.loss))
    reference = build_reference(model, cfg, objective)  # before the hook: a copy would carry it
    forwards: list[tuple[int, bool]] = []
    model.model.register_forward_pre_hook(
        lambda _m, args, kwargs: forwards.append((kwargs["input_ids"].shape[0], torch.is_grad_enabled())),
        with_kwargs=True,
    )
    trainer = PolicyTrainer(model, cfg, objective=objective, pad_id=2, ref_model=reference)
    metrics = trainer.train_on(_batch(), step=1)
    return [p.detach().clone() for p in model.parameters()], metrics, forwards


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.share_prompt_prefix=false"],
        ["model.share_prompt_prefix=true"],
        ["model.share_prompt_prefix=false", "rl.micro_batch_per_replica=8"],
        [
            "model.share_prompt_prefix=false",
            "rl.loss_type=seq-mean-token-mean",
            "rl.importance_sampling_level=sequence",
        ],
    ],
)
def test_tied_groups_skip_the_backward_and_leave_the_update_as_it_was(
    tiny_model_dir: str, overrides: list[str]
) -> None:
    plain, plain_metrics, plain_forwards = _update(tiny_model_dir, overrides, split=False)
    split, metrics, forwards = _update(tiny_model_dir, overrides)
    assert all(grad for _, grad in plain_forwards)
    assert any(not grad for _, grad in forwards)  # the tied groups went through a forward without autograd
    if "model.share_prompt_prefix=false" in overrides:  # one body forward per pass: its rows are the pass's
        assert sum(rows for rows, grad in forwards if not grad) == 8  # the two tied groups
        assert sum(rows for rows, grad in forwards if grad) == 8
    for a, b in zip(plain, split):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    for key in ("train/loss_avg", "train/clip_frac", "train/logprob_gap_mean", "train/logprob_gap_max"):
        assert metrics[key] == pytest.approx(plain_metrics[key], abs=1e-5), key
    for key in ("train/valid_token_count", "train/valid_sequence_count", "optim/update_outcome"):
        assert metrics[key] == plain_metrics[key], key


def test_mini_batches_take_their_pi_old_from_the_same_passes(tiny_model_dir: str) -> None:
    _, metrics, forwards = _update(tiny_model_dir, ["model.share_prompt_prefix=false", "rl.mini_batch_per_replica=8"])
    assert metrics["optim/step"] == 2.0  # two optimizer steps, the determinism probe held
    assert [rows for rows, grad in forwards if not grad][:2] == [4, 4]  # the pi_old pass: the update's passes


def test_a_kl_term_keeps_tied_rows_in_the_backward(tiny_model_dir: str) -> None:
    _, _, forwards = _update(tiny_model_dir, ["model.share_prompt_prefix=false", "rl.kl_beta=0.05"])
    assert [rows for rows, grad in forwards if grad] == [16]  # the reference's own forward is a copy's


def test_a_non_finite_loss_in_tied_rows_is_fatal(tiny_model_dir: str) -> None:
    def nan_without_autograd(loss):  # type: ignore[no-untyped-def]
        def wrapped(inputs, norm):  # type: ignore[no-untyped-def]
            value, stats = loss(inputs, norm)
            return (value if torch.is_grad_enabled() else value + float("nan")), stats

        return wrapped

    with pytest.raises(TrainingError, match=r"step 1: non-finite loss \(nan\) in rows whose advantages are all zero"):
        _update(tiny_model_dir, ["model.share_prompt_prefix=false"], objective_loss=nan_without_autograd)
