"""A multimodal GRPO update under two FSDP2 policy ranks (gloo, CPU) equals one process's.

One collected batch of image prompts (the shape-count task, sampled by the transformers engine's
image sampler from a tiny random Qwen3-VL) is trained by ``PolicyTrainer.train_on`` with a pi_old
pass (two optimizer steps), a frozen KL reference and two micro-batches per step: once in this
process on the whole batch, once by two spawned ranks that shard the policy (the vision tower is an
FSDP2 unit of its own, the multimodal body the root) and the reference, each on its data cell
(``take_rows`` slices the image payload with the rows). The trained weights are held to 2e-6 and
the loss to 1e-6, as in tests/integration/test_moe_ranks.py (the ranks sum the gradients in
another order than one process).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_runs import run_two_ranks

from posttrain.config.loading import build_config
from posttrain.distributed.cells import cell_rows, take_rows
from posttrain.policy.images import ImageInputs
from posttrain.policy.objective import grpo_objective
from posttrain.policy.train_batch import TrainBatch
from posttrain.policy.trainer import PolicyTrainer, build_reference

G = 2
PROMPTS = 4
TRAIN = [
    f"rl.batch_per_replica={G * PROMPTS}",
    f"rl.group_size={G}",
    "rl.mini_batch_per_replica=4",  # two optimizer steps: the pi_old pass runs on the image rows
    "rl.micro_batch_per_replica=2",  # two micro-batches per optimizer step on each rank
    "rl.optimizer.lr=1e-4",
    # not AdamW's 1e-8: its first step moves a weight by lr * g / (|g| + eps), and at eps 1e-8 the
    # ranks' other summation order in a near-zero gradient moved one weight by more than PARAM_ATOL
    # on one CPU; a wrong reduction still moves weights by O(lr)
    "rl.optimizer.eps=1e-4",
    "rl.optimizer.grad_clip_norm=null",
    "rl.kl_beta=0.1",
    "rl.ref.build_ref=true",
]
PARAM_ATOL = 2e-6
SPAWN_TIMEOUT_S = 240.0


def _load(path: str) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, dtype=torch.float32)


def _collect(path: str) -> TrainBatch:
    from posttrain.data.visual import ShapeCountSource
    from posttrain.models.vision import VisionProcessor
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf_engine import HFRolloutEngine
    from posttrain.rollout.vl_sampling import ImagePromptSampler

    sampler = ImagePromptSampler(VisionProcessor.from_dir(path))
    prompts = [sampler.render(s.prompt) for s in ShapeCountSource(seed=0).next_batch(PROMPTS)]
    engine = HFRolloutEngine(_load(path), sampler.processor.tokenizer)
    rollout = sampler.generate(engine, prompts, G, SamplingParams(max_tokens=5, seed=1))
    comps = rollout.completions
    return TrainBatch(
        prompt_ids=[rollout.prompt_token_ids[c.prompt_index] for c in comps],
        completion_ids=[c.token_ids for c in comps],
        advantages_B=torch.linspace(-1.5, 1.5, len(comps)),
        in_loss_B=torch.ones(len(comps), dtype=torch.bool),
        sampler_logprobs=[c.logprobs for c in comps],
        group_size=G,
        images=ImageInputs.repeat([p.pixel_values_P for p in prompts], [p.image_grid_thw_I3 for p in prompts], G),
    )


def _train(path: str, batch: TrainBatch, mesh: Any = None) -> dict[str, Any]:
    from posttrain.distributed.fsdp import full_state_dict, shard_policy
    from posttrain.distributed.reference import shard_reference_for_world

    cfg = build_config(None, TRAIN)
    model, objective = _load(path), grpo_objective(cfg)
    reference = build_reference(model, cfg, objective)
    if mesh is not None:
        dp = shard_policy(model, mesh)
        reference = shard_reference_for_world(reference, dp)
        rows = cell_rows(len(batch.completion_ids), group_size=G, mini_batch=cfg.rl.mini_batch, cell=dp.cell, cells=2)
        batch = take_rows(batch, rows)
    trainer = PolicyTrainer(model, cfg, objective=objective, pad_id=0, ref_model=reference)
    metrics = trainer.train_on(batch, step=1)
    return {"metrics": metrics, "state": full_state_dict(model)}


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from posttrain.distributed.fsdp import build_dp_mesh
    from posttrain.distributed.process_group import init_process_group

    torch.set_num_threads(1)
    init_process_group(init_method=f"file://{out}/store", rank=rank, world_size=world, timeout_s=60)
    try:
        saved = torch.load(f"{out}/batch.pt", weights_only=False)
        result = _train(saved["path"], saved["batch"], build_dp_mesh(1))
        torch.save(result, f"{out}/rank{rank}.pt")
        dist.barrier()  # no rank leaves while its peer is still in the last collective
    finally:
        dist.destroy_process_group()
    os._exit(0)  # gloo's threads may abort a finalizing interpreter


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> tuple[str, dict[str, Any], list[Any]]:
    import torch.multiprocessing as mp

    from posttrain.models.tiny import make_tiny_vl_model

    path = make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")), smollm2_tokenizer_dir, vision_depth=1)
    batch = _collect(path)
    out = tmp_path_factory.mktemp("vl_ranks")
    torch.save({"path": path, "batch": batch}, out / "batch.pt")
    ctx = mp.spawn(_worker, args=(2, str(out)), nprocs=2, join=False)
    one = _train(path, batch)  # one process, while the ranks run
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the 2-rank run did not finish within {SPAWN_TIMEOUT_S:.0f} s")
    return path, one, [torch.load(Path(out) / f"rank{r}.pt") for r in range(2)]


def test_two_ranks_train_the_image_batch_as_one_process(runs: tuple[str, dict[str, Any], list[Any]]) -> None:
    from safetensors.torch import load_file

    path, one, ranks = runs
    for rank in ranks:
        assert rank["metrics"]["train/loss_avg"] == pytest.approx(one["metrics"]["train/loss_avg"], abs=1e-6)
        assert rank["metrics"]["train/grad_norm"] == pytest.approx(one["metrics"]["train/grad_norm"], rel=1e-5)
        assert rank["metrics"]["train/valid_token_count"] == one["metrics"]["train/valid_token_count"]
    assert ranks[1]["state"] == {}  # the consolidated weights are gathered to rank 0
    assert ranks[0]["state"].keys() == one["state"].keys()
    for name, tensor in one["state"].items():
        torch.testing.assert_close(ranks[0]["state"][name], tensor, atol=PARAM_ATOL, rtol=0, msg=name)
    initial = load_file(str(Path(path) / "model.safetensors"))
    moved = [n for n in one["state"] if n.startswith("model.visual.") and not torch.equal(one["state"][n], initial[n])]
    assert moved, "the vision tower did not train"


@pytest.mark.slow
def test_multimodal_run_under_torchrun_syncs_the_whole_policy_to_each_engine(
    runs: tuple[str, dict[str, Any], list[Any]], tmp_path: Path
) -> None:
    """The real entrypoint on two ranks: each rank's transformers engine holds its own copy of the
    policy and receives the gathered weights, vision tower included, after every update; step 2's
    sampler logprobs agreeing with the trainer's proves the copy holds update 1's weights."""
    import json

    path = runs[0]
    overrides = [
        f"model.name_or_path={path}",
        f"job.output_root={tmp_path}",
        "job.name=two",
        "rl.data.factory=posttrain.data.visual:shape_count_rows",
        "rl.reward=e2e_rewards:length_reward",
        "rl.batch_per_replica=8",
        "rl.group_size=4",
        "rollout.max_tokens=4",
        "rl.optimizer.lr=1e-3",
        "rl.max_steps=2",
        "grid.shapes.policy=[1,2]",
        "grid.collective_timeout_s=60",
    ]
    res = run_two_ranks("posttrain.entrypoints.grpo", ["--", *overrides], timeout_s=180)
    assert res.returncode == 0, res.stderr[-3000:]
    (run_dir,) = (tmp_path / "posttrain" / "grpo" / "two").iterdir()
    frames = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [f["step"] for f in frames] == [1, 2]
    assert all(f["train/grad_norm"] > 0 for f in frames)
    assert frames[1]["train/logprob_gap_max"] < 1e-4
