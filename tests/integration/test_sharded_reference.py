"""The KL reference under two FSDP2 policy ranks (gloo, CPU): sharded like the policy, same numbers.

One ``torch.multiprocessing`` spawn of 2 ranks builds the reference as ``loop/run.py`` does
(``build_reference`` from the whole model, then ``shard_for_world`` for the policy and
``shard_reference_for_world`` for the reference) and writes, from rank 0: each reference
parameter's local and full element counts, both ranks' reference logprobs on their cells, and the
metrics of a ``train_on`` with ``rl.kl_beta > 0``. The tests compare with one plain process.

Tolerances (fp32): reference logprobs within 1e-6 nats (the sharded forward all-gathers the exact
weights, so only the summation order of identical shapes could differ); ``train/kl_mean`` and
``train/kl_max`` over two optimizer steps (the second one sees a moved policy, so the KL is not
zero) within 1e-4 relative: the 2-rank policy after one step may differ from one process's by ~1e-7
relative (``test_fsdp_equivalence.py``), and the k3 KL of a small move is a difference of nearly
equal terms. Measured on this CPU: both gaps are exactly 0. In bf16 compute the reference (bf16
shards) and the policy (fp32 shards under FSDP2's mixed-precision policy) give a KL of exactly 0
before the first update. A ``torchrun`` launch of the GRPO entrypoint checks the loop's wiring; it
cannot be compared with one process (2 ranks sample other completions, see
``test_torchrun_loop.py``), so the trainer-level runs above carry the equivalence.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_runs import run_two_ranks

from posttrain.config.loading import build_config
from posttrain.distributed.cells import cell_rows, take_rows
from posttrain.policy.objective import grpo_objective
from posttrain.policy.train_batch import TrainBatch
from posttrain.policy.trainer import PolicyTrainer, build_reference

G = 2
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19]]
LENGTHS = [3, 9, 2, 6, 1, 5, 8, 7]
COMMON = [
    "rl.batch_per_replica=8",
    f"rl.group_size={G}",
    "rl.micro_batch_per_replica=2",
    "rl.optimizer.lr=1e-3",
    "rl.optimizer.grad_clip_norm=null",
    "rl.kl_beta=0.1",
    "rollout.max_tokens=12",
    "model.share_prompt_prefix=true",  # whole groups per micro-batch: one composition on 1 and 2 ranks
]
# fp32: two optimizer steps (the second sees a moved policy). bf16: one step at the initial weights.
CASES = {
    "fp32": ["rl.mini_batch_per_replica=4"],
    "bf16": ["rl.mini_batch_per_replica=8", "model.compute_dtype=bfloat16"],
}
SPAWN_TIMEOUT_S = 240.0
LOGPROB_ATOL = 1e-6
KL_RTOL = 1e-4


def _batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(1)
    comps = [torch.randint(30, 900, (n,), generator=gen).tolist() for n in LENGTHS]
    return TrainBatch(
        prompt_ids=[p for p in PROMPTS for _ in range(G)],
        completion_ids=comps,
        advantages_B=torch.linspace(-1.0, 1.3, len(comps)),
        in_loss_B=torch.ones(len(comps), dtype=torch.bool),
        sampler_logprobs=[[-1.0] * len(c) for c in comps],
        group_size=G,
    )


def _ref_logprobs(ref: torch.nn.Module, batch: TrainBatch) -> list[list[float]]:
    """The reference's per-token logprobs of every row of ``batch`` (one padded forward)."""
    from posttrain.policy.batching import build_policy_batch
    from posttrain.policy.logprobs import completion_logprobs

    pb = build_policy_batch(batch.prompt_ids, batch.completion_ids, pad_id=2, device="cpu")
    with torch.no_grad():
        out = completion_logprobs(ref, pb)
    assert isinstance(out, torch.Tensor)
    return [out[i, : len(c)].tolist() for i, c in enumerate(batch.completion_ids)]


def _run(model_dir: str, overrides: list[str], rank: int | None = None) -> dict[str, Any]:
    """Build policy and reference as ``start_run`` does, then one ``train_on``: on the whole batch in
    one process (``rank`` None), on this rank's cell under 2 ranks."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from posttrain.distributed.fsdp import shard_for_world
    from posttrain.distributed.reference import shard_reference_for_world
    from posttrain.models.precision import resolve_precision

    cfg = build_config(None, [*COMMON, *overrides])
    objective = grpo_objective(cfg)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = build_reference(model, cfg, objective)
    assert reference is not None
    precision = resolve_precision(cfg.model.dtype, cfg.model.compute_dtype, torch.device("cpu"))
    dp = shard_for_world(model, 1, None, compute_dtype=precision.compute_dtype)
    reference = shard_reference_for_world(reference, dp, compute_dtype=precision.compute_dtype)
    assert reference is not None
    batch, rows = _batch(), list(range(len(LENGTHS)))
    if rank is not None:  # this rank's slice of every mini-batch, as the loop hands it out
        rows = cell_rows(len(LENGTHS), group_size=G, mini_batch=cfg.rl.mini_batch, cell=dp.cell, cells=dp.size)
        batch = take_rows(batch, rows)
    params = {
        name: (p.to_local().numel() if isinstance(p, DTensor) else -1, p.numel(), p.dtype, p.requires_grad)
        for name, p in reference.named_parameters()
    }
    logprobs = _ref_logprobs(reference, batch) if not precision.mixed else []
    dp.reshard(reference)
    trainer = PolicyTrainer(model, cfg, objective=objective, pad_id=2, ref_model=reference)
    metrics = trainer.train_on(batch, step=1)
    resharded = all(isinstance(p, DTensor) for p in reference.parameters())  # no unit left gathered
    return {"params": params, "rows": rows, "logprobs": logprobs, "metrics": metrics, "resharded": resharded}


def _worker(rank: int, world: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from posttrain.distributed.process_group import init_process_group
    from posttrain.distributed.world import gather_objects

    init_process_group(init_method=f"file://{out}/store", rank=rank, world_size=world, timeout_s=60)
    try:
        for name, overrides in CASES.items():
            result = _run(model_dir, overrides, rank)
            gathered = gather_objects(result)
            if rank == 0:
                torch.save(gathered, f"{out}/{name}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as exit_rank_process does: gloo's threads may abort a finalizing interpreter


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Both cases on 2 gloo ranks: per case, each rank's result in rank order."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("sharded_reference")
    ctx = mp.spawn(_worker, args=(2, tiny_model_dir, str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the 2-rank run did not finish within {SPAWN_TIMEOUT_S:.0f} s")
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in CASES}


def test_reference_is_sharded_across_the_ranks(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    """Every parameter is a DTensor of which each rank holds half (every dim 0 of the tiny model is
    even), frozen, in the compute dtype; the tied LM head became a sharded parameter of its own."""
    for case, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ranks = two_ranks[case]
        assert "lm_head.weight" in ranks[0]["params"] and "model.embed_tokens.weight" in ranks[0]["params"]
        for r in ranks:
            assert r["params"].keys() == ranks[0]["params"].keys()
            for name, (local, full, param_dtype, requires_grad) in r["params"].items():
                assert local >= 0, f"{case}: reference parameter {name} is not a DTensor"
                assert 2 * local == full, f"{case}: this rank holds {local} of {name}'s {full} elements"
                assert param_dtype == dtype and not requires_grad, (case, name, param_dtype, requires_grad)
            assert r["resharded"], f"{case}: a reference unit stayed gathered after train_on"


def test_sharded_reference_logprobs_equal_the_unsharded_ones(
    tiny_model_dir: str, two_ranks: dict[str, list[dict[str, Any]]]
) -> None:
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected = _ref_logprobs(plain, _batch())
    got = {row: lp for r in two_ranks["fp32"] for row, lp in zip(r["rows"], r["logprobs"])}
    assert sorted(got) == list(range(len(expected)))  # the two cells cover the batch once
    for row, e in enumerate(expected):
        torch.testing.assert_close(torch.tensor(got[row]), torch.tensor(e), rtol=0, atol=LOGPROB_ATOL, msg=f"row {row}")


def test_kl_metric_matches_one_process(tiny_model_dir: str, two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    one = _run(tiny_model_dir, CASES["fp32"])
    assert one["params"] and all(local == -1 for local, _, _, _ in one["params"].values())  # one process: plain
    kl = one["metrics"]["train/kl_mean"]
    assert kl > 1e-7  # the second optimizer step's policy has moved: the comparison has teeth
    for r in two_ranks["fp32"]:  # metrics are reduced over the ranks: the same on both
        assert r["metrics"]["train/kl_mean"] == pytest.approx(kl, rel=KL_RTOL)
        assert r["metrics"]["train/kl_max"] == pytest.approx(one["metrics"]["train/kl_max"], rel=KL_RTOL)
        assert r["metrics"]["train/loss_avg"] == pytest.approx(one["metrics"]["train/loss_avg"], rel=1e-5, abs=1e-7)


def test_bf16_reference_computes_like_the_mixed_policy(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    """Before any update the policy (fp32 shards, bf16 compute through FSDP2's MixedPrecisionPolicy)
    and the reference (bf16 shards) compute the same logprobs, so the KL is exactly zero."""
    for r in two_ranks["bf16"]:
        assert r["metrics"]["train/kl_max"] == 0.0 and r["metrics"]["train/kl_mean"] == 0.0


def test_one_process_keeps_the_reference_as_built(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from posttrain.distributed.fsdp import SingleProcess
    from posttrain.distributed.reference import shard_reference_for_world

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    assert shard_reference_for_world(ref, SingleProcess(), compute_dtype=torch.bfloat16) is ref
    after = ref.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())
    assert ref.lm_head.weight is ref.model.embed_tokens.weight  # still tied: nothing touched
    assert shard_reference_for_world(None, SingleProcess()) is None


@pytest.mark.slow
def test_kl_run_under_torchrun_two_ranks(tiny_model_dir: str, tmp_path: Path) -> None:
    """The loop's wiring (``start_run``): a kl_beta > 0 run of 2 steps on 2 ranks. Step 1's KL is
    exactly zero (the sharded reference computes what the sharded policy does before it moves),
    step 2's is positive."""
    overrides = [
        f"model.name_or_path={tiny_model_dir}",
        f"job.output_root={tmp_path}",
        "job.name=kl2",
        "rl.reward=e2e_rewards:length_reward",
        "rl.batch_per_replica=8",
        "rl.group_size=4",
        "rollout.max_tokens=8",
        "rl.optimizer.lr=1e-3",
        "rl.kl_beta=0.1",
        "rl.kl_coeff_clamp=5.0",
        "rl.ref.build_ref=true",
        "rl.max_steps=2",
        "grid.shapes.policy=[1,2]",
        "grid.collective_timeout_s=60",
    ]
    res = run_two_ranks("posttrain.entrypoints.grpo", ["--", *overrides], timeout_s=120)
    assert res.returncode == 0, res.stderr[-3000:]
    (run_dir,) = (tmp_path / "posttrain" / "grpo" / "kl2").iterdir()
    frames = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [f["step"] for f in frames] == [1, 2]
    assert frames[0]["train/kl_mean"] == 0.0 and frames[0]["train/kl_max"] == 0.0
    assert frames[1]["train/kl_mean"] > 0.0
