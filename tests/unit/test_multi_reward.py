"""Several rewards (``rl.reward`` as a list, ``rl.reward_weights``), async and batched scorers, the
preflight's reward-list checks, the distribution metrics and the completions log's step cadence."""

from __future__ import annotations

import json
import math
import textwrap
import time
from pathlib import Path

import pytest
import torch

from posttrain.entrypoints.grpo import main
from posttrain.errors import RewardError
from posttrain.loop.collect import distribution_metrics
from posttrain.metrics.completions import CompletionsLog, markdown_table
from posttrain.rewards.base import RewardInput
from posttrain.rewards.combined import WeightedRewards, metric_key, score_parts
from posttrain.rewards.registry import get_reward, with_timeout

MODULE = "pt_multi_rewards"

SOURCE = textwrap.dedent(
    """
    import asyncio
    import time

    def tenth_len(sample):
        return len(sample.completion) / 10

    def has_x(sample):
        return 1.0 if "x" in sample.completion else 0.0

    async def async_len(sample):
        await asyncio.sleep(0.3)
        return float(len(sample.completion))

    async def async_hangs_on_b(sample):
        await asyncio.sleep(30 if sample.completion == "b" else 0)
        return 1.0

    def returns_none(sample):
        return None

    def short_batch(samples):
        return [1.0] * (len(samples) - 1)
    short_batch.batched = True

    async def async_batch(samples):
        await asyncio.sleep(0)
        return [float(len(s.completion)) for s in samples]
    async_batch.batched = True

    def needs_answer(sample):
        return 1.0
    needs_answer.requires = {"prompt", "ground_truth"}
    """
)


@pytest.fixture(autouse=True)
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))


def _inputs(*completions: str) -> list[RewardInput]:
    return [RewardInput(prompt="p", completion=c) for c in completions]


def test_two_weighted_rewards_give_parts_and_their_weighted_sum() -> None:
    reward = get_reward([f"{MODULE}:tenth_len", f"{MODULE}:has_x"], weights=[2.0, -0.5])
    assert isinstance(reward, WeightedRewards)
    total, parts = score_parts(reward, _inputs("x", "abcd", "xyzxyz"))
    assert parts == {"pt_multi_rewards_tenth_len": [0.1, 0.4, 0.6], "pt_multi_rewards_has_x": [1.0, 0.0, 1.0]}
    assert total == pytest.approx([2 * 0.1 - 0.5, 2 * 0.4, 2 * 0.6 - 0.5])
    # weights default to 1 each; a list of one is one part
    assert score_parts(get_reward([f"{MODULE}:tenth_len", f"{MODULE}:has_x"]), _inputs("xy"))[0] == [1.2]
    assert reward.name == f"{MODULE}:tenth_len+{MODULE}:has_x"


def test_one_plain_reward_is_scored_exactly_as_before() -> None:
    plain = get_reward(f"{MODULE}:tenth_len")
    assert not isinstance(plain, WeightedRewards)  # the default path keeps the reward itself
    total, parts = score_parts(plain, _inputs("abc"))
    assert total == [0.3] and parts == {"pt_multi_rewards_tenth_len": [0.3]}
    single = get_reward(f"{MODULE}:tenth_len", weights=[1.0])
    assert score_parts(single, _inputs("abc"))[0] == [0.3]  # weight 1: the very same float


def test_metric_key_sanitizes_import_paths() -> None:
    assert metric_key("arithmetic") == "arithmetic"
    assert metric_key("my.pkg:score-v2") == "my_pkg_score_v2"


def test_wrong_number_of_weights_in_the_api_is_named() -> None:
    with pytest.raises(ValueError, match=r"rl\.reward_weights has 1 weights for 2 rewards"):
        get_reward(["nonempty", "constant"], weights=[1.0])


def test_null_is_not_zero_for_each_part() -> None:
    reward = get_reward([f"{MODULE}:tenth_len", f"{MODULE}:returns_none"])
    with pytest.raises(RewardError, match=r"reward 'pt_multi_rewards:returns_none' returned None"):
        score_parts(reward, _inputs("a"), ["row:1#0"])


def test_a_batched_part_with_the_wrong_count_is_named() -> None:
    reward = get_reward(["nonempty", f"{MODULE}:short_batch"])
    with pytest.raises(RewardError, match=r"reward 'pt_multi_rewards:short_batch' is batched but returned 2 scores"):
        score_parts(reward, _inputs("a", "b", "c"))


def test_an_async_reward_scores_the_batch_concurrently() -> None:
    reward = get_reward(f"{MODULE}:async_len")
    start = time.monotonic()
    assert score_parts(reward, _inputs("a", "bb", "ccc", "dddd"))[0] == [1.0, 2.0, 3.0, 4.0]
    assert time.monotonic() - start < 1.0  # four 0.3 s coroutines at once, not 1.2 s one after another
    assert score_parts(get_reward(f"{MODULE}:async_batch"), _inputs("ab", "c"))[0] == [2.0, 1.0]


def test_an_async_reward_that_hangs_names_the_sample() -> None:
    reward = with_timeout(get_reward([f"{MODULE}:async_hangs_on_b"]), 0.2)
    with pytest.raises(RewardError, match=r"did not return within rl\.reward_timeout_s=0\.2 s on sample 'u#1'"):
        score_parts(reward, _inputs("a", "b"), ["u#0", "u#1"])


def _preflight_errors(capsys: pytest.CaptureFixture[str], *overrides: str) -> str:
    assert main(["--validate-manifest", "--", *overrides]) == 1
    return capsys.readouterr().err


def test_preflight_refuses_a_wrong_number_of_weights(capsys: pytest.CaptureFixture[str]) -> None:
    err = _preflight_errors(capsys, "rl.reward=[arithmetic,nonempty]", "rl.reward_weights=[1.0]")
    assert "rl.reward_weights=[1.0] has 1 weight(s) for the 2 reward(s)" in err
    err = _preflight_errors(capsys, "rl.reward=arithmetic", "rl.reward_weights=[1.0,2.0]")
    assert "rl.reward_weights=[1.0, 2.0] has 2 weight(s) for the 1 reward(s)" in err


def test_preflight_refuses_a_weights_mismatch_before_the_model_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # a plain run (no --validate-manifest) stops in the preflight: the model path is never opened
    code = main(
        ["--", "rl.reward=[arithmetic,nonempty]", "rl.reward_weights=[1.0,2.0,3.0]", f"job.output_root={tmp_path}"]
    )
    assert code == 1
    assert "rl.reward_weights=[1.0, 2.0, 3.0] has 3 weight(s)" in capsys.readouterr().err
    assert not (tmp_path / "posttrain").exists()  # no run directory either


def test_preflight_checks_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    err = _preflight_errors(capsys, f"rl.reward=[arithmetic,{MODULE}:needs_answer,nonempty,no_such_reward]")
    assert "rl.reward=no_such_reward: rl.reward: unknown reward 'no_such_reward'" in err
    assert "rl.reward=[arithmetic" not in err  # every problem names the one reward it is about
    err = _preflight_errors(capsys, "rl.reward=[nonempty,nonempty]")
    assert "rl.reward lists 'nonempty' twice" in err
    err = _preflight_errors(capsys, "rl.reward=[]")
    assert "rl.reward=[] names no reward" in err


def test_preflight_names_the_part_whose_input_is_missing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    err = _preflight_errors(
        capsys,
        f"rl.reward=[nonempty,{MODULE}:needs_answer]",
        f"rl.data.path={data}",
        "rl.data.response_column=null",
    )
    assert f"rl.reward={MODULE}:needs_answer needs the input 'ground_truth'" in err


def test_distribution_metrics_by_hand() -> None:
    rewards = torch.tensor([[0.0, 1.0], [0.5, 2.0]])
    lengths = torch.tensor([2.0, 0.0, 4.0, 1.0])
    advantages = torch.tensor([1.0, -1.0, -0.5, 3.0])
    m = distribution_metrics(rewards, lengths, advantages)
    # token-weighted: (1*2 + -0.5*4 + 3*1) / 7 = 3/7; the 0-token sequence carries no token
    mean = 3 / 7
    var = (2 * (1 - mean) ** 2 + 4 * (-0.5 - mean) ** 2 + 1 * (3 - mean) ** 2) / 7
    assert m == pytest.approx(
        {
            "train/reward_min": 0.0,
            "train/reward_max": 2.0,
            "rollout/completion_length_mean": 7 / 4,
            "rollout/completion_length_min": 0.0,
            "rollout/completion_length_max": 4.0,
            "rollout/advantage_mean": mean,
            "rollout/advantage_std": math.sqrt(var),
            "rollout/advantage_min": -0.5,
            "rollout/advantage_max": 3.0,
        }
    )


def test_completions_log_counts_steps_and_writes_every_cell(tmp_path: Path) -> None:
    path = tmp_path / "completions.jsonl"
    built: list[int] = []
    sunk: list[int] = []

    def rows() -> list[dict]:
        built.append(1)
        return [{"uid": "a#0", "completion": "x|y"}]

    log = CompletionsLog(
        path,
        2,
        first_step=lambda: 3,  # a resumed run: steps 1-2 were done
        gather=lambda own: [own, [{"uid": "b#0", "completion": "z"}]],  # two cells
        writes=True,
        sink=lambda step, lines: sunk.append(step),
    )
    for _ in range(4):  # steps 3, 4, 5, 6
        log.record(rows)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(li["step"], li["cell"], li["uid"]) for li in lines] == [
        (4, 0, "a#0"),
        (4, 1, "b#0"),
        (6, 0, "a#0"),
        (6, 1, "b#0"),
    ]
    assert len(built) == 2 and sunk == [4, 6]  # rows are built only on due steps
    assert "x\\|y" in markdown_table(lines)  # a pipe in a completion does not split the Markdown cell
    other_rank = CompletionsLog(tmp_path / "other.jsonl", 1, first_step=lambda: 1, gather=lambda o: [o], writes=False)
    other_rank.record(rows)
    assert not (tmp_path / "other.jsonl").exists()


def test_completions_reach_tensorboard_as_text(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from posttrain.metrics.sinks import MetricsLogger

    with MetricsLogger(tmp_path, tensorboard=True, console=False) as log:
        log.log_completions(4, [{"step": 4, "uid": "a#0", "completion": "seven", "reward": 1.0}])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    [event] = events.Tensors("completions/text_summary")
    assert event.step == 4
    text = event.tensor_proto.string_val[0].decode()
    assert "| 4 |  | a#0 |  | seven |  |  | 1.0 |  |  |" in text  # absent fields are empty cells
