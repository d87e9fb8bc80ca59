"""Direct on-policy distillation: payload validation, the (K+1)-way partition, the generalized JSD and
the masked loss, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithm.distillation import (
    RESIDUAL_FLOOR,
    TeacherPayloadError,
    direct_distillation_loss,
    direct_opd_loss,
    generalized_jsd,
    topk_partition_logprobs,
    validate_teacher_topk,
)
from posttrain.algorithm.objectives import LossNormalizer
from posttrain.errors import PosttrainError

F64 = torch.float64
LN = math.log

# The running 3-category example: teacher T = [0.5, 0.3, 0.2], student S = [0.2, 0.5, 0.3].
T3 = [0.5, 0.3, 0.2]
S3 = [0.2, 0.5, 0.3]
KL_T_S = 0.5 * LN(0.5 / 0.2) + 0.3 * LN(0.3 / 0.5) + 0.2 * LN(0.2 / 0.3)
KL_S_T = 0.2 * LN(0.2 / 0.5) + 0.5 * LN(0.5 / 0.3) + 0.3 * LN(0.3 / 0.2)
# beta = 0.5: M = [0.35, 0.40, 0.25]
JSD_HALF = 0.5 * (0.5 * LN(0.5 / 0.35) + 0.3 * LN(0.3 / 0.40) + 0.2 * LN(0.2 / 0.25)) + 0.5 * (
    0.2 * LN(0.2 / 0.35) + 0.5 * LN(0.5 / 0.40) + 0.3 * LN(0.3 / 0.25)
)
# beta = 0.25: M = 0.25 T + 0.75 S = [0.275, 0.45, 0.275]
JSD_QUARTER = 0.25 * (0.5 * LN(0.5 / 0.275) + 0.3 * LN(0.3 / 0.45) + 0.2 * LN(0.2 / 0.275)) + 0.75 * (
    0.2 * LN(0.2 / 0.275) + 0.5 * LN(0.5 / 0.45) + 0.3 * LN(0.3 / 0.275)
)


def _log(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=F64).log()


# ----------------------------------------------------------------------------------------------
# Partition
# ----------------------------------------------------------------------------------------------


def test_partition_appends_the_residual_mass() -> None:
    out = topk_partition_logprobs(_log([0.5, 0.3])[None])
    torch.testing.assert_close(out, _log([0.5, 0.3, 0.2])[None])


def test_partition_of_a_tiny_support_and_of_an_empty_one() -> None:
    out = topk_partition_logprobs(torch.tensor([[LN(1e-3), -math.inf]], dtype=F64))
    torch.testing.assert_close(out.exp(), torch.tensor([[1e-3, 0.0, 0.999]], dtype=F64))
    empty = topk_partition_logprobs(torch.zeros(2, 0, dtype=F64))
    torch.testing.assert_close(empty, torch.zeros(2, 1, dtype=F64))


def test_full_support_is_floored_and_renormalised() -> None:
    out = topk_partition_logprobs(_log([0.5, 0.5])[None])
    total = 1.0 + RESIDUAL_FLOOR
    expected = torch.tensor([[0.5 / total, 0.5 / total, RESIDUAL_FLOOR / total]], dtype=F64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.exp(), expected)


def test_slightly_overfull_support_becomes_a_distribution() -> None:
    # Mass 1.00005 (within the validation tolerance): floored residual, then everything renormalised.
    out = topk_partition_logprobs(_log([0.60005, 0.4])[None])
    total = 1.00005 + RESIDUAL_FLOOR
    torch.testing.assert_close(
        out.exp(), torch.tensor([[0.60005 / total, 0.4 / total, RESIDUAL_FLOOR / total]], dtype=F64)
    )


def test_partition_of_bfloat16_is_computed_in_float32() -> None:
    support = torch.tensor([[LN(0.5), LN(0.25)]], dtype=torch.bfloat16)
    out = topk_partition_logprobs(support)
    assert out.dtype == torch.float32
    # The residual of the bf16-rounded support, to float32 precision (bf16 arithmetic would be off
    # by ~1e-3 here).
    p = support.double().exp()[0]
    expected = torch.tensor([[float(p[0]), float(p[1]), 1.0 - float(p.sum())]])
    torch.testing.assert_close(out.exp(), expected, rtol=1e-5, atol=1e-6)


def test_partition_gradient_of_the_residual() -> None:
    # d log(1 - p0 - p1) / d log p_k = -p_k / r: with p = [0.5, 0.3], r = 0.2 -> [-2.5, -1.5].
    lp = _log([0.5, 0.3]).requires_grad_(True)
    topk_partition_logprobs(lp[None])[0, 2].backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, torch.tensor([-2.5, -1.5], dtype=F64))
    # A support entry passes through unchanged (the renormalisation has no gradient on a proper row).
    lp2 = _log([0.5, 0.3]).requires_grad_(True)
    topk_partition_logprobs(lp2[None])[0, 0].backward()
    assert lp2.grad is not None
    torch.testing.assert_close(lp2.grad, torch.tensor([1.0, 0.0], dtype=F64))


# ----------------------------------------------------------------------------------------------
# Generalized JSD
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("beta", "expected"), [(0.0, KL_T_S), (1.0, KL_S_T), (0.5, JSD_HALF), (0.25, JSD_QUARTER)])
def test_jsd_hand_values(beta: float, expected: float) -> None:
    out = generalized_jsd(_log(T3)[None], _log(S3)[None], beta)
    torch.testing.assert_close(out, torch.tensor([expected], dtype=F64))


def test_jsd_hand_value_magnitudes() -> None:
    # The closed forms above, evaluated, so a sign or weighting slip in them would show.
    # 0.458145 - 0.153248 - 0.081093; -0.183258 + 0.255413 + 0.121640; 0.5 * (0.047404 + 0.054346).
    assert abs(KL_T_S - 0.223804) < 2e-6
    assert abs(KL_S_T - 0.193795) < 2e-6
    assert abs(JSD_HALF - 0.050875) < 2e-6


def test_jsd_beta_limits() -> None:
    t, s = _log(T3)[None], _log(S3)[None]
    small = 1e-4
    low = generalized_jsd(t, s, small) / small
    high = generalized_jsd(t, s, 1.0 - small) / small
    torch.testing.assert_close(low, torch.tensor([KL_T_S], dtype=F64), rtol=2e-4, atol=0.0)
    torch.testing.assert_close(high, torch.tensor([KL_S_T], dtype=F64), rtol=2e-4, atol=0.0)
    # The raw generalized JSD vanishes at both ends: the endpoints are the rescaled limits.
    assert float(generalized_jsd(t, s, small)) < 1e-4


def test_jsd_symmetry_and_identity() -> None:
    t, s = _log(T3)[None], _log(S3)[None]
    torch.testing.assert_close(generalized_jsd(t, s, 0.3), generalized_jsd(s, t, 0.7))
    for beta in (0.0, 0.4, 1.0):
        torch.testing.assert_close(generalized_jsd(t, t, beta), torch.zeros(1, dtype=F64))


def test_zero_mass_categories_contribute_nothing_with_finite_gradient() -> None:
    teacher = torch.tensor([[LN(0.5), LN(0.5), -math.inf]], dtype=F64)
    # Forward KL: the teacher's zero-mass category adds 0; KL = 2 * 0.5 ln(0.5 / 0.25) = ln 2.
    student = _log([0.25, 0.25, 0.5])[None].requires_grad_(True)
    out = generalized_jsd(teacher, student, 0.0)
    torch.testing.assert_close(out, torch.tensor([LN(2.0)], dtype=F64))
    out.sum().backward()
    assert student.grad is not None
    torch.testing.assert_close(student.grad, torch.tensor([[-0.5, -0.5, 0.0]], dtype=F64))

    # beta = 0.5: M = [0.375, 0.375, 0.25].
    expected = 0.5 * (2 * 0.5 * LN(0.5 / 0.375)) + 0.5 * (2 * 0.25 * LN(0.25 / 0.375) + 0.5 * LN(0.5 / 0.25))
    student = _log([0.25, 0.25, 0.5])[None].requires_grad_(True)
    out = generalized_jsd(teacher, student, 0.5)
    torch.testing.assert_close(out, torch.tensor([expected], dtype=F64))
    out.sum().backward()
    assert student.grad is not None and torch.isfinite(student.grad).all()

    # Reverse KL with a student zero: KL(S || T) = 2 * 0.5 ln(0.5 / 0.25) = ln 2, finite gradient.
    student0 = torch.tensor([[LN(0.5), LN(0.5), -math.inf]], dtype=F64, requires_grad=True)
    out = generalized_jsd(_log([0.25, 0.25, 0.5])[None], student0, 1.0)
    torch.testing.assert_close(out, torch.tensor([LN(2.0)], dtype=F64))
    out.sum().backward()
    assert student0.grad is not None and torch.isfinite(student0.grad).all()

    # A category empty on both sides, at an interior beta: value unchanged, gradient finite.
    both = torch.tensor([[LN(0.5), LN(0.5), -math.inf]], dtype=F64, requires_grad=True)
    out = generalized_jsd(teacher, both, 0.3)
    torch.testing.assert_close(out, torch.zeros(1, dtype=F64))
    out.sum().backward()
    assert both.grad is not None and torch.isfinite(both.grad).all()


def test_gradient_reaches_only_the_student() -> None:
    teacher = _log(T3)[None].requires_grad_(True)
    student = _log(S3)[None].requires_grad_(True)
    generalized_jsd(teacher, student, 0.5).sum().backward()
    assert teacher.grad is None
    assert student.grad is not None and student.grad.abs().sum() > 0


def test_beta_outside_unit_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="jsd_beta"):
        generalized_jsd(_log(T3)[None], _log(S3)[None], 1.5)


# ----------------------------------------------------------------------------------------------
# Payload validation
# ----------------------------------------------------------------------------------------------


def _payload() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[[3, 7], [1, 2]], [[0, 9], [4, 5]]])
    logprobs = torch.log(torch.tensor([[[0.5, 0.3], [0.6, 0.1]], [[0.9, 0.05], [0.2, 0.2]]]))
    return ids, logprobs


def test_a_valid_payload_passes() -> None:
    ids, logprobs = _payload()
    validate_teacher_topk(ids, logprobs, vocab_size=10)
    # Support mass 1.00005 is rounding, within the default tolerance.
    validate_teacher_topk(torch.tensor([[0, 1]]), torch.tensor([[LN(0.60005), LN(0.4)]]), vocab_size=2)


@pytest.mark.parametrize(
    ("ids_at", "logprobs_at", "what"),
    [
        ([4, 4], None, "duplicate ids"),
        ([4, -1], None, "ids outside [0, 10)"),
        ([4, 10], None, "ids outside [0, 10)"),
        (None, [math.nan, -1.0], "non-finite logprobs"),
        (None, [math.inf, -1.0], "non-finite logprobs"),
        (None, [-math.inf, -1.0], "non-finite logprobs"),
        (None, [LN(0.7), LN(0.4)], "support mass above 1 + 0.0001"),
    ],
)
def test_each_invalid_payload_names_the_position_and_the_problem(
    ids_at: list[int] | None, logprobs_at: list[float] | None, what: str
) -> None:
    ids, logprobs = _payload()
    if ids_at is not None:
        ids[1, 0] = torch.tensor(ids_at)
    if logprobs_at is not None:
        logprobs[1, 0] = torch.tensor(logprobs_at)
    with pytest.raises(TeacherPayloadError) as info:
        validate_teacher_topk(ids, logprobs, vocab_size=10)
    message = str(info.value)
    assert "position (1, 0)" in message
    assert what in message
    assert "first of 1 bad position" in message
    assert isinstance(info.value, PosttrainError)


def test_the_first_bad_position_is_named_with_all_its_problems() -> None:
    ids, logprobs = _payload()
    ids[0, 1] = torch.tensor([2, 2])
    logprobs[0, 1] = torch.tensor([math.nan, -1.0])
    ids[1, 1] = torch.tensor([11, 4])
    with pytest.raises(TeacherPayloadError, match=r"position \(0, 1\) \(first of 2 bad") as info:
        validate_teacher_topk(ids, logprobs, vocab_size=10)
    assert "duplicate ids" in str(info.value) and "non-finite logprobs" in str(info.value)


def test_a_flat_payload_names_a_plain_index() -> None:
    ids = torch.tensor([[0, 1], [2, 2]])
    with pytest.raises(TeacherPayloadError, match=r"at position 1 \(first of 1 bad position\(s\)\): duplicate ids"):
        validate_teacher_topk(ids, torch.full((2, 2), LN(0.25)), vocab_size=3)


def test_padding_is_not_validated() -> None:
    ids, logprobs = _payload()
    ids[1, 1] = torch.tensor([-1, -1])
    logprobs[1, 1] = torch.tensor([math.nan, math.inf])
    valid = torch.tensor([[True, True], [True, False]])
    validate_teacher_topk(ids, logprobs, vocab_size=10, valid_N=valid)
    with pytest.raises(TeacherPayloadError, match=r"position \(1, 1\)"):
        validate_teacher_topk(ids, logprobs, vocab_size=10)


def test_malformed_payload_shapes_and_dtypes() -> None:
    ids, logprobs = _payload()
    with pytest.raises(TeacherPayloadError, match="same shape"):
        validate_teacher_topk(ids[..., :1], logprobs, vocab_size=10)
    with pytest.raises(TeacherPayloadError, match="integers"):
        validate_teacher_topk(ids.float(), logprobs, vocab_size=10)
    with pytest.raises(TeacherPayloadError, match="valid_N"):
        validate_teacher_topk(ids, logprobs, vocab_size=10, valid_N=torch.ones(2, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------
# The loss
# ----------------------------------------------------------------------------------------------


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B=1, T=3, K=2. Token 0: teacher [0.5, 0.3] (residual 0.2), student [0.2, 0.5] (residual 0.3):
    the running example. Token 1: identical teacher and student. Token 2: padding full of garbage."""
    teacher = torch.tensor([[[LN(0.5), LN(0.3)], [LN(0.6), LN(0.1)], [math.nan, math.inf]]], dtype=F64)
    student = torch.tensor([[[LN(0.2), LN(0.5)], [LN(0.6), LN(0.1)], [-math.inf, math.nan]]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    return teacher, student.requires_grad_(True), mask


@pytest.mark.parametrize(("beta", "expected"), [(0.0, KL_T_S), (1.0, KL_S_T), (0.5, JSD_HALF)])
def test_direct_opd_loss_per_token(beta: float, expected: float) -> None:
    teacher, student, mask = _batch()
    div = direct_opd_loss(student, teacher, mask, beta)
    torch.testing.assert_close(div, torch.tensor([[expected, 0.0, 0.0]], dtype=F64))


def test_forward_kl_gradient_through_the_partition() -> None:
    # loss = -Σ_c t_c log s_c + const with log s_res = log(1 - p0 - p1), so
    # d/d log p_j = -t_j + t_res * p_j / s_res: [-0.5 + 0.2*0.2/0.3, -0.3 + 0.2*0.5/0.3].
    teacher, student, mask = _batch()
    direct_opd_loss(student, teacher, mask, 0.0).sum().backward()
    assert student.grad is not None
    expected = torch.tensor([[[-0.5 + 0.04 / 0.3, -0.3 + 0.1 / 0.3], [0.0, 0.0], [0.0, 0.0]]], dtype=F64)
    torch.testing.assert_close(student.grad, expected)


def test_direct_distillation_loss_reduction_stats_and_masked_garbage() -> None:
    teacher, student, mask = _batch()
    teacher.requires_grad_(True)
    loss, stats = direct_distillation_loss(
        student, teacher, mask, 1.0, "token-mean", LossNormalizer(num_tokens=4.0, num_seqs=1.0)
    )
    # Two loss tokens in this micro-batch, four in the step: (KL_S_T + 0) / 4.
    torch.testing.assert_close(loss, torch.tensor(KL_S_T / 4.0, dtype=F64))
    loss.backward()
    assert student.grad is not None and torch.isfinite(student.grad).all()
    assert torch.equal(student.grad[0, 2], torch.zeros(2, dtype=F64))
    assert teacher.grad is None
    expected = {
        "loss_sum": KL_S_T / 4.0,
        "divergence_sum": KL_S_T,
        "tokens": 2.0,
        "seqs": 1.0,
        "teacher_residual_mass_sum": 0.2 + 0.3,
        "student_residual_mass_sum": 0.3 + 0.3,
    }
    assert set(stats) == set(expected)
    for name, value in expected.items():
        assert not stats[name].requires_grad
        torch.testing.assert_close(stats[name], torch.tensor(value, dtype=F64), msg=name)


def test_seq_mean_token_mean_and_an_empty_mask() -> None:
    teacher, student, mask = _batch()
    loss, _ = direct_distillation_loss(
        student, teacher, mask, 0.0, "seq-mean-token-mean", LossNormalizer(num_tokens=2.0, num_seqs=2.0)
    )
    torch.testing.assert_close(loss, torch.tensor(KL_T_S / 2.0 / 2.0, dtype=F64))
    empty = torch.zeros_like(mask)
    loss, stats = direct_distillation_loss(
        student, teacher, empty, 0.5, "token-mean", LossNormalizer(num_tokens=0.0, num_seqs=0.0)
    )
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(stats["tokens"]) == 0.0
    assert student.grad is not None and torch.equal(student.grad, torch.zeros_like(student.grad))


def test_float32_and_bfloat16_inputs_compute_in_float32() -> None:
    teacher, student, mask = _batch()
    div = direct_opd_loss(student.detach().to(torch.bfloat16), teacher.float(), mask, 1.0)
    assert div.dtype == torch.float32
    torch.testing.assert_close(div[0, 0].double(), torch.tensor(KL_S_T, dtype=F64), rtol=2e-2, atol=0.0)


def test_loss_shape_mismatch_is_refused() -> None:
    teacher, student, mask = _batch()
    with pytest.raises(ValueError, match=r"\[B, T, K\]"):
        direct_opd_loss(student, teacher[..., :1], mask, 1.0)
