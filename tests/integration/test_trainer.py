"""The policy update on a tiny model: the shared-prompt pass, sequence packing, micro-batch invariance,
mini-batches, tied groups without a backward."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config.loading import build_config
from posttrain.errors import TrainingError
from posttrain.models.tiny import make_tiny_moe_model
from posttrain.policy.batching import PolicyBatch, build_policy_batch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.policy.objective import grpo_objective
from posttrain.policy.shared_prefix import build_grouped_batch, grouped_completion_logprobs
from posttrain.policy.train_batch import TrainBatch
from posttrain.policy.trainer import PolicyTrainer, build_reference

G = 4
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]
LENGTHS = [3, 5, 1, 4, 6, 2, 2, 3, 5, 5, 1, 2, 4, 4, 4, 7]


def _completions() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(30, 900, (n,), generator=gen).tolist() for n in LENGTHS]


def _batch() -> TrainBatch:
    comps = _completions()
    adv = torch.linspace(-1.5, 1.5, len(comps))
    return TrainBatch(
        prompt_ids=[p for p in PROMPTS for _ in range(G)],
        completion_ids=comps,
        advantages_B=adv,
        in_loss_B=torch.ones(len(comps), dtype=torch.bool),
        sampler_logprobs=[[-1.0] * len(c) for c in comps],
        group_size=G,
    )


def _load(model_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def test_shared_prompt_pass_matches_plain_pass(tiny_model_dir: str) -> None:
    model = _load(tiny_model_dir)
    comps = _completions()
    grouped = build_grouped_batch(PROMPTS, comps, group_size=G, pad_id=2, device="cpu")
    plain = build_policy_batch([p for p in PROMPTS for _ in range(G)], comps, pad_id=2, device="cpu")
    a = grouped_completion_logprobs(model, grouped, temperature=0.7)
    b = completion_logprobs(model, plain, temperature=0.7)
    assert isinstance(b, torch.Tensor)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert torch.equal(a == 0, plain.completion_mask_BT == 0)
    a.sum().backward()
    grads_a = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    b.sum().backward()
    for ga, p in zip(grads_a, model.parameters()):
        torch.testing.assert_close(ga, p.grad, atol=1e-4, rtol=1e-4)


def _trained_params(model_dir: str, overrides: list[str]) -> tuple[list[torch.Tensor], dict[str, float]]:
    torch.manual_seed(0)
    cfg = build_config(None, ["rl.batch_per_replica=16", "rl.group_size=4", "rl.optimizer.lr=1e-3", *overrides])
    model = _load(model_dir)
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=2)
    metrics = trainer.train_on(_batch(), step=1)
    return [p.detach().clone() for p in model.parameters()], metrics


@pytest.mark.parametrize("loss_type", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-fixed"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batches_and_prefix_sharing_do_not_change_the_update(
    tiny_model_dir: str, loss_type: str, level: str
) -> None:
    common = [f"rl.loss_type={loss_type}", f"rl.importance_sampling_level={level}"]
    reference, ref_metrics = _trained_params(tiny_model_dir, [*common, "model.share_prompt_prefix=false"])
    packed = ["model.share_prompt_prefix=false", "model.sequence_packing=true"]
    for extra in (
        ["rl.micro_batch_per_replica=4", "model.share_prompt_prefix=true"],
        ["rl.micro_batch_per_replica=8", "model.share_prompt_prefix=true"],
        ["rl.micro_batch_per_replica=2", "model.share_prompt_prefix=true"],
        packed,  # the whole batch packed into rows of its longest sequence
        ["rl.micro_batch_per_replica=8", *packed],
    ):
        params, metrics = _trained_params(tiny_model_dir, [*common, *extra])
        for a, b in zip(reference, params):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
        assert metrics["train/loss_avg"] == pytest.approx(ref_metrics["train/loss_avg"], abs=1e-5)
        assert metrics["train/clip_frac"] == 0.0


def test_auto_prefix_sharing_follows_prompt_and_completion_lengths(tiny_model_dir: str) -> None:
    cfg = build_config(None, ["rl.batch_per_replica=4", "rl.group_size=2"])
    assert cfg.model.share_prompt_prefix == "auto"
    trainer = PolicyTrainer(_load(tiny_model_dir), cfg, objective=grpo_objective(cfg), pad_id=2)
    long_prompts = TrainBatch(
        [[1] * 10] * 4, [[5] * 3] * 4, torch.zeros(4), torch.ones(4, dtype=torch.bool), [[0.0] * 3] * 4, 2
    )
    short_prompts = TrainBatch(
        [[1] * 2] * 4, [[5] * 8] * 4, torch.zeros(4), torch.ones(4, dtype=torch.bool), [[0.0] * 8] * 4, 2
    )
    assert trainer._decide_sharing(long_prompts) and not trainer._decide_sharing(short_prompts)
    assert isinstance(trainer._model_batch(short_prompts, [0, 1, 2, 3]), PolicyBatch)
    # compiled layers take the plain path under auto (the shared path recompiles them per layer);
    # asked for by name, sharing still holds
    compiled = build_config(None, ["rl.batch_per_replica=4", "rl.group_size=2", "model.compile=true"])
    trainer = PolicyTrainer(_load(tiny_model_dir), compiled, objective=grpo_objective(compiled), pad_id=2)
    assert not trainer._decide_sharing(long_prompts)
    forced = build_config(
        None, ["rl.batch_per_replica=4", "rl.group_size=2", "model.compile=true", "model.share_prompt_prefix=true"]
    )
    trainer = PolicyTrainer(_load(tiny_model_dir), forced, objective=grpo_objective(forced), pad_id=2)
    assert trainer._decide_sharing(long_prompts)


def _longer(batch: TrainBatch) -> TrainBatch:
    """``batch`` with every prompt one token and every completion three tokens longer."""
    comps = [[*c, 40, 41, 42] for c in batch.completion_ids]
    return TrainBatch(
        [[*p, 7] for p in batch.prompt_ids],
        comps,
        batch.advantages_B,
        batch.in_loss_B,
        [[-1.0] * len(c) for c in comps],
        batch.group_size,
    )


def _two_updates(model_dir: str, compile_layers: bool) -> tuple[torch.nn.Module, list[float], list[int]]:
    """Two updates of a fresh trainer, the second at longer lengths: the model, both losses and the
    number of graphs dynamo had compiled after each (its own tally; no public counter exists)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = build_config(
        None,
        [
            "rl.batch_per_replica=16",
            "rl.group_size=4",
            "rl.optimizer.lr=1e-3",
            "rl.micro_batch_per_replica=8",  # two micro-batches, each padded to its own length
            "model.share_prompt_prefix=false",
            f"model.compile={str(compile_layers).lower()}",
        ],
    )
    model = _load(model_dir)
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=2)
    losses, graphs = [], []
    for step, batch in enumerate((_batch(), _longer(_batch())), start=1):
        losses.append(trainer.train_on(batch, step=step)["train/loss_avg"])
        graphs.append(counters["stats"]["unique_graphs"])
    return model, losses, graphs


def _assert_trained_alike(a: torch.nn.Module, a_losses: list[float], b: torch.nn.Module, b_losses: list[float]) -> None:
    """The same weights up to float summation order (the invariance tests' bound) and the same losses."""
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=2e-5, rtol=1e-4)
    assert b_losses == pytest.approx(a_losses, abs=1e-5)


# The compiled-layer tests run each under two of torch.compile's backends: ``aot_eager`` (dynamo's graphs, their
# graph breaks, guards and recompiles, and AOT autograd's forward and backward graphs, run by torch's eager
# kernels) in the default tier, and ``inductor`` (what ``model.compile`` uses) in the slow one: on CI's two
# cores inductor's C++ build of the layers' kernels took 158 s for the dense policy and 88 s for the MoE one,
# against 28 s and 39 s under aot_eager.
BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]


def _with_backend(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Every ``nn.Module.compile`` (``models/structure.compile_layers``'s) compiles with ``backend``."""
    if backend == "inductor":  # torch.compile's default, as a run has it
        return
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, *args, **kw: compile_module(self, *args, backend=backend, **kw)
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_layers_train_like_eager_and_do_not_recompile(
    tiny_model_dir: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model.compile=true`` (each decoder layer compiled with dynamic shapes): two updates whose
    prompt and completion lengths differ give the eager run's weights and losses, and the second
    update, at new lengths, compiles no new graph."""
    _with_backend(monkeypatch, backend)
    eager, eager_losses, eager_graphs = _two_updates(tiny_model_dir, compile_layers=False)
    compiled, compiled_losses, graphs = _two_updates(tiny_model_dir, compile_layers=True)
    assert eager_graphs == [0, 0]
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers)
    assert graphs[0] >= 1 and graphs[1] == graphs[0], f"graphs compiled after each update: {graphs}"
    _assert_trained_alike(eager, eager_losses, compiled, compiled_losses)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_moe_layers_train_like_eager(
    tmp_path: Path, smollm2_tokenizer_dir: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a sparse Qwen3-MoE policy (without routing replay, which refuses
    ``model.compile``). On the CPU, transformers' fallback grouped matrix product has a
    data-dependent size that inductor cannot compile, so dynamo breaks the graph there: the
    weights must still come out as eager's, and each layer is still compiled around it."""
    _with_backend(monkeypatch, backend)
    model_dir = make_tiny_moe_model(str(tmp_path / "moe"), smollm2_tokenizer_dir)
    eager, eager_losses, _ = _two_updates(model_dir, compile_layers=False)
    compiled, compiled_losses, graphs = _two_updates(model_dir, compile_layers=True)
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers) and graphs[0] >= 1
    _assert_trained_alike(eager, eager_losses, compiled, compiled_losses)


def test_mini_batches_take_several_steps_and_pass_the_probe(tiny_model_dir: str) -> None:
    _, metrics = _trained_params(tiny_model_dir, ["rl.mini_batch_per_replica=8", "rl.epsilon_high=0.01"])
    assert metrics["optim/step"] == 2.0
    assert metrics["train/clip_frac"] > 0.0  # the second mini-batch sees a moved policy


def test_probe_fails_with_live_dropout(tiny_model_dir: str) -> None:
    cfg = build_config(None, ["rl.batch_per_replica=16", "rl.group_size=4", "rl.mini_batch_per_replica=8"])
    model = _load(tiny_model_dir)
    # dropout in train mode makes two forwards of the same batch differ: the probe must catch it
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=2)
    with pytest.raises(TrainingError, match="determinism probe failed"):
        trainer.train_on(_batch(), step=3)


def test_zero_advantages_skip_the_update(tiny_model_dir: str) -> None:
    cfg = build_config(None, ["rl.batch_per_replica=16", "rl.group_size=4"])
    model = _load(tiny_model_dir)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=2)
    batch = _batch()
    batch.advantages_B = torch.zeros_like(batch.advantages_B)
    metrics = trainer.train_on(batch, step=1)
    assert metrics["optim/zero_grad_skips_total"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_non_finite_gradient_is_fatal_and_names_the_parameter(tiny_model_dir: str) -> None:
    cfg = build_config(None, ["rl.batch_per_replica=16", "rl.group_size=4"])
    model = _load(tiny_model_dir)
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=2)
    batch = _batch()
    batch.advantages_B[0] = float("inf")
    with pytest.raises(TrainingError, match=r"step 7: non-finite gradient .* parameter"):
        trainer.train_on(batch, step=7)


@pytest.mark.parametrize(("micro", "fewer"), [(16, True), (8, True), (4, False)])
def test_packed_micro_batches_keep_their_count_and_never_compute_more_cells(
    tiny_model_dir: str, micro: int, fewer: bool
) -> None:
    def cells(overrides: list[str]) -> tuple[int, int, list[int]]:
        cfg = build_config(None, [*cfg_overrides, f"rl.micro_batch_per_replica={micro}", *overrides])
        trainer = PolicyTrainer(_load(tiny_model_dir), cfg, objective=grpo_objective(cfg), pad_id=2)
        trainer._decide_sharing(batch)
        micros = trainer._micro_batches(batch, list(range(16)), micro, shared=False)  # share_prompt_prefix=false
        built = [trainer._model_batch(batch, rows) for rows in micros]
        assert all(isinstance(b, PolicyBatch) for b in built)
        return len(micros), sum(b.input_ids_RL.numel() for b in built), sorted(i for m in micros for i in m)

    cfg_overrides = ["rl.batch_per_replica=16", "rl.group_size=4", "model.share_prompt_prefix=false"]
    batch = _batch()  # sequences of 3 to 14 tokens
    padded_count, padded_cells, padded_rows = cells([])
    packed_count, packed_cells, packed_rows = cells(["model.sequence_packing=true"])
    assert packed_count == padded_count == 16 // micro
    assert packed_rows == padded_rows == list(range(16))  # every sequence once
    real = sum(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids))
    assert real <= packed_cells <= padded_cells
    assert (packed_cells < padded_cells) == fewer  # 4 sorted rows per micro-batch leave nothing to pack


def test_gap_over_recorded_samples_only(tiny_model_dir: str) -> None:
    """``rollout.sampler_logprobs_samples=1``: the first sample of each group carries the sampler's
    logprobs (here the trainer's own + 0.25 per token), the others none. The gap is measured on those
    rows alone, also across micro-batches holding no recorded row, and the update is the one of a
    fully recorded batch (the loss does not read them on this path)."""
    cfg = build_config(None, ["rl.batch_per_replica=16", "rl.group_size=4", "rl.micro_batch_per_replica=2"])
    model = _load(tiny_model_dir)
    comps = _completions()
    prompts = [p for p in PROMPTS for _ in range(G)]
    with torch.no_grad():
        own = completion_logprobs(model.eval(), build_policy_batch(prompts, comps, pad_id=2, device="cpu"))
    assert isinstance(own, torch.Tensor)
    shifted = [(own[i, : len(c)] + 0.25).tolist() for i, c in enumerate(comps)]
    partial = _batch()
    partial.sampler_logprobs = [lp if i % G == 0 else None for i, lp in enumerate(shifted)]
    full = _batch()
    full.sampler_logprobs = shifted
    results = []
    for batch in (partial, full):
        torch.manual_seed(0)
        trained = _load(tiny_model_dir)
        metrics = PolicyTrainer(trained, cfg, objective=grpo_objective(cfg), pad_id=2).train_on(batch, step=1)
        results.append(([p.detach().clone() for p in trained.parameters()], metrics))
    (params_partial, m_partial), (params_full, m_full) = results
    assert m_partial["train/logprob_gap_mean"] == pytest.approx(0.25, abs=1e-4)
    assert m_partial["train/logprob_gap_max"] == pytest.approx(0.25, abs=1e-4)
    assert m_full["train/logprob_gap_mean"] == pytest.approx(0.25, abs=1e-4)
    for a, b in zip(params_partial, params_full):
        assert torch.equal(a, b)
    unrecorded = _batch()
    unrecorded.sampler_logprobs = [None] * len(comps)  # rollout.sampler_logprobs_every skipped this step
    torch.manual_seed(0)
    metrics = PolicyTrainer(_load(tiny_model_dir), cfg, objective=grpo_objective(cfg), pad_id=2).train_on(
        unrecorded, step=1
    )
    assert "train/logprob_gap_mean" not in metrics and "train/logprob_gap_max" not in metrics


# -- tied groups (policy/free_rows.py): their rows run in a pass of their own without autograd, the
# backward covers the rest, and the update and its metrics are the plain update's (every row in the
# backward) up to the rounding of smaller products

# groups 0 and 2 tied (not adjacent: a shared prompt pass must still get whole groups)
ADVANTAGES = [0.0] * 4 + [1.2, -0.4, -0.4, -0.4] + [0.0] * 4 + [-1.0, 1.0, 0.5, -0.5]
COMMON = ["rl.batch_per_replica=16", "rl.group_size=4", "rl.optimizer.lr=1e-3"]


def _tied_batch() -> TrainBatch:
    batch = _batch()
    batch.advantages_B = torch.tensor(ADVANTAGES)
    return batch


def _update(model_dir: str, overrides: list[str], *, split: bool = True, objective_loss=None):  # type: ignore[no-untyped-def]
    """One ``train_on``: the weights after it, its metrics and the body's forwards as (rows, grad);
    the gradients the optimizer stepped with land in ``_update.grads``."""
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
    grads: list[torch.Tensor] = []

    def keep_grads(*_: object) -> None:
        grads[:] = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]

    trainer.optimizer.register_step_pre_hook(keep_grads)
    metrics = trainer.train_on(_tied_batch(), step=1)
    _update.grads = grads  # type: ignore[attr-defined]
    return [p.detach().clone() for p in model.parameters()], metrics, forwards


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.share_prompt_prefix=false"],
        ["model.share_prompt_prefix=true"],
        ["model.share_prompt_prefix=false", "rl.micro_batch_per_replica=8"],
        ["model.share_prompt_prefix=false", "model.sequence_packing=true", "rl.micro_batch_per_replica=8"],
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
    plain_grads = _update.grads  # type: ignore[attr-defined]
    split, metrics, forwards = _update(tiny_model_dir, overrides)
    split_grads = _update.grads  # type: ignore[attr-defined]
    packed = "model.sequence_packing=true" in overrides
    if packed:  # the packing probe's two forwards at construction (check_packing_isolates)
        plain_forwards, forwards = plain_forwards[2:], forwards[2:]
    assert all(grad for _, grad in plain_forwards)
    assert any(not grad for _, grad in forwards)  # the tied groups went through a forward without autograd
    if packed:  # the two tied groups fill the first micro-batch (packed_free_first), without autograd
        assert [grad for _, grad in forwards] == [False, True]
    elif "model.share_prompt_prefix=false" in overrides:  # one body forward per pass: its rows are the pass's
        assert sum(rows for rows, grad in forwards if not grad) == 8  # the two tied groups
        assert sum(rows for rows, grad in forwards if grad) == 8
    # the gradients the optimizer stepped with: the same up to fp32 sums in another order
    assert len(plain_grads) == len(split_grads) > 0
    for a, b in zip(plain_grads, split_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    # AdamW normalises each element's step, so an element whose gradient is near zero moves by up to
    # lr x its relative rounding: fp32 sums in another order alone (the same plain update through the
    # logsumexp logprob head and through today's log_softmax one) move one weight in millions by 2.6e-5
    for a, b in zip(plain, split):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)
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

    message = r"step 1: non-finite loss in rows whose advantages are all zero \(this rank's: nan\)"
    with pytest.raises(TrainingError, match=message):
        _update(tiny_model_dir, ["model.share_prompt_prefix=false"], objective_loss=nan_without_autograd)
