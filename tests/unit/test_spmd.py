"""The SPMD loop's pure helpers: which groups a data cell samples, and how per-rank metrics merge."""

from __future__ import annotations

import pytest

from posttrain.config.loading import build_config
from posttrain.distributed.cells import Cells, cell_group_indices
from posttrain.distributed.process_group import pin_torchrun_gpu
from posttrain.distributed.world import merge_rank_metrics
from posttrain.loop.collect import sampling_params


def cell_groups(cfg, cells):
    rl = cfg.rl
    return cell_group_indices(rl.batch_per_replica, group_size=rl.group_size, mini_batch=rl.mini_batch, cells=cells)


def test_cell_groups_are_the_cells_slice_of_every_mini_batch() -> None:
    cfg = build_config(None, ["rl.batch_per_replica=16", "rl.group_size=2"])  # 8 groups, one mini-batch
    assert cell_groups(cfg, Cells(0, 2)) == [0, 1, 2, 3]
    assert cell_groups(cfg, Cells(1, 2)) == [4, 5, 6, 7]
    two_mini = build_config(None, ["rl.batch_per_replica=16", "rl.group_size=2", "rl.mini_batch_per_replica=8"])
    assert cell_groups(two_mini, Cells(0, 2)) == [0, 1, 4, 5]  # its share of the global 1st and 2nd step
    assert cell_groups(two_mini, Cells(1, 2)) == [2, 3, 6, 7]
    assert cell_groups(cfg, Cells()) == list(range(8))


def test_each_cell_samples_its_own_stream() -> None:
    cfg = build_config(None, ["rollout.seed=7"])
    assert [sampling_params(cfg, c).seed for c in (0, 1, 2)] == [7, 8, 9]
    assert sampling_params(build_config(None, ["rollout.seed=null"]), 1).seed is None


def test_rank_metrics_merge_by_what_they_measure() -> None:
    frames = [
        {"rollout/gen_s": 2.0, "rollout/tokens_per_s": 10.0, "rollout/generated_tokens": 20.0, "a/kl_max": 0.1},
        {"rollout/gen_s": 3.0, "rollout/tokens_per_s": 5.0, "rollout/generated_tokens": 15.0, "a/kl_max": 0.3},
    ]
    frames[0]["train/opd_teacher_score_success_count"] = 1.0
    frames[1]["train/opd_teacher_score_success_count"] = 1.0
    frames[0]["train/opd_divergence"], frames[1]["train/opd_divergence"] = 0.2, 0.4
    merged = merge_rank_metrics(frames)
    assert merged["rollout/gen_s"] == 3.0  # the slowest rank's wall time
    assert merged["rollout/tokens_per_s"] == 15.0 and merged["rollout/generated_tokens"] == 35.0
    assert merged["a/kl_max"] == 0.3 and merged["train/opd_teacher_score_success_count"] == 2.0
    assert merged["train/opd_divergence"] == pytest.approx(0.3)
    assert merge_rank_metrics([{"x_min": 1.0}, {"x_min": -1.0, "only_here": 4.0}]) == {"x_min": -1.0, "only_here": 4.0}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # torchrun, every GPU visible: rank 1 sees physical GPU 1 only
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "1"),
        # torchrun under a scheduler's device list: the LOCAL_RANK-th entry of that list
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4, 6"}, "6"),
        # already one device per rank (Ray actors, schedulers): unchanged
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "3"}, None),
        # GPUs hidden on purpose (set but empty): every rank stays on the CPU, nothing pinned
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": ""}, None),
        # one process under torchrun, or no torchrun at all: unchanged
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, None),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, None),
        # fewer visible devices than local ranks: left to torch's own error
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"}, None),
    ],
)
def test_pin_torchrun_gpu(env: dict[str, str], expected: str | None) -> None:
    before = env.get("CUDA_VISIBLE_DEVICES")
    assert pin_torchrun_gpu(env) == expected
    assert env.get("CUDA_VISIBLE_DEVICES") == (expected if expected is not None else before)


_EXIT_SCRIPT = r"""
import atexit, sys
from posttrain.distributed.process_group import exit_rank_process
atexit.register(lambda: print("FINALIZED"))
print("buffered output", end="")
sys.stderr.write("buffered error")
code = exit_rank_process(int(sys.argv[1]))
print(" RETURNED", code)
"""


@pytest.mark.parametrize(
    ("world_size", "status", "returncode", "stdout"),
    [
        ("2", 0, 0, "buffered output"),  # a rank ends at once: no finalization, its output flushed
        ("2", 1, 1, "buffered output"),
        ("1", 3, 0, "buffered output RETURNED 3\nFINALIZED\n"),  # one process: the caller exits
        ("two", 1, 0, "buffered output RETURNED 1\nFINALIZED\n"),
    ],
)
def test_exit_rank_process(world_size: str, status: int, returncode: int, stdout: str) -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, WORLD_SIZE=world_size)
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(status)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (returncode, stdout, "buffered error")
