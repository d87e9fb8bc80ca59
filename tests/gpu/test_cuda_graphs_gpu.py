"""``model.cuda_graphs`` on CUDA: the policy body's forward and backward replayed as CUDA graphs
(``models/cuda_graphs.py``; ``pytest -m gpu`` on the device machine, ``benchmarks/cuda_graphs.sh``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")


def _batch(rows: int, seed: int) -> Any:
    """Groups of 4 with prompts of 17-23 tokens and completions of 5-29: padded rows of varying length,
    whose longest row (at most 52 tokens) pads up to the 64-token bucket."""
    from posttrain.policy.train_batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(17, 24, (rows // 4,), generator=g).tolist()
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in prompt_lengths]
    completions = [torch.randint(100, 40000, (5 + 2 * i,), generator=g).tolist() for i in range(rows)]
    return TrainBatch(
        prompt_ids=[prompts[i // 4] for i in range(rows)],
        completion_ids=completions,
        advantages_B=torch.randn(rows, generator=g),
        in_loss_B=torch.ones(rows, dtype=torch.bool),
        sampler_logprobs=[[-10.0] * len(c) for c in completions],
        group_size=4,
    )


def _trainer(model_dir: str, compute_dtype: str, graphs: bool, n_mini: int) -> Any:
    from transformers import AutoModelForCausalLM

    from posttrain.config.schema import GRPOConfig
    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer

    cfg = GRPOConfig()
    cfg.rl.group_size, cfg.rl.batch_per_replica = 4, 12
    cfg.rl.mini_batch_per_replica = 12 // n_mini
    cfg.rl.micro_batch_per_replica = 6 // n_mini  # two micro-batches per mini-batch: gradients accumulate
    cfg.rl.optimizer.lr, cfg.rl.kl_beta = 1e-3, 0.0
    cfg.model.compute_dtype = compute_dtype
    cfg.model.cuda_graphs = graphs
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    return PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=0)


def _record_grads(trainer: Any, into: list[torch.Tensor]) -> None:
    """Keep each optimizer step's whole gradient (before clipping) in ``into``."""
    original: Callable[[int], float] = trainer._optimizer_step

    def recorded(step: int) -> float:
        into.append(torch.cat([p.grad.flatten().clone() for p in trainer.model.parameters()]))
        return original(step)

    trainer._optimizer_step = recorded


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(("compute_dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_graphed_updates_match_eager_ones_over_steps_and_micro_batches(
    tiny_model_dir: str, compute_dtype: str, tolerance: float
) -> None:
    eager = _trainer(tiny_model_dir, compute_dtype, graphs=False, n_mini=1)
    graphed = _trainer(tiny_model_dir, compute_dtype, graphs=True, n_mini=1)
    eager_grads: list[torch.Tensor] = []
    graphed_grads: list[torch.Tensor] = []
    _record_grads(eager, eager_grads)
    _record_grads(graphed, graphed_grads)
    for step in (1, 2, 3):  # steps 2 and 3 replay over weights the optimizer moved in place
        batch = _batch(12, seed=step)
        eager_metrics = eager.train_on(batch, step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphed_metrics = graphed.train_on(batch, step)
        # the graphs' gradients never pass through an autograd node of another stream
        assert not [w for w in caught if "stream" in str(w.message)], [str(w.message) for w in caught]
        assert abs(graphed_metrics["train/loss_avg"] - eager_metrics["train/loss_avg"]) <= tolerance * max(
            1.0, abs(eager_metrics["train/loss_avg"])
        )
    assert graphed.graphs is not None
    assert graphed.graphs.shapes == [(8, 64)]  # 6 rows of at most 52 tokens, both micro-batches, every step
    assert len(graphed_grads) == 3
    for step, (g, e) in enumerate(zip(graphed_grads, eager_grads), start=1):
        # each micro-batch's gradient added once: a replay overwriting an accumulated one, or one
        # counted twice, is off by the size of a micro-batch's share (order 1, not order tolerance)
        assert _relative(g, e) < tolerance, f"step {step}: gradients differ by {_relative(g, e):.3g}"
    weights_gap = max(
        _relative(p.detach(), q.detach()) for p, q in zip(graphed.model.parameters(), eager.model.parameters())
    )
    assert weights_gap < tolerance


def test_the_frozen_pi_old_pass_replays_the_forward_graph_and_the_probe_holds(tiny_model_dir: str) -> None:
    # n_mini=2: pi_old comes from a no-grad pass over every micro-batch, and the determinism probe
    # compares it with the first mini-batch's logprobs under autograd: both from the same graph
    graphed = _trainer(tiny_model_dir, "bfloat16", graphs=True, n_mini=2)
    eager = _trainer(tiny_model_dir, "bfloat16", graphs=False, n_mini=2)
    batch = _batch(12, seed=5)
    graphed_metrics = graphed.train_on(batch, 1)
    eager_metrics = eager.train_on(batch, 1)
    assert graphed_metrics["optim/step"] == 2.0
    assert graphed.graphs is not None and graphed.graphs.shapes == [(4, 64)]  # micro-batches of 3 rows
    assert abs(graphed_metrics["train/loss_avg"] - eager_metrics["train/loss_avg"]) < 5e-2


def test_auto_graphs_a_small_run_by_itself(tiny_model_dir: str, grpo_run: Callable[..., Any]) -> None:
    _, run_dir, records = grpo_run(tiny_model_dir)  # model.cuda_graphs=auto, the default
    assert "model.cuda_graphs=auto: on (a small update" in (run_dir / "train.log").read_text()
    assert all(r["train/grad_norm"] > 0 for r in records)


def test_a_run_with_cuda_graphs_trains(tiny_model_dir: str, grpo_run: Callable[..., Any]) -> None:
    _, run_dir, records = grpo_run(tiny_model_dir, "model.cuda_graphs=true")
    log = (run_dir / "train.log").read_text()
    assert "model.cuda_graphs=true: the policy body's forward and backward replay as CUDA graphs" in log
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0 for r in records)
