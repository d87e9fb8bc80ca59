"""Routing replay under two FSDP2 policy ranks (gloo, CPU): each rank's pinned forward routes every
token through the experts the sampler recorded and gives the logprobs one process gives, and a
replayed ``train_on`` (pi_old pass, probe, sharded KL reference) makes one process's update.

The sampler is transformers' own recorder (``record_routing``) on a copy of the policy whose router
weights are perturbed: a sampler that routes many tokens elsewhere than the policy would (vLLM's
CPU build returns no routing, so no vLLM here). One ``torch.multiprocessing`` spawn of 2 ranks runs
everything; the test process then runs one process on the same rows and compares.

Equality: the pinned experts are compared exactly; the forward logprobs of a rank's cell are
bitwise one process's on the same rows (the FSDP2 all-gather restores the fp32 weights exactly and
the cell's micro-batch has one process's shapes). The trained weights are held to 2e-6 (lr 1e-3), as in
tests/integration/test_fsdp_equivalence.py: the two ranks' gradients are summed in another order
than one process's (measured here: the weights equal, the gradient norm 1e-7 relative apart). The
sampler routes 58% of (position, layer) pairs elsewhere than the policy would, so an unpinned
forward would not match.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from posttrain.config.loading import build_config
from posttrain.distributed.cells import cell_rows, take_rows
from posttrain.models.routing_replay import record_routing
from posttrain.policy.batching import PolicyBatch, build_policy_batch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.policy.objective import grpo_objective
from posttrain.policy.routing import RoutingReplay, batch_routing
from posttrain.policy.shared_prefix import GroupedBatch, build_grouped_batch, grouped_completion_logprobs
from posttrain.policy.train_batch import RoutingTrace, TrainBatch
from posttrain.policy.trainer import PolicyTrainer, build_reference
from tiny_models import tiny_qwen3_moe

G = 2
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14], [15, 16, 17, 18]]
LENGTHS = [3, 5, 1, 4, 6, 2, 2, 3]  # cell 0: rows 0-3, cell 1: rows 4-7
LAYOUTS = ("padded", "packed", "shared_prompt")
TRAIN = [
    "rl.batch_per_replica=8",
    f"rl.group_size={G}",
    "rl.mini_batch_per_replica=4",  # two optimizer steps: the pi_old pass and its probe run pinned
    "rl.micro_batch_per_replica=2",  # one group per micro-batch: one process's composition on each rank
    "model.share_prompt_prefix=true",
    "rl.optimizer.lr=1e-3",
    "rl.optimizer.grad_clip_norm=null",
    "rl.kl_beta=0.1",
    "rl.ref.build_ref=true",
    "rl.kl_coeff_clamp=5.0",
    "rl.routing_replay=rollout",
]
PARAM_ATOL = 2e-6
SPAWN_TIMEOUT_S = 240.0


def _batch() -> TrainBatch:
    """The collected batch, its routing recorded by the sampler one sequence at a time."""
    gen = torch.Generator().manual_seed(0)
    comps = [torch.randint(30, 900, (n,), generator=gen).tolist() for n in LENGTHS]
    prompts = [p for p in PROMPTS for _ in range(G)]
    sampler = tiny_qwen3_moe().eval()
    with torch.no_grad():
        for layer in sampler.model.layers:
            layer.mlp.gate.weight.add_(0.3 * torch.randn(layer.mlp.gate.weight.shape, generator=gen))
    experts = []
    for p, c in zip(prompts, comps):
        with record_routing(sampler) as rec, torch.no_grad():
            sampler(torch.tensor([p + c]))
        experts.append(rec[0][:-1].to(torch.int16))  # vLLM's shape: the last token never ran
    return TrainBatch(
        prompt_ids=prompts,
        completion_ids=comps,
        advantages_B=torch.linspace(-1.5, 1.5, len(comps)),
        in_loss_B=torch.ones(len(comps), dtype=torch.bool),
        sampler_logprobs=[[-1.0] * len(c) for c in comps],
        group_size=G,
        routing=RoutingTrace(experts),
    )


def _model_batch(batch: TrainBatch, layout: str) -> PolicyBatch | GroupedBatch:
    if layout == "shared_prompt":
        prompts = batch.prompt_ids[::G]
        return build_grouped_batch(prompts, batch.completion_ids, group_size=G, pad_id=0, device="cpu")
    pack = 0 if layout == "packed" else None
    return build_policy_batch(batch.prompt_ids, batch.completion_ids, pad_id=0, device="cpu", pack_capacity=pack)


def _pinned_forward(model: nn.Module, batch: TrainBatch, layout: str) -> dict[str, Any]:
    """The logprobs of ``batch`` (all its rows, one micro-batch) through the trainer's RoutingReplay,
    and, per body call, the ``[N, M, K]`` expert indices the experts modules actually computed with."""
    mb = _model_batch(batch, layout)
    replay = RoutingReplay(True, model, torch.device("cpu"))
    replay.prepare(batch, list(range(len(batch.completion_ids))), mb)
    seen: list[torch.Tensor] = []
    experts_modules = [layer.mlp.experts for layer in model.model.layers]
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone())) for m in experts_modules]
    try:
        with torch.no_grad(), replay.pinned(model):
            if isinstance(mb, GroupedBatch):
                logprobs = grouped_completion_logprobs(model, mb)
            else:
                logprobs = completion_logprobs(model, mb)
    finally:
        for hook in hooks:
            hook.remove()
    layers = len(experts_modules)
    calls = [torch.stack(seen[i : i + layers], dim=1) for i in range(0, len(seen), layers)]
    return {"logprobs": logprobs, "experts": calls}


def _cell(batch: TrainBatch, cell: int, mini_batch: int) -> TrainBatch:
    return take_rows(batch, cell_rows(len(LENGTHS), group_size=G, mini_batch=mini_batch, cell=cell, cells=2))


def _train(mesh: Any = None) -> dict[str, Any]:
    """One replayed ``train_on``: on the whole batch (``mesh`` None) or on this rank's cell."""
    from posttrain.distributed.fsdp import full_state_dict, shard_policy
    from posttrain.distributed.reference import shard_reference_for_world

    cfg = build_config(None, TRAIN)
    model, batch, objective = tiny_qwen3_moe(), _batch(), grpo_objective(cfg)
    reference = build_reference(model, cfg, objective)
    if mesh is not None:
        dp = shard_policy(model, mesh)
        reference = shard_reference_for_world(reference, dp)
        batch = _cell(batch, dp.cell, cfg.rl.mini_batch)
    trainer = PolicyTrainer(model, cfg, objective=objective, pad_id=0, ref_model=reference)
    metrics = trainer.train_on(batch, step=1)
    return {"metrics": metrics, "state": full_state_dict(model)}


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from posttrain.distributed.fsdp import build_dp_mesh, shard_policy
    from posttrain.distributed.process_group import init_process_group

    init_process_group(init_method=f"file://{out}/store", rank=rank, world_size=world, timeout_s=60)
    try:
        mesh = build_dp_mesh(1)
        model = tiny_qwen3_moe()
        dp = shard_policy(model, mesh)
        cell = _cell(_batch(), dp.cell, mini_batch=len(LENGTHS))
        result: dict[str, Any] = {layout: _pinned_forward(model, cell, layout) for layout in LAYOUTS}
        result["train"] = _train(mesh)
        torch.save(result, f"{out}/rank{rank}.pt")
        dist.barrier()  # no rank leaves while its peer is still in the last collective
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as exit_rank_process does: gloo's threads may abort a finalizing interpreter


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("moe_ranks")
    ctx = mp.spawn(_worker, args=(2, str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the 2-rank run did not finish within {SPAWN_TIMEOUT_S:.0f} s")
    return [torch.load(Path(out) / f"rank{r}.pt") for r in range(2)]


def test_the_sampler_routes_elsewhere_than_the_policy() -> None:
    """The fixture has teeth: unpinned, the policy routes a good share of positions differently."""
    batch, model = _batch(), tiny_qwen3_moe().eval()
    differ = total = 0
    for p, c, trace in zip(batch.prompt_ids, batch.completion_ids, batch.routing.experts):
        with record_routing(model) as rec, torch.no_grad():
            model(torch.tensor([p + c]))
        own = rec[0][:-1].sort(-1).values
        differ += int((own != trace.long().sort(-1).values).any(-1).sum())
        total += own.shape[0] * own.shape[1]
    assert differ / total > 0.2, (differ, total)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_ranks_pinned_forward_is_the_sampler_routing_and_one_process_logprobs(
    two_ranks: list[dict[str, Any]], layout: str
) -> None:
    batch, model = _batch(), tiny_qwen3_moe()
    for rank, result in enumerate(two_ranks):
        cell = _cell(batch, rank, mini_batch=len(LENGTHS))
        got = result[layout]
        # every body call's experts are the trace laid out onto the layout (placeholders included) ...
        mb = _model_batch(cell, layout)
        want = batch_routing(mb, cell.routing, cell.prompt_ids, cell.completion_ids)
        assert len(got["experts"]) == len(want) == (2 if layout == "shared_prompt" else 1)
        for seen, laid in zip(got["experts"], want):
            assert torch.equal(seen, laid.long()), (rank, layout)
        # ... and at each sequence's positions, the sampler's own trace
        if isinstance(mb, PolicyBatch):
            flat = got["experts"][0]
            for b, trace in enumerate(cell.routing.experts):
                start = mb.seq_start_B[b]
                assert torch.equal(flat[start : start + trace.shape[0]], trace.long()), (rank, layout, b)
        one = _pinned_forward(model, cell, layout)
        assert all(torch.equal(a, b) for a, b in zip(one["experts"], got["experts"]))
        assert torch.equal(one["logprobs"], got["logprobs"]), (rank, layout)


def test_a_replayed_update_on_two_ranks_matches_one_process(two_ranks: list[dict[str, Any]]) -> None:
    reference = _train()
    dist = two_ranks[0]["train"]
    tokens = sum(len(p) + len(c) for p, c in zip(_batch().prompt_ids, _batch().completion_ids))
    for metrics in (reference["metrics"], dist["metrics"], two_ranks[1]["train"]["metrics"]):
        # the metric counts both mini-batches' forwards of all ranks' cells: the batch, prompts included
        assert metrics["train/routing_replay_pinned_tokens"] == tokens
    for key in ("train/loss_avg", "train/kl_mean", "train/grad_norm", "optim/step"):
        assert dist["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-5, abs=1e-7), key
    assert two_ranks[1]["train"]["state"] == {}  # gathered on rank 0 only
    initial = tiny_qwen3_moe().state_dict()
    for name, ref in reference["state"].items():
        torch.testing.assert_close(dist["state"][name], ref, rtol=0, atol=PARAM_ATOL, msg=name)
    moved = {name for name, ref in reference["state"].items() if not torch.equal(ref, initial[name])}
    assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight"} <= moved
