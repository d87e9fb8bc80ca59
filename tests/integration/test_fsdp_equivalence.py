"""Two FSDP2 policy ranks (gloo, CPU) make the same update as one process on the union batch.

One ``torch.multiprocessing`` spawn of 2 ranks runs every case in turn; rank 0 writes the gathered
gradients of each optimizer step, the gathered weights after ``train_on`` and the metrics. Each
test then trains one plain process on the whole batch and compares.

Tolerance (fp32): gradients within ``1e-5 x max|g|`` of the single-process ones (elementwise
rtol 1e-5); updated weights within 2e-6 absolute (lr 1e-3). Measured: ~1e-7 relative, the order of
floating-point sums across ranks. The gradient NORM is looser (5e-5): one fp32 norm over the 3M-entry
embedding is itself off by ~6e-5 from the float64 value on this CPU, and two half-norms combined are
off differently (measured 6e-6 between the two), so clipped gradients carry that gap too.

The fixture has teeth: the two cells differ in loss tokens (11 vs 21) and in-loss sequences (3 vs 4,
one masked completion), so a rank-local normaliser gives different gradients; the control case
runs exactly that (``global_normalizer`` patched out) and must NOT match.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import pytest
import torch

from posttrain.config.loading import build_config
from posttrain.distributed.cells import cell_config, cell_rows, take_rows
from posttrain.policy.objective import grpo_objective
from posttrain.policy.train_batch import SamplerHead, TrainBatch
from posttrain.policy.trainer import PolicyTrainer

G = 2
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19]]
LENGTHS = [3, 9, 2, 6, 1, 5, 8, 7]  # cell 0: rows 0-3, cell 1: rows 4-7 (one mini-batch)
IN_LOSS = [True, False, True, True, True, True, True, True]  # row 1 masked (a truncated completion)
COMMON = [
    "rl.batch_per_replica=8",
    f"rl.group_size={G}",
    "rl.micro_batch_per_replica=2",
    "rl.optimizer.lr=1e-3",
    "rl.optimizer.grad_clip_norm=null",
    "rollout.max_tokens=12",
    # whole groups per micro-batch, the same composition on 2 ranks as in one process (the plain path
    # sorts rows by length, so its micro-batches, and their padding, differ between the two)
    "model.share_prompt_prefix=true",
    # MKL's products on both sides: a sharded policy never multiplies over oneDNN-packed weights, and the one
    # process would where `auto` packs (test_cpu_packed_update.py compares the packed update with the plain one)
    "model.cpu_packed_update=false",
]
SPAWN_TIMEOUT_S = 240.0
NORM_RTOL = 5e-5
PARAM_ATOL = 2e-6


@dataclass(frozen=True)
class Case:
    """One training configuration run on 2 ranks and on 1 process."""

    name: str
    overrides: list[str] = field(default_factory=list)
    dp_replicate: int = 1
    local_norm: bool = False
    steps: int = 1
    rtol: float = 1e-5
    param_atol: float = PARAM_ATOL
    tied: tuple[int, ...] = ()  # groups whose advantages are all zero (free rows, policy/free_rows.py)
    passes: list[tuple[list[int], bool]] | None = None  # rank 0's passes these must give (its local rows)


CASES = [
    Case("token-mean", ["rl.loss_type=token-mean"]),
    Case("seq-mean-token-mean", ["rl.loss_type=seq-mean-token-mean"]),
    Case("seq-mean-token-sum-fixed", ["rl.loss_type=seq-mean-token-sum-fixed"]),
    Case("two-mini-batches", ["rl.mini_batch_per_replica=4", "rl.epsilon_high=0.01"], steps=2),
    Case("clipped", ["rl.optimizer.grad_clip_norm=0.01"], rtol=NORM_RTOL),
    Case("hsdp", ["rl.loss_type=seq-mean-token-mean"], dp_replicate=2),
    Case("control-local-norm", ["rl.loss_type=token-mean"], local_norm=True),
    # Tied groups (distributed/passes.py): rank 0 holds groups 0-1, rank 1 groups 2-3, and each rank
    # puts its tied groups first (free_groups_first). Both ranks' one micro-batch holds a tied group ->
    # both split it; groups 0 and 2 tied, or 1 and 2 (second on rank 0, moved first) -> the first
    # micro-batch is free on both ranks; group 0 alone tied -> rank 1 learns there, so both run it
    # whole; groups 0, 1 and 3 tied with one micro-batch per rank -> rank 1 splits its micro-batch,
    # and rank 0, whose micro-batch is wholly free, runs its last group with autograd to match. In
    # "tied-both-split" and "tied-free-meets-split" one process learns from groups 0 and 2 in one micro-batch (padded
    # alike), the ranks from each alone, so sums round in another order: gradients within 1e-5 of their
    # largest entry, but AdamW's first step, g / (|g| + eps), turned a 1e-8 difference in an entry near
    # eps into 6.9e-5 of weight (up_proj); eps=1e-4 keeps such entries from deciding the comparison.
    Case(
        "tied-both-split",
        ["rl.micro_batch_per_replica=4", "rl.optimizer.eps=1e-4"],
        tied=(1, 3),
        passes=[([2, 3], False), ([0, 1], True)],
    ),
    Case("tied-free-on-both", tied=(0, 2), passes=[([0, 1], False), ([2, 3], True)]),
    Case("tied-moved-first", tied=(1, 2), passes=[([2, 3], False), ([0, 1], True)]),
    Case("tied-on-one-rank", tied=(0,), passes=[([0, 1], True), ([2, 3], True)]),
    Case(
        "tied-free-meets-split",
        ["rl.micro_batch_per_replica=4", "rl.optimizer.eps=1e-4"],
        tied=(0, 1, 3),
        passes=[([0, 1], False), ([2, 3], True)],
    ),
    # Each rank packs its own cell (the packing probe runs through FSDP2 at the trainer's start). Its
    # micro-batches hold other sequences than one process's, so sums round in another order, and
    # AdamW's first step (g / (|g| + eps)) magnifies that in near-zero gradient entries: 2.7e-6 seen.
    Case(
        "packed",
        ["rl.loss_type=token-mean", "model.share_prompt_prefix=false", "model.sequence_packing=true"],
        param_atol=1e-5,
    ),
    # packed with tied groups 1 and 3: each rank's free group fills its first micro-batch
    # (packed_free_first), so both run it without autograd; in packing's own split by length each
    # micro-batch would hold rows of both kinds on some rank (eps as in the other split cases)
    Case(
        "tied-packed",
        [
            "rl.loss_type=token-mean",
            "model.share_prompt_prefix=false",
            "model.sequence_packing=true",
            "rl.optimizer.eps=1e-4",
        ],
        param_atol=1e-5,
        tied=(1, 3),
        passes=[([2, 3], False), ([0, 1], True)],
    ),
]


def _batch(tied: tuple[int, ...] = ()) -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    comps = [torch.randint(30, 900, (n,), generator=gen).tolist() for n in LENGTHS]
    advantages_B = torch.linspace(-1.0, 1.3, len(comps))
    for group in tied:
        advantages_B[group * G : (group + 1) * G] = 0.0
    return TrainBatch(
        prompt_ids=[p for p in PROMPTS for _ in range(G)],
        completion_ids=comps,
        advantages_B=advantages_B,
        in_loss_B=torch.tensor(IN_LOSS),
        sampler_logprobs=[[-1.0] * len(c) for c in comps],
        group_size=G,
    )


def _record_grads(trainer: PolicyTrainer) -> list[dict[str, torch.Tensor]]:
    """Wrap the optimizer's step to keep the full (gathered, clipped) gradient of every step."""
    from torch.distributed.tensor import DTensor

    steps: list[dict[str, torch.Tensor]] = []

    def record(*_: Any) -> None:
        grads = {}
        for name, p in trainer.model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # a collective
                grads[name] = g.detach().clone()
        steps.append(grads)

    trainer.optimizer.register_step_pre_hook(record)
    return steps


def _train(model_dir: str, case: Case, mesh: Any = None) -> dict[str, Any]:
    """One ``train_on`` of the case: on the whole batch (``mesh`` None) or on this rank's cell."""
    from transformers import AutoModelForCausalLM

    from posttrain.distributed.fsdp import full_state_dict, shard_policy

    cfg = build_config(None, [*COMMON, *case.overrides])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = _batch(case.tied)
    if mesh is not None:
        dp = shard_policy(model, mesh)
        batch = take_rows(
            batch, cell_rows(len(LENGTHS), group_size=G, mini_batch=cfg.rl.mini_batch, cell=dp.cell, cells=dp.size)
        )
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=2)
    grads = _record_grads(trainer)
    plans: list[list[tuple[list[int], bool]]] = []
    passes = trainer._passes

    def recorded(*args: Any) -> list[tuple[list[int], bool]]:
        plans.append(passes(*args))
        return plans[-1]

    trainer._passes = recorded  # type: ignore[method-assign]
    metrics = trainer.train_on(batch, step=1)
    return {"grads": grads, "state": full_state_dict(model), "metrics": metrics, "passes": plans[-1]}


def _worker(rank: int, world: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from posttrain.distributed.fsdp import DataParallel, build_dp_mesh
    from posttrain.distributed.process_group import init_process_group

    init_process_group(init_method=f"file://{out}/store", rank=rank, world_size=world, timeout_s=60)
    try:
        meshes = {1: build_dp_mesh(1), 2: build_dp_mesh(2, 1)}
        for case in CASES:
            local_norm = mock.patch.object(DataParallel, "global_normalizer", lambda self, norm: norm)
            with local_norm if case.local_norm else contextlib.nullcontext():
                result = _train(model_dir, case, meshes[case.dp_replicate])
            if rank == 0:
                torch.save(result, f"{out}/{case.name}.pt")
            elif result["state"]:
                raise AssertionError("full_state_dict(rank0_only=True) returned weights on rank 1")
        dist.barrier()  # no rank leaves while its peer is still in the last collective
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as exit_rank_process does: gloo's threads may abort a finalizing interpreter


@pytest.fixture(scope="module")
def two_rank_results(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case trained by 2 gloo ranks (one spawn for all cases, joined with a deadline)."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("fsdp_equivalence")
    ctx = mp.spawn(_worker, args=(2, tiny_model_dir, str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the 2-rank FSDP2 run did not finish within {SPAWN_TIMEOUT_S:.0f} s")
    return {case.name: torch.load(out / f"{case.name}.pt") for case in CASES}


def _close(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor], rtol: float = 1e-5) -> list[str]:
    """Names of the tensors of ``other`` that are not within ``rtol`` (elementwise, and of the
    tensor's largest entry) of ``reference``."""
    assert reference.keys() == other.keys()
    bad = []
    for name, ref in reference.items():
        atol = rtol * float(ref.abs().max()) + 1e-12
        if not torch.allclose(other[name], ref, rtol=rtol, atol=atol):
            bad.append(name)
    return bad


def test_cells_are_uneven_in_tokens_and_sequences() -> None:
    """The property that makes a rank-local normaliser detectable."""
    tokens = [sum(n for n, keep in zip(LENGTHS[c * 4 : c * 4 + 4], IN_LOSS[c * 4 : c * 4 + 4]) if keep) for c in (0, 1)]
    seqs = [sum(IN_LOSS[c * 4 : c * 4 + 4]) for c in (0, 1)]
    assert tokens == [11, 21] and seqs == [3, 4]


@pytest.mark.parametrize("case", [c for c in CASES if not c.local_norm], ids=lambda c: c.name)
def test_two_ranks_match_one_process(tiny_model_dir: str, two_rank_results: dict[str, Any], case: Case) -> None:
    reference = _train(tiny_model_dir, case)
    dist = two_rank_results[case.name]
    assert len(dist["grads"]) == len(reference["grads"]) == case.steps
    for step, (ref_g, dist_g) in enumerate(zip(reference["grads"], dist["grads"])):
        bad = _close(ref_g, dist_g, case.rtol)
        assert not bad, f"optimizer step {step}: gradients differ in {bad}"
    assert reference["state"].keys() == dist["state"].keys()
    for name, ref in reference["state"].items():
        torch.testing.assert_close(dist["state"][name], ref, rtol=0, atol=case.param_atol, msg=name)
    initial = _initial(tiny_model_dir)  # the update is real: the weights moved from the checkpoint
    assert any(not torch.equal(ref, initial[name]) for name, ref in reference["state"].items())
    for key in ("train/loss_avg", "train/grad_norm", "train/clip_frac", "optim/step"):
        rel = NORM_RTOL if key == "train/grad_norm" else 1e-5
        assert dist["metrics"][key] == pytest.approx(reference["metrics"][key], rel=rel, abs=1e-7), key
    if case.name == "clipped":
        assert reference["metrics"]["train/grad_norm"] > 0.01  # the clip engaged, on the global norm
    if case.passes is not None:  # the ranks ran the agreed passes (distributed/passes.py), rank 0's rows
        assert dist["passes"] == case.passes
    if case.tied:  # one process, too, runs its tied groups without autograd
        assert not all(learns for _, learns in reference["passes"])


def _initial(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def test_rank_local_normalisation_would_be_caught(tiny_model_dir: str, two_rank_results: dict[str, Any]) -> None:
    reference = _train(tiny_model_dir, Case("token-mean", ["rl.loss_type=token-mean"]))
    local = two_rank_results["control-local-norm"]
    assert _close(reference["grads"][0], local["grads"][0])  # differs: the test above has teeth


def test_cell_rows_split_each_mini_batch_into_whole_groups() -> None:
    assert cell_rows(8, group_size=2, mini_batch=8, cell=0, cells=2) == [0, 1, 2, 3]
    assert cell_rows(8, group_size=2, mini_batch=8, cell=1, cells=2) == [4, 5, 6, 7]
    # two optimizer steps: the cell's k-th local mini-batch is its slice of the global k-th
    assert cell_rows(8, group_size=2, mini_batch=4, cell=1, cells=2) == [2, 3, 6, 7]
    with pytest.raises(ValueError, match=r"multiple of rl\.group_size x POLICY_RANKS = 4"):
        cell_rows(6, group_size=2, mini_batch=6, cell=0, cells=2)


def test_take_rows_splits_every_per_trajectory_field() -> None:
    batch = _batch()
    cell = take_rows(batch, [4, 5, 6, 7])
    assert cell.completion_ids == batch.completion_ids[4:] and cell.prompt_ids == batch.prompt_ids[4:]
    assert torch.equal(cell.advantages_B, batch.advantages_B[4:]) and cell.group_size == G
    assert cell.sampler_head is None
    batch.sampler_logprobs = batch.sampler_logprobs[:3]
    with pytest.raises(ValueError, match="sampler_logprobs has 3 rows, expected 8"):
        take_rows(batch, [0, 1])


def test_take_rows_slices_the_per_feature_payloads() -> None:
    batch = _batch()
    ids = [[[i, i + 1]] * n for i, n in enumerate(LENGTHS)]
    logprobs = [[[-0.5, -1.5]] * n for n in LENGTHS]
    batch.sampler_head = SamplerHead(ids=ids, logprobs=logprobs)
    cell = take_rows(batch, [1, 6])
    assert cell.sampler_head == SamplerHead(ids=[ids[1], ids[6]], logprobs=[logprobs[1], logprobs[6]])
    assert batch.sampler_head.ids == ids  # the original batch is not modified
    batch.sampler_head = SamplerHead(ids=ids[:5], logprobs=logprobs)
    with pytest.raises(ValueError, match=r"TrainBatch\.sampler_head\.ids has 5 rows, expected 8"):
        take_rows(batch, [0, 1])


def test_cell_config_keeps_the_number_of_optimizer_steps() -> None:
    cfg = build_config(None, [*COMMON, "rl.mini_batch_per_replica=4"])
    cell = cell_config(cfg, 2)
    assert (cell.rl.batch_per_replica, cell.rl.mini_batch, cell.rl.n_mini) == (4, 2, cfg.rl.n_mini)
    assert cell.rl.micro_batch_per_replica == cfg.rl.micro_batch_per_replica
