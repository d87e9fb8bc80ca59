"""Rewards: each built-in on real completions, the registry, custom scorers and checked scoring."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from posttrain.errors import RewardError
from posttrain.rewards.base import RewardInput
from posttrain.rewards.registry import (
    get_reward,
    known_rewards,
    register_reward,
    reward_requires,
    score_completions,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

BUILTINS = ["arithmetic", "arithmetic_first", "constant", "countdown", "exact_match", "gsm8k", "nonempty"]


def score(name: str, completion: str, ground_truth: object = None) -> float:
    """Score one completion through the checked path the training loop uses."""
    sample = RewardInput(prompt="q", completion=completion, ground_truth=ground_truth)
    return score_completions(get_reward(name), [sample], uids=["row:1"])[0]


# ---------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    ("completion", "truth", "expected"),
    [
        ("42", 42, 1.0),
        ("The answer is 42.", 42, 1.0),
        ("I first thought 41, but it is 42", 42, 1.0),
        ("42, or maybe 43", 42, 0.0),
        ("17", 42, 0.0),
        ("-7", -7, 1.0),
        ("5 - 12 = -7", -7, 1.0),
        ("x = \u22123", -3, 1.0),  # Unicode minus sign
        ("12-5=7", 7, 1.0),  # the binary minus of "12-5" is not read as a sign of 5
        ("It costs 1,234 dollars", 1234, 1.0),
        ("1,234,567", "1234567", 1.0),
        ("3.50", 3.5, 1.0),
        ("0.1", 0.1, 1.0),
        ("2", 2.5, 0.0),
        ("2.5", "2.5", 1.0),
        ("10", "1,0", 1.0),  # commas in the ground truth string are dropped too
        ("I don't know", 4, 0.0),
        ("", 4, 0.0),
    ],
)
def test_arithmetic_reads_the_last_number(completion: str, truth: object, expected: float) -> None:
    assert score("arithmetic", completion, truth) == expected


@pytest.mark.parametrize(
    ("completion", "truth", "expected"),
    [
        ("42", 42, 1.0),
        ("42.", 42, 1.0),
        ("The answer is 42.", 42, 1.0),
        ("13 + 29 = 42", 42, 0.0),  # restating the question first is not answering
        ("42, or maybe 43", 42, 1.0),
        ("-7", -7, 1.0),
        ("It costs 1,234 dollars", 1234, 1.0),
        ("3.50 exactly", 3.5, 1.0),
        ("I don't know", 4, 0.0),
        ("", 4, 0.0),
    ],
)
def test_arithmetic_first_reads_the_first_number(completion: str, truth: object, expected: float) -> None:
    assert score("arithmetic_first", completion, truth) == expected


@pytest.mark.parametrize("truth", ["forty-two", True, [4], {"a": 1}, float("nan"), "nan"])
def test_arithmetic_rejects_a_non_numeric_ground_truth(truth: object) -> None:
    with pytest.raises(RewardError, match=r"reward 'arithmetic' failed on sample 'row:1' \(index 0\).*not a number"):
        score("arithmetic", "42", truth)


# ---------------------------------------------------------------- exact_match


@pytest.mark.parametrize(
    ("completion", "truth", "expected"),
    [
        ("Paris", "Paris", 1.0),
        ("  Paris \n", "Paris", 1.0),
        ("New   York\tCity", "New York City", 1.0),
        ("paris", "Paris", 0.0),
        ("Paris.", "Paris", 0.0),
        ("42", 42, 1.0),
        ("", "x", 0.0),
    ],
)
def test_exact_match(completion: str, truth: object, expected: float) -> None:
    assert score("exact_match", completion, truth) == expected


# ---------------------------------------------------------------- gsm8k

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    ("completion", "truth", "expected"),
    [
        ("She sold 72 in total.\n#### 72", "72", 1.0),
        ("#### 72", 72, 1.0),
        ("#### 72", GSM8K_SOLUTION, 1.0),
        ("#### 71", GSM8K_SOLUTION, 0.0),
        ("#### 1,234.", 1234, 1.0),
        ("#### $18", 18, 1.0),
        ("#### 18.00", "18", 1.0),
        ("#### -3", -3, 1.0),
        ("#### 5\nwait, recount\n#### 72", 72, 1.0),  # the last marker counts
        ("#### 72\nno, #### 5", 72, 0.0),
        ("The answer is 72", 72, 0.0),  # no marker: a real failed attempt
        ("####", 72, 0.0),
        ("#### seventy-two", 72, 0.0),
    ],
)
def test_gsm8k(completion: str, truth: object, expected: float) -> None:
    assert score("gsm8k", completion, truth) == expected


def test_gsm8k_rejects_a_reference_without_a_final_number() -> None:
    with pytest.raises(RewardError, match="no number after '####'"):
        score("gsm8k", "#### 3", "so the answer is #### unknown")


# ---------------------------------------------------------------- countdown

TASK = {"nums": [2, 3, 4], "target": 14}


@pytest.mark.parametrize(
    ("completion", "truth", "expected"),
    [
        ("<answer>(3 + 4) * 2</answer>", TASK, 1.0),
        ("<answer>2 * (3 + 4) = 14</answer>", TASK, 1.0),  # "expr = target": the left side counts
        ("<answer>3 * 4 + 2</answer>", TASK, 1.0),
        ("<answer>2 + 3 + 4</answer>", TASK, 0.0),  # right numbers, wrong value
        ("<answer>(3 + 4) * 2 * 1</answer>", TASK, 0.0),  # an extra number
        ("<answer>(4 + 4) + 6</answer>", TASK, 0.0),  # numbers not in the task
        ("<answer>(3 + 4) + 7</answer>", TASK, 0.0),
        ("<answer>34 - 20</answer>", TASK, 0.0),  # digits glued into other numbers
        ("<answer>2+3+4</answer> no wait <answer>(3+4)*2</answer>", TASK, 1.0),  # last block
        ("<answer>(3+4)*2</answer> no wait <answer>2+3+4</answer>", TASK, 0.0),
        ("Let me think.\n(3 + 4) * 2", TASK, 1.0),  # no block: the last line with a digit
        ("So the answer is (3 + 4) * 2", TASK, 0.0),  # words are not an equation
        ("<answer>2 ** 3 + 4</answer>", {"nums": [2, 3, 4], "target": 12}, 0.0),
        ("<answer>(4 + 3) // 2</answer>", {"nums": [4, 3, 2], "target": 3}, 0.0),
        ("<answer>7 / 2</answer>", {"nums": [7, 2], "target": 3}, 0.0),  # 3.5, not floored to 3
        ("<answer>3 / 2 * 4</answer>", {"nums": [3, 2, 4], "target": 6}, 1.0),  # exact fractions
        ("<answer>5 / (3 - 3)</answer>", {"nums": [5, 3, 3], "target": 1}, 0.0),  # division by zero
        ("<answer>3 - 2</answer>", {"nums": [2, 3], "target": 1}, 1.0),
        ("<answer>-2 + 3</answer>", {"nums": [2, 3], "target": 1}, 0.0),  # no unary minus
        ("<answer>3.0 - 2</answer>", {"nums": [2, 3], "target": 1}, 0.0),
        ("<answer></answer>", TASK, 0.0),
        ("I give up.", TASK, 0.0),
        ("<answer>" + "(" * 200 + "2+3+4" + ")" * 200 + "</answer>", {"nums": [2, 3, 4], "target": 9}, 0.0),
        ("<answer>(3 + 4) * 2</answer>", json.dumps(TASK), 1.0),  # JSON-string ground truth
        ("<answer>(3 + 4) * 2</answer>", {"nums": [2.0, 3, 4], "target": 14.0}, 1.0),
    ],
)
def test_countdown(completion: str, truth: object, expected: float) -> None:
    assert score("countdown", completion, truth) == expected


@pytest.mark.parametrize(
    "truth",
    [
        {"nums": [2, 3, 4]},
        {"target": 14},
        {"nums": "2,3,4", "target": 14},
        {"nums": [], "target": 14},
        {"nums": [2, "3", 4], "target": 14},
        {"nums": [2, 3, 4], "target": "fourteen"},
        {"nums": [2, 3.5], "target": 14},
        {"nums": [True, 3], "target": 14},
        "not json",
        [2, 3, 4, 14],
        14,
    ],
)
def test_countdown_rejects_a_malformed_ground_truth(truth: object) -> None:
    with pytest.raises(RewardError, match="reward 'countdown'"):
        score("countdown", "<answer>(3 + 4) * 2</answer>", truth)


# ---------------------------------------------------------------- nonempty, constant


def test_nonempty_and_constant() -> None:
    assert score("nonempty", "hi") == 1.0
    assert score("nonempty", " \n\t") == 0.0
    assert score("nonempty", "") == 0.0
    assert score("constant", "anything") == 0.0
    assert score("constant", "") == 0.0


# ---------------------------------------------------------------- registry


def test_known_rewards_and_requires() -> None:
    assert known_rewards() == BUILTINS
    needs_answer = frozenset({"prompt", "ground_truth"})
    for name in ["arithmetic", "exact_match", "gsm8k", "countdown"]:
        assert reward_requires(name) == needs_answer
        assert get_reward(name).name == name
    for name in ["nonempty", "constant"]:
        assert reward_requires(name) == frozenset({"prompt"})


def test_unknown_reward_lists_the_known_names() -> None:
    with pytest.raises(ValueError, match="unknown reward 'exact_matc'") as info:
        get_reward("exact_matc")
    message = str(info.value)
    assert "did you mean 'exact_match'" in message
    for name in BUILTINS:
        assert name in message


def test_rewards_joined_by_a_comma_are_shown_as_the_list_they_mean() -> None:
    with pytest.raises(ValueError, match=r"several rewards are a list: rl.reward=\[arithmetic,exact_match\]"):
        get_reward("arithmetic, exact_match")


def test_registering_a_name_twice_fails() -> None:
    from posttrain.rewards import registry

    @register_reward("_test_duplicate")
    def first(sample: RewardInput) -> float:
        return 1.0

    try:
        assert get_reward("_test_duplicate")(RewardInput(prompt="p", completion="c")) == 1.0
        with pytest.raises(ValueError, match="'_test_duplicate' is already registered"):
            register_reward("_test_duplicate")(first.fn)
        with pytest.raises(ValueError, match="'arithmetic' is already registered"):
            register_reward("arithmetic")(first.fn)
    finally:
        registry._REGISTRY.pop("_test_duplicate")


def test_custom_reward_by_import_path() -> None:
    reward = get_reward("pt_fixture_rewards:length_reward")
    assert reward.name == "pt_fixture_rewards:length_reward"
    assert reward.requires == frozenset({"prompt", "ground_truth"})
    samples = [RewardInput(prompt="p", completion="abcd", ground_truth="ab")]
    assert score_completions(reward, samples) == [2.0]

    plain = get_reward("pt_fixture_rewards:starts_with_yes")
    assert plain.requires == frozenset({"prompt"})
    assert reward_requires("pt_fixture_rewards:starts_with_yes") == frozenset({"prompt"})
    # It needs no ground truth, so a sample without one is fine.
    inputs = [RewardInput(prompt="p", completion=c) for c in ["Yes!", "no"]]
    assert score_completions(plain, inputs) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module_xyz:fn", r"cannot import module 'no_such_module_xyz'.*ModuleNotFoundError"),
        ("pt_fixture_rewards:missing", "has no attribute 'missing'"),
        ("pt_fixture_rewards:THRESHOLD", "is a float, not a function"),
        (":fn", "not of the form 'module:function'"),
        ("pt_fixture_rewards:", "not of the form 'module:function'"),
    ],
)
def test_bad_custom_reward_path(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_reward(path)


# ---------------------------------------------------------------- checked scoring


@pytest.mark.parametrize(
    ("function", "shown"),
    [
        ("returns_none", "returned None"),
        ("returns_nan", "returned nan"),
        ("returns_inf", "returned -inf"),
        ("returns_string", "returned '1' \\(str\\)"),
        ("returns_bool", "returned True \\(bool\\)"),
    ],
)
def test_a_bad_score_is_an_error_naming_reward_sample_and_value(function: str, shown: str) -> None:
    reward = get_reward(f"pt_fixture_rewards:{function}")
    inputs = [RewardInput(prompt="p", completion="yes"), RewardInput(prompt="p", completion="yes")]
    expected = rf"reward 'pt_fixture_rewards:{function}' {shown}.* for sample 'b:7' \(index 0\)"
    with pytest.raises(RewardError, match=expected):
        score_completions(reward, inputs, uids=["b:7", "c:9"])


def test_a_bad_score_without_uids_names_the_index() -> None:
    reward = get_reward("pt_fixture_rewards:returns_none")
    with pytest.raises(RewardError, match=r"for sample index 0"):
        score_completions(reward, [RewardInput(prompt="p", completion="x")])


def test_an_exception_in_the_reward_is_chained() -> None:
    reward = get_reward("pt_fixture_rewards:raises")
    inputs = [RewardInput(prompt="p", completion="fine")]
    with pytest.raises(
        RewardError, match=r"failed on sample 'r:2' \(index 0\): ValueError: cannot score 'fine'"
    ) as info:
        score_completions(reward, inputs, uids=["r:2"])
    assert isinstance(info.value.__cause__, ValueError)


def test_missing_ground_truth_is_an_error_not_a_zero() -> None:
    for name in ["arithmetic", "exact_match", "gsm8k", "countdown", "pt_fixture_rewards:length_reward"]:
        # Sample 0 is well formed for this reward, so the failure is about sample 1 only.
        truth = TASK if name == "countdown" else 4
        inputs = [
            RewardInput(prompt="p", completion="4", ground_truth=truth),
            RewardInput(prompt="p", completion="4", ground_truth=None),
        ]
        with pytest.raises(RewardError, match=r"sample 'u1' \(index 1\) is missing field ground_truth"):
            score_completions(get_reward(name), inputs, uids=["u0", "u1"])


def test_builtin_called_directly_without_ground_truth_raises() -> None:
    # The reward itself also refuses, for callers that bypass score_completions.
    for name in ["arithmetic", "exact_match", "gsm8k", "countdown"]:
        with pytest.raises(RewardError, match="missing field ground_truth"):
            get_reward(name)(RewardInput(prompt="p", completion="4"))


def test_malformed_completion_is_an_error() -> None:
    bad = RewardInput(prompt="p", completion=None)  # type: ignore[arg-type]
    with pytest.raises(RewardError, match="malformed completion None"):
        score_completions(get_reward("nonempty"), [bad])


def test_scores_are_plain_floats_and_numpy_numbers_are_accepted() -> None:
    inputs = [RewardInput(prompt="p", completion=c, ground_truth=g) for c, g in [("7", 7), ("8", 7), ("x", 7)]]
    out = score_completions(get_reward("arithmetic"), inputs)
    assert out == [1.0, 0.0, 0.0]
    assert all(type(v) is float for v in out)

    from posttrain.rewards.registry import FunctionReward

    half = FunctionReward(name="half", requires=frozenset({"prompt"}), fn=lambda s: np.float32(0.5))
    counted = FunctionReward(name="count", requires=frozenset({"prompt"}), fn=lambda s: len(s.completion))
    assert score_completions(half, inputs) == [0.5, 0.5, 0.5]
    assert score_completions(counted, inputs) == [1.0, 1.0, 1.0]


def test_uids_must_match_inputs() -> None:
    with pytest.raises(ValueError, match="2 uids for 1 inputs"):
        score_completions(get_reward("nonempty"), [RewardInput(prompt="p", completion="x")], uids=["a", "b"])
