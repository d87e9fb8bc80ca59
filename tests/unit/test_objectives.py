"""The GRPO objective family against hand values and an independent loop-by-loop implementation.

The reference below is written the "paper way": a Python loop over sequences and tokens, each
sequence's loss weighted by what its reduction gives it, and (for GSPO) the sequence-level
objective ``min(s_i A, clip(s_i) A)`` differentiated through ``s_i = exp(mean log-ratio)`` rather
than through the token-level form the implementation uses.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posttrain.algorithm.kl import k3_kl
from posttrain.algorithm.objectives import (
    LossInputs,
    LossNormalizer,
    LossStats,
    ObjectiveSpec,
    policy_loss,
    reduce_loss,
)

LOSS_TYPES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-fixed"]
DT = torch.float64
LENGTHS = [5, 2, 0, 6, 1, 3]  # uneven, one fully masked sequence
T = 7


def _batch(seed: int = 0, spread: float = 0.6) -> dict[str, torch.Tensor]:
    """Six sequences with uneven lengths, garbage (inf / NaN) on padding, mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    mask = torch.zeros(B, T, dtype=DT)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1.0
    lp = -torch.rand(B, T, generator=g, dtype=DT) * 2.0 - 0.05
    old = lp + (torch.rand(B, T, generator=g, dtype=DT) - 0.5) * 2.0 * spread
    ref = lp + (torch.rand(B, T, generator=g, dtype=DT) - 0.5) * 2.0
    sampler = old + (torch.rand(B, T, generator=g, dtype=DT) - 0.5) * 0.4
    pad = mask == 0
    lp[pad], old[pad], ref[pad], sampler[pad] = float("nan"), float("-inf"), float("inf"), float("nan")
    adv = torch.tensor([1.0, -0.7, 0.4, -1.3, 0.9, -0.2], dtype=DT)
    return {"lp": lp, "old": old, "ref": ref, "sampler": sampler, "mask": mask, "adv": adv}


def _norm_for(mask: torch.Tensor) -> LossNormalizer:
    return LossNormalizer(num_tokens=mask.sum(), num_seqs=(mask.sum(1) > 0).sum().to(DT))


def _inputs(b: dict[str, torch.Tensor], rows: slice = slice(None), **extra: torch.Tensor) -> LossInputs:
    lp = b["lp"][rows].clone().requires_grad_(True)
    return LossInputs(
        logprobs_BT=lp,
        old_logprobs_BT=b["old"][rows],
        advantages_B=b["adv"][rows],
        mask_BT=b["mask"][rows],
        **extra,
    )


def _clip(x: torch.Tensor, spec: ObjectiveSpec) -> torch.Tensor:
    return torch.clamp(x, 1.0 - spec.epsilon_low, 1.0 + spec.epsilon_high)


def _reference(b: dict[str, torch.Tensor], spec: ObjectiveSpec) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Loss, d loss / d logprobs and the clipped-token count, by loops."""
    lp = b["lp"].clone().requires_grad_(True)
    mask, adv = b["mask"], b["adv"]
    n_tok = float(mask.sum())
    n_seq = float((mask.sum(1) > 0).sum())
    total = torch.zeros((), dtype=DT)
    clipped = 0
    for i in range(mask.shape[0]):
        toks = [t for t in range(T) if mask[i, t] > 0]
        if not toks:
            continue
        n, A = len(toks), adv[i]
        per_tok_w = {
            "token-mean": 1.0 / n_tok,
            "seq-mean-token-mean": 1.0 / (n * n_seq),
            "seq-mean-token-sum-fixed": 1.0 / (spec.max_tokens * n_seq),
        }[spec.loss_type]
        if spec.kl_beta > 0:
            for t in toks:
                z = b["ref"][i, t] - lp[i, t]
                total = total + per_tok_w * spec.kl_beta * (torch.exp(z) - z - 1.0)
        if spec.surrogate == "legacy_pg":
            for t in toks:
                total = total + per_tok_w * (-A * lp[i, t])
        elif spec.importance_sampling_level == "sequence":
            s = torch.exp(sum(lp[i, t] - b["old"][i, t] for t in toks) / n)
            a, c = s * A, _clip(s, spec) * A
            # Every token carries the sequence loss: n tokens of weight per_tok_w each. As a
            # function of s its gradient is s*A/n per token, the GSPO sequence-level gradient.
            total = total + per_tok_w * n * (-(c if c < a else a))
            clipped += n if c < a else 0
        else:
            for t in toks:
                r = torch.exp(lp[i, t] - b["old"][i, t])
                a, c = r * A, _clip(r, spec) * A
                total = total + per_tok_w * (-(c if c < a else a))
                clipped += int(c < a)
    total.backward()
    assert lp.grad is not None
    return total.detach(), torch.nan_to_num(lp.grad * mask), clipped


def _run(b: dict[str, torch.Tensor], spec: ObjectiveSpec, norm: LossNormalizer, rows: slice = slice(None), **kw):
    inputs = _inputs(b, rows, **kw)
    loss, stats = policy_loss(inputs, spec, norm)
    loss.backward()
    return loss.detach(), inputs.logprobs_BT.grad, stats


# -------------------------------------------------------------------------------------------- hand


def test_token_clipped_hand_values_both_signs() -> None:
    # ratios 1.5 (above 1.2), 0.5 (below 0.8), 1.0
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.0]], dtype=DT))
    old = torch.zeros(1, 3, dtype=DT)
    mask = torch.ones(1, 3, dtype=DT)
    norm = LossNormalizer(num_tokens=3.0, num_seqs=1.0)
    spec = ObjectiveSpec()
    cases = {
        # A=+1: 1.5 clipped to 1.2 (no grad); 0.5 keeps the unclipped 0.5; 1.0 unchanged.
        1.0: ((-1.2 - 0.5 - 1.0) / 3, [0.0, -0.5 / 3, -1.0 / 3]),
        # A=-1: 1.5 keeps the unclipped -1.5; 0.5 clipped to 0.8 (no grad).
        -1.0: ((1.5 + 0.8 + 1.0) / 3, [1.5 / 3, 0.0, 1.0 / 3]),
    }
    for A, (value, grad) in cases.items():
        x = lp.clone().requires_grad_(True)
        loss, stats = policy_loss(LossInputs(x, old, torch.tensor([A], dtype=DT), mask), spec, norm)
        loss.backward()
        torch.testing.assert_close(loss, torch.tensor(value, dtype=DT))
        torch.testing.assert_close(x.grad, torch.tensor([grad], dtype=DT))
        assert float(stats.clipped_tokens) == 1.0
        torch.testing.assert_close(stats.to_metrics()["train/clip_frac"], torch.tensor(1.0 / 3, dtype=DT))


def test_asymmetric_clip_bounds() -> None:
    spec = ObjectiveSpec(epsilon_low=0.1, epsilon_high=0.5)
    lp = torch.log(torch.tensor([[1.4, 1.6, 0.85, 0.95]], dtype=DT)).requires_grad_(True)
    old, mask = torch.zeros(1, 4, dtype=DT), torch.ones(1, 4, dtype=DT)
    # A > 0: only 1.6 > 1.5 clips. A < 0: only 0.85 < 0.9 clips.
    for A, n_clipped in ((1.0, 1.0), (-1.0, 1.0)):
        _, stats = policy_loss(LossInputs(lp, old, torch.tensor([A], dtype=DT), mask), spec, LossNormalizer(4.0, 1.0))
        assert float(stats.clipped_tokens) == n_clipped


def test_sequence_ratio_hand_values_both_bounds() -> None:
    # Sequence 0: log-ratios [log 2, 0] -> s = sqrt(2) (above 1.2). Sequence 1: [log 0.25, 0, pad]
    # -> s = 0.5 (below 0.8).
    lp = torch.tensor([[math.log(2.0), 0.0, 0.0], [math.log(0.25), 0.0, 9.0]], dtype=DT)
    old = torch.zeros(2, 3, dtype=DT)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=DT)
    spec = ObjectiveSpec(importance_sampling_level="sequence", loss_type="seq-mean-token-mean")
    norm = LossNormalizer(num_tokens=4.0, num_seqs=2.0)
    s0, s1 = math.sqrt(2.0), 0.5
    cases = {
        # A=+1: seq 0 clipped at 1.2 (no grad); seq 1 unclipped: value -0.5, grad s1*A/2 per token.
        1.0: ((-1.2 - 0.5) / 2, [[0.0, 0.0, 0.0], [-s1 / 4, -s1 / 4, 0.0]], 2.0),
        # A=-1: seq 0 unclipped: +sqrt(2), grad s0/2 per token; seq 1 clipped at 0.8.
        -1.0: ((s0 + 0.8) / 2, [[s0 / 4, s0 / 4, 0.0], [0.0, 0.0, 0.0]], 2.0),
    }
    for A, (value, grad, n_clipped) in cases.items():
        x = lp.clone().requires_grad_(True)
        loss, stats = policy_loss(LossInputs(x, old, torch.tensor([A, A], dtype=DT), mask), spec, norm)
        loss.backward()
        torch.testing.assert_close(loss, torch.tensor(value, dtype=DT))
        torch.testing.assert_close(x.grad, torch.tensor(grad, dtype=DT))
        assert float(stats.clipped_tokens) == n_clipped


def test_legacy_pg_hand_values() -> None:
    lp = torch.tensor([[-1.0, -2.0], [-0.5, 7.0]], dtype=DT, requires_grad=True)
    old = torch.full((2, 2), -9.0, dtype=DT)  # ignored: no ratio
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=DT)
    adv = torch.tensor([2.0, -1.0], dtype=DT)
    loss, stats = policy_loss(
        LossInputs(lp, old, adv, mask), ObjectiveSpec(surrogate="legacy_pg"), LossNormalizer(3.0, 2.0)
    )
    loss.backward()
    # -(2*(-1) + 2*(-2) + (-1)*(-0.5)) / 3
    torch.testing.assert_close(loss, torch.tensor(5.5 / 3, dtype=DT))
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0 / 3, -2.0 / 3], [1.0 / 3, 0.0]], dtype=DT))
    assert float(stats.clipped_tokens) == 0.0
    assert float(stats.to_metrics()["train/clip_frac"]) == 0.0


def test_reduction_hand_values_and_padding_garbage() -> None:
    nan, inf = float("nan"), float("inf")
    values = torch.tensor([[1.0, 2.0, 3.0, nan], [4.0, inf, nan, nan], [nan, nan, nan, nan]], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=DT)
    norm = LossNormalizer(num_tokens=4.0, num_seqs=2.0)
    assert float(reduce_loss(values, mask, "token-mean", norm)) == pytest.approx(10.0 / 4)
    assert float(reduce_loss(values, mask, "seq-mean-token-mean", norm)) == pytest.approx((2.0 + 4.0) / 2)
    got = reduce_loss(values, mask, "seq-mean-token-sum-fixed", norm, max_tokens=4)
    assert float(got) == pytest.approx((6.0 / 4 + 4.0 / 4) / 2)
    with pytest.raises(ValueError, match=r"rl\.loss_type"):
        reduce_loss(values, mask, "mean", norm)


def test_zero_normaliser_gives_zero_not_nan() -> None:
    b = _batch()
    b["mask"] = torch.zeros_like(b["mask"])
    for loss_type in LOSS_TYPES:
        loss, grad, _ = _run(b, ObjectiveSpec(loss_type=loss_type), LossNormalizer(0.0, 0.0))
        assert float(loss) == 0.0
        assert torch.equal(grad, torch.zeros_like(grad))


# --------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(
    ("surrogate", "level"), [("clipped", "token"), ("clipped", "sequence"), ("legacy_pg", "token")]
)
def test_matches_reference(loss_type: str, level: str, surrogate: str) -> None:
    b = _batch(seed=1)
    spec = ObjectiveSpec(
        surrogate=surrogate,  # type: ignore[arg-type]
        importance_sampling_level=level,  # type: ignore[arg-type]
        loss_type=loss_type,  # type: ignore[arg-type]
        epsilon_low=0.15,
        epsilon_high=0.25,
        max_tokens=T,
    )
    loss, grad, stats = _run(b, spec, _norm_for(b["mask"]))
    ref_loss, ref_grad, ref_clipped = _reference(b, spec)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert float(stats.clipped_tokens) == ref_clipped
    if surrogate == "clipped":
        assert ref_clipped > 0  # the data exercise the clip
    assert torch.isfinite(grad).all()
    assert float(stats.loss_tokens) == sum(LENGTHS)
    assert float(stats.seqs) == 5.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_kl_term_matches_reference(loss_type: str) -> None:
    b = _batch(seed=2)
    spec = ObjectiveSpec(loss_type=loss_type, kl_beta=0.3, max_tokens=T)  # type: ignore[arg-type]
    loss, grad, stats = _run(b, spec, _norm_for(b["mask"]), ref_logprobs_BT=b["ref"])
    ref_loss, ref_grad, _ = _reference(b, spec)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    m = b["mask"] > 0
    kl = k3_kl(b["lp"][m], b["ref"][m])
    metrics = stats.to_metrics()
    torch.testing.assert_close(metrics["train/kl_mean"], kl.mean())
    torch.testing.assert_close(metrics["train/kl_max"], kl.max())


def test_kl_coeff_clamp_changes_only_the_gradient() -> None:
    b = _batch(seed=3)
    b["ref"] = torch.where(b["mask"] > 0, b["lp"] + 4.0, b["ref"])  # z = 4 nats on every token
    norm = _norm_for(b["mask"])
    exact = ObjectiveSpec(surrogate="legacy_pg", kl_beta=1.0)
    clamped = dataclasses.replace(exact, kl_coeff_clamp=1.0)
    b["adv"] = torch.zeros_like(b["adv"])  # isolate the KL term
    loss_e, grad_e, stats_e = _run(b, exact, norm, ref_logprobs_BT=b["ref"])
    loss_c, grad_c, stats_c = _run(b, clamped, norm, ref_logprobs_BT=b["ref"])
    assert torch.equal(loss_e, loss_c)
    assert torch.equal(stats_e.to_metrics()["train/kl_mean"], stats_c.to_metrics()["train/kl_mean"])
    m = b["mask"] > 0
    torch.testing.assert_close(grad_e[m], torch.full_like(grad_e[m], (1 - math.exp(4.0)) / float(norm.num_tokens)))
    torch.testing.assert_close(grad_c[m], torch.full_like(grad_c[m], (1 - math.exp(1.0)) / float(norm.num_tokens)))


def test_kl_stats_without_kl_in_the_loss() -> None:
    b = _batch()
    norm = _norm_for(b["mask"])
    loss_a, grad_a, stats = _run(b, ObjectiveSpec(), norm, ref_logprobs_BT=b["ref"])
    loss_b, grad_b, plain = _run(b, ObjectiveSpec(), norm)
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert "train/kl_mean" in stats.to_metrics()
    assert "train/kl_mean" not in plain.to_metrics()


# ---------------------------------------------------------------------------------- properties


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clip_frac_exactly_zero_on_policy(loss_type: str, level: str) -> None:
    b = _batch(seed=4)
    b["old"] = b["lp"].clone()
    for eps in (0.0, 0.2):
        spec = ObjectiveSpec(
            importance_sampling_level=level,  # type: ignore[arg-type]
            loss_type=loss_type,  # type: ignore[arg-type]
            epsilon_low=eps,
            epsilon_high=eps,
        )
        _, _, stats = _run(b, spec, _norm_for(b["mask"]))
        assert stats.to_metrics()["train/clip_frac"].item() == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batch_invariance(loss_type: str, level: str) -> None:
    b = _batch(seed=5)
    spec = ObjectiveSpec(
        importance_sampling_level=level,  # type: ignore[arg-type]
        loss_type=loss_type,  # type: ignore[arg-type]
        kl_beta=0.05,
        max_tokens=T,
    )
    norm = _norm_for(b["mask"])
    full_loss, full_grad, full_stats = _run(b, spec, norm, ref_logprobs_BT=b["ref"], sampler_logprobs_BT=b["sampler"])
    merged: LossStats | None = None
    loss_sum = torch.zeros((), dtype=DT)
    grads = []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        loss, grad, stats = _run(
            b, spec, norm, rows, ref_logprobs_BT=b["ref"][rows], sampler_logprobs_BT=b["sampler"][rows]
        )
        loss_sum = loss_sum + loss
        grads.append(grad)
        merged = stats if merged is None else merged.merge(stats)
    assert merged is not None
    torch.testing.assert_close(loss_sum, full_loss)
    torch.testing.assert_close(torch.cat(grads), full_grad)
    for key, value in full_stats.to_metrics().items():
        torch.testing.assert_close(merged.to_metrics()[key], value, msg=key)
    assert float(merged.loss_tokens) == float(norm.num_tokens)
    assert float(merged.seqs) == float(norm.num_seqs)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sum_fixed_does_not_depend_on_padding(level: str) -> None:
    b = _batch(seed=6)
    spec = ObjectiveSpec(
        importance_sampling_level=level,  # type: ignore[arg-type]
        loss_type="seq-mean-token-sum-fixed",
        max_tokens=16,
    )
    norm = _norm_for(b["mask"])
    loss, grad, _ = _run(b, spec, norm)
    extra = 5
    padded = {
        k: torch.cat([v, torch.full((v.shape[0], extra), 3.0, dtype=DT)], dim=1) if v.dim() == 2 else v
        for k, v in b.items()
    }
    padded["mask"][:, T:] = 0.0
    loss_p, grad_p, _ = _run(padded, spec, norm)
    torch.testing.assert_close(loss_p, loss)
    torch.testing.assert_close(grad_p[:, :T], grad)
    assert torch.equal(grad_p[:, T:], torch.zeros(len(LENGTHS), extra, dtype=DT))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fully_masked_sequence_contributes_nothing(loss_type: str, level: str) -> None:
    b = _batch(seed=7)
    spec = ObjectiveSpec(importance_sampling_level=level, loss_type=loss_type, max_tokens=T)  # type: ignore[arg-type]
    # Mask sequence 0 entirely (a truncated completion under rl.mask_truncated_completions).
    masked = dict(b)
    masked["mask"] = b["mask"].clone()
    masked["mask"][0] = 0.0
    norm = _norm_for(masked["mask"])  # the caller's divisors exclude it
    loss, grad, stats = _run(masked, spec, norm, ref_logprobs_BT=b["ref"])
    assert torch.equal(grad[0], torch.zeros(T, dtype=DT))
    assert torch.isfinite(grad).all()
    rest = {k: v[1:] for k, v in b.items()}
    loss_r, grad_r, _ = _run(rest, spec, norm, ref_logprobs_BT=b["ref"][1:])
    torch.testing.assert_close(loss, loss_r)
    torch.testing.assert_close(grad[1:], grad_r)
    assert float(stats.seqs) == 4.0


# -------------------------------------------------------------------------------------- stats


def test_logprob_gap_stats() -> None:
    b = _batch(seed=8)
    _, _, stats = _run(b, ObjectiveSpec(), _norm_for(b["mask"]), sampler_logprobs_BT=b["sampler"])
    m = b["mask"] > 0
    gap = (b["lp"][m] - b["sampler"][m]).abs()
    metrics = stats.to_metrics()
    torch.testing.assert_close(metrics["train/logprob_gap_mean"], gap.mean())
    torch.testing.assert_close(metrics["train/logprob_gap_max"], gap.max())
    assert not any(t.requires_grad for t in metrics.values())


def test_logprob_gap_stats_over_the_recorded_rows_only() -> None:
    """``rollout.sampler_logprobs_samples``: rows whose sampler logprobs were not recorded (zeros
    there) count in neither the gap's sum, its token count nor its max; the loss is untouched."""
    b = _batch(seed=8)
    recorded_B = torch.tensor([True, False, True, False, False, True])
    sampler = b["sampler"].clone()
    sampler[~recorded_B] = 0.0  # what the trainer pads unrecorded rows with
    loss_all, grad_all, _ = _run(b, ObjectiveSpec(), _norm_for(b["mask"]), sampler_logprobs_BT=b["sampler"])
    loss, grad, stats = _run(
        b, ObjectiveSpec(), _norm_for(b["mask"]), sampler_logprobs_BT=sampler, sampler_recorded_B=recorded_B
    )
    m = (b["mask"] > 0) & recorded_B[:, None]
    gap = (b["lp"][m] - b["sampler"][m]).abs()
    metrics = stats.to_metrics()
    assert float(stats.gap_tokens) == float(m.sum()) == float(sum(n for n, r in zip(LENGTHS, recorded_B) if r))
    torch.testing.assert_close(metrics["train/logprob_gap_mean"], gap.mean())
    torch.testing.assert_close(metrics["train/logprob_gap_max"], gap.max())
    torch.testing.assert_close(loss, loss_all)
    torch.testing.assert_close(grad, grad_all)
    none = torch.zeros(len(LENGTHS), dtype=torch.bool)  # a micro-batch without a recorded row
    _, _, empty = _run(b, ObjectiveSpec(), _norm_for(b["mask"]), sampler_logprobs_BT=sampler, sampler_recorded_B=none)
    assert float(empty.gap_tokens) == 0.0 and float(empty.logprob_gap_max) == 0.0
    with pytest.raises(ValueError, match="some rows were not recorded"):
        policy_loss(
            _inputs(b, slice(None), sampler_logprobs_BT=sampler, sampler_recorded_B=recorded_B),
            ObjectiveSpec(score_centering=True),
            _norm_for(b["mask"]),
        )


def test_stats_merge_sums_and_maxes() -> None:
    one = torch.ones((), dtype=DT)
    a = LossStats(loss_sum=one, loss_tokens=4 * one, clipped_tokens=one, seqs=one, kl_sum=one, kl_max=3 * one)
    b = LossStats(
        loss_sum=2 * one,
        loss_tokens=6 * one,
        clipped_tokens=0 * one,
        seqs=2 * one,
        kl_sum=4 * one,
        kl_max=one,
    )
    merged = a.merge(b)
    assert float(merged.loss_sum) == 3.0 and float(merged.seqs) == 3.0
    m = merged.to_metrics()
    assert float(m["train/clip_frac"]) == pytest.approx(0.1)
    assert float(m["train/kl_mean"]) == pytest.approx(0.5)
    assert float(m["train/kl_max"]) == 3.0
    assert "train/logprob_gap_mean" not in m


# ------------------------------------------------------------------------------------- errors


def test_spec_validation_names_the_fields() -> None:
    with pytest.raises(ValueError, match=r"rl\.loss_type='mean'"):
        ObjectiveSpec(loss_type="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rl\.epsilon_low=1\.5") as info:
        ObjectiveSpec(epsilon_low=1.5, max_tokens=0)
    assert "rollout.max_tokens=0" in str(info.value)
    with pytest.raises(ValueError, match=r"rl\.score_centering\.enabled=true"):
        ObjectiveSpec(sc_compose="tis")
    with pytest.raises(ValueError, match=r"needs rl\.grpo_surrogate=clipped"):
        ObjectiveSpec(surrogate="legacy_pg", importance_sampling_level="sequence")


def test_missing_inputs_are_named() -> None:
    b = _batch()
    norm = _norm_for(b["mask"])
    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        policy_loss(_inputs(b), ObjectiveSpec(kl_beta=0.1), norm)
    with pytest.raises(ValueError, match="advantages_B"):
        policy_loss(dataclasses.replace(_inputs(b), advantages_B=b["adv"][:2]), ObjectiveSpec(), norm)
    with pytest.raises(ValueError, match="head_sampler_logprobs_BTK"):
        policy_loss(_inputs(b), ObjectiveSpec(score_centering=True), norm)
