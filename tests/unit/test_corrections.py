"""TIS / MIS importance weights and score centering, alone and inside the objective."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posttrain.algorithm.corrections import (
    center_score,
    importance_weights,
    mis_weights,
    tis_weights,
)
from posttrain.algorithm.objectives import LossInputs, LossNormalizer, ObjectiveSpec, policy_loss

DT = torch.float64
LENGTHS = [5, 3, 0, 2]
T, K = 5, 3


def test_tis_and_mis_weights_hand_values() -> None:
    rho = torch.tensor([0.5, 1.5, 2.0, 3.0, float("inf")], dtype=DT)
    torch.testing.assert_close(tis_weights(rho, 2.0), torch.tensor([0.5, 1.5, 2.0, 2.0, 2.0], dtype=DT))
    torch.testing.assert_close(mis_weights(rho, 2.0), torch.tensor([0.5, 1.5, 2.0, 0.0, 0.0], dtype=DT))


def test_importance_weights_are_detached_ratios() -> None:
    old = torch.tensor([[-1.0, -2.0]], dtype=DT, requires_grad=True)
    q = torch.tensor([[-1.5, -1.0]], dtype=DT)
    rho = importance_weights(old, q)
    assert not rho.requires_grad
    torch.testing.assert_close(rho, torch.tensor([[math.exp(0.5), math.exp(-1.0)]], dtype=DT))


def test_center_score_hand_values() -> None:
    lp = torch.tensor([[-0.9]], dtype=DT, requires_grad=True)
    q = torch.tensor([0.5, 0.25, 0.05], dtype=DT)  # head mass 0.8
    p = torch.tensor([0.4, 0.4, 0.2], dtype=DT)
    hs = q.log().view(1, 1, K)
    hp = p.log().view(1, 1, K).clone().requires_grad_(True)
    out = center_score(lp, hs, hp)
    assert torch.equal(out.logprobs_BT, lp)  # value untouched
    out.logprobs_BT.sum().backward()
    qhat = q / q.sum()
    torch.testing.assert_close(lp.grad, torch.ones(1, 1, dtype=DT))
    torch.testing.assert_close(hp.grad, -qhat.view(1, 1, K))
    torch.testing.assert_close(out.head_mass_q_BT, torch.tensor([[0.8]], dtype=DT))
    kl = sum(float(qhat[k]) * math.log(float(qhat[k]) / float(p[k] / p.sum())) for k in range(K))
    torch.testing.assert_close(out.kl_head_BT, torch.tensor([[kl]], dtype=DT))


def test_center_score_ignores_padded_head_entries() -> None:
    lp = torch.tensor([[-0.5, -1.0]], dtype=DT, requires_grad=True)
    hs = torch.tensor([[[math.log(0.6), math.log(0.3), -math.inf], [math.log(0.9), 0.0, 0.0]]], dtype=DT)
    ids = torch.tensor([[[4, 7, -1], [2, -1, -1]]])
    hp = torch.tensor([[[-0.2, -2.0, float("nan")], [-0.1, float("-inf"), float("nan")]]], dtype=DT)
    hp.requires_grad_(True)
    out = center_score(lp, hs, hp, ids)
    out.logprobs_BT.sum().backward()
    assert hp.grad is not None and torch.isfinite(hp.grad).all()
    torch.testing.assert_close(hp.grad, -torch.tensor([[[2 / 3, 1 / 3, 0.0], [1.0, 0.0, 0.0]]], dtype=DT))
    torch.testing.assert_close(out.head_mass_q_BT, torch.tensor([[0.9, 0.9]], dtype=DT))
    assert torch.isfinite(out.kl_head_BT).all()


def test_centred_score_has_zero_mean_under_the_sampler() -> None:
    """With the full vocabulary as head, E_{y~q}[centred score] = 0 exactly, while the raw score's
    expectation under q is not 0 when pi != q (the mismatch drift centering removes)."""
    V = 5
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(V, generator=g, dtype=DT, requires_grad=True)
    q_logits = torch.randn(V, generator=g, dtype=DT)
    logq = torch.log_softmax(q_logits, dim=0)
    logpi = torch.log_softmax(theta, dim=0)
    lp = logpi.view(1, V)  # token t is vocabulary item t
    hs = logq.view(1, 1, V).expand(1, V, V)
    hp = logpi.view(1, 1, V).expand(1, V, V)
    centred = center_score(lp, hs, hp).logprobs_BT
    (grad_c,) = torch.autograd.grad((logq.exp() * centred[0]).sum(), theta, retain_graph=True)
    (grad_raw,) = torch.autograd.grad((logq.exp() * lp[0]).sum(), theta)
    torch.testing.assert_close(grad_c, torch.zeros(V, dtype=DT), atol=1e-12, rtol=0)
    assert grad_raw.abs().max() > 1e-2


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    mask = torch.zeros(B, T, dtype=DT)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1.0
    lp = -torch.rand(B, T, generator=g, dtype=DT) * 2.0 - 0.05
    old = lp + (torch.rand(B, T, generator=g, dtype=DT) - 0.5) * 0.6
    sampler = old + (torch.rand(B, T, generator=g, dtype=DT) - 0.5) * 2.5  # rho from ~0.3 to ~3.5
    ref = lp + (torch.rand(B, T, generator=g, dtype=DT) - 0.5)
    head_q = torch.softmax(torch.randn(B, T, K + 1, generator=g, dtype=DT), dim=-1)[..., :K]
    head_p = torch.softmax(torch.randn(B, T, K + 1, generator=g, dtype=DT), dim=-1)[..., :K]
    adv = torch.tensor([1.0, -0.8, 0.5, -0.3], dtype=DT)
    return {
        "lp": lp,
        "old": old,
        "sampler": sampler,
        "ref": ref,
        "mask": mask,
        "adv": adv,
        "hs": head_q.log(),
        "hp": head_p.log(),
        "ids": torch.arange(B * T * K).view(B, T, K),
    }


def _run(b: dict[str, torch.Tensor], spec: ObjectiveSpec, rows: slice = slice(None), *, kl: bool = False):
    lp = b["lp"][rows].clone().requires_grad_(True)
    hp = b["hp"][rows].clone().requires_grad_(True)
    inputs = LossInputs(
        logprobs_BT=lp,
        old_logprobs_BT=b["old"][rows],
        advantages_B=b["adv"][rows],
        mask_BT=b["mask"][rows],
        ref_logprobs_BT=b["ref"][rows] if kl else None,
        sampler_logprobs_BT=b["sampler"][rows],
        head_ids_BTK=b["ids"][rows],
        head_sampler_logprobs_BTK=b["hs"][rows],
        head_policy_logprobs_BTK=hp,
    )
    norm = LossNormalizer(num_tokens=b["mask"].sum(), num_seqs=float(sum(n > 0 for n in LENGTHS)))
    loss, stats = policy_loss(inputs, spec, norm)
    loss.backward()
    return loss.detach(), lp.grad, hp.grad, stats


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_score_centering_changes_only_the_gradient(level: str) -> None:
    b = _batch(seed=1)
    base = ObjectiveSpec(importance_sampling_level=level, kl_beta=0.2)  # type: ignore[arg-type]
    centred = dataclasses.replace(base, score_centering=True)
    loss0, lp_grad0, _, stats0 = _run(b, base, kl=True)
    loss1, lp_grad1, hp_grad1, stats1 = _run(b, centred, kl=True)
    assert torch.equal(loss0, loss1)
    m0, m1 = stats0.to_metrics(), stats1.to_metrics()
    for key in ("train/clip_frac", "train/kl_mean", "train/kl_max", "train/logprob_gap_mean"):
        assert torch.equal(m0[key], m1[key]), key
    # d loss / d logp is unchanged; each head entry receives -q̂_k times the SURROGATE's d/dlogp
    # only (the KL term is not centred).
    torch.testing.assert_close(lp_grad1, lp_grad0)
    _, surrogate_grad, _, _ = _run(b, dataclasses.replace(base, kl_beta=0.0))
    qhat = torch.softmax(b["hs"], dim=-1)
    torch.testing.assert_close(hp_grad1, -qhat * surrogate_grad[..., None])


def test_score_centering_metrics() -> None:
    b = _batch(seed=2)
    _, _, _, stats = _run(b, ObjectiveSpec(score_centering=True))
    m = b["mask"] > 0
    metrics = stats.to_metrics()
    mass = b["hs"].exp().sum(-1)[m]
    torch.testing.assert_close(metrics["train/sc_head_mass_q"], mass.mean())
    torch.testing.assert_close(metrics["train/sc_rho_max"], torch.exp(b["old"] - b["sampler"])[m].max())
    qhat = torch.softmax(b["hs"], dim=-1)
    phat = torch.softmax(b["hp"], dim=-1)
    kl = (qhat * (qhat.log() - phat.log())).sum(-1)[m]
    torch.testing.assert_close(metrics["train/sc_kl_head"], kl.mean())


@pytest.mark.parametrize("compose", ["tis", "mis"])
def test_tis_mis_weight_the_surrogate_not_the_kl(compose: str) -> None:
    b = _batch(seed=3)
    thr = 1.2
    spec = ObjectiveSpec(
        surrogate="legacy_pg",
        score_centering=True,
        sc_compose=compose,  # type: ignore[arg-type]
        is_threshold=thr,
    )
    m = b["mask"] > 0
    n = float(b["mask"].sum())
    rho = torch.exp(b["old"] - b["sampler"])
    w = rho.clamp(max=thr) if compose == "tis" else torch.where(rho <= thr, rho, torch.zeros_like(rho))
    assert (rho[m] > thr).any() and (rho[m] < thr).any()  # the data exercise the threshold
    A = b["adv"][:, None].expand_as(b["lp"])
    loss, lp_grad, _, stats = _run(b, spec)
    torch.testing.assert_close(loss, -(w * A * b["lp"])[m].sum() / n)
    torch.testing.assert_close(lp_grad[m], -(w * A)[m] / n)
    if compose == "mis":
        dropped = (rho[m] > thr).to(DT).mean()
        torch.testing.assert_close(stats.to_metrics()["train/sc_mis_drop_frac"], dropped)
    # Adding the KL term adds the plain, unweighted k3 mean.
    loss_kl, _, _, stats_kl = _run(b, dataclasses.replace(spec, kl_beta=0.5), kl=True)
    torch.testing.assert_close(loss_kl - loss, 0.5 * stats_kl.to_metrics()["train/kl_mean"])


@pytest.mark.parametrize("compose", ["none", "tis", "mis"])
def test_micro_batch_invariance_with_corrections(compose: str) -> None:
    b = _batch(seed=4)
    spec = ObjectiveSpec(
        importance_sampling_level="sequence",
        loss_type="seq-mean-token-mean",
        score_centering=True,
        sc_compose=compose,  # type: ignore[arg-type]
    )
    loss, lp_grad, hp_grad, stats = _run(b, spec)
    parts = [_run(b, spec, rows) for rows in (slice(0, 1), slice(1, 4))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], loss)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), lp_grad)
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]]), hp_grad)
    merged = parts[0][3].merge(parts[1][3]).to_metrics()
    for key, value in stats.to_metrics().items():
        torch.testing.assert_close(merged[key], value, msg=key)


def test_compose_needs_sampler_logprobs() -> None:
    b = _batch()
    inputs = LossInputs(
        logprobs_BT=b["lp"],
        old_logprobs_BT=b["old"],
        advantages_B=b["adv"],
        mask_BT=b["mask"],
        head_sampler_logprobs_BTK=b["hs"],
        head_policy_logprobs_BTK=b["hp"],
    )
    spec = ObjectiveSpec(score_centering=True, sc_compose="tis")
    with pytest.raises(ValueError, match="sampler_logprobs_BT"):
        policy_loss(inputs, spec, LossNormalizer(1.0, 1.0))
