"""Muon (``torch.optim.Muon`` behind ``MuonWithAuxAdamW``): one step on known matrices, the update
rule's scale, the parameter split, the optimizer state round trip and FSDP2 shards (two gloo ranks).
The comparison with the reference rule over ten steps is tests/unit/test_torch_muon.py."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_on_two_ranks
from torch import nn

from posttrain.policy.muon import MuonWithAuxAdamW, split_params_for_muon


def _known_matrix(m: int, n: int, singular_values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``U diag(S) V^T`` with seeded orthogonal U, V; returns it and its polar factor ``U V^T``."""
    g = torch.Generator().manual_seed(0)
    r = len(singular_values)
    U, _ = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))
    S = torch.tensor(singular_values, dtype=torch.float64)
    return (U * S) @ V.T, U @ V.T


@pytest.mark.parametrize(("m", "n"), [(8, 6), (6, 8), (7, 7)])
def test_one_step_is_the_scaled_orthogonalised_gradient(m: int, n: int) -> None:
    """Momentum 0, no decay: ``W1 = W0 - lr · rms_match · sqrt(max(m, n)) · NS(G)`` with NS(G) close
    to G's polar factor (torch's Newton-Schulz runs in bfloat16: the bounds allow for it)."""
    r = min(m, n)
    # Condition number 50: the quintic's 5 steps still lift the smallest singular value into the band.
    sv = torch.logspace(math.log10(10.0), math.log10(0.2), r).tolist()
    G, polar = _known_matrix(m, n, sv)
    w = nn.Parameter(torch.zeros(m, n))
    lr, rms_match = 0.5, 0.3
    opt = MuonWithAuxAdamW([w], [], lr=lr, momentum=0.0, rms_match=rms_match)
    w.grad = G.float()
    opt.step()
    ortho = (-w.detach() / (lr * rms_match * math.sqrt(max(m, n)))).double()
    s = torch.linalg.svdvals(ortho)
    # The documented band of the (3.4445, -4.7750, 2.0315) quintic, with a little slack
    # (measured in bf16: [0.68, 1.14]).
    assert s.min() > 0.65 and s.max() < 1.2, s
    # Same singular vectors as G: ortho = U f(S) V^T, so U^T ortho V is diagonal (to bf16 rounding).
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    inner = U.T @ ortho @ Vh.T
    off_diag = inner - torch.diag(torch.diagonal(inner))
    assert off_diag.abs().max() < 3e-2
    cos = (ortho * polar).sum() / (ortho.norm() * polar.norm())
    assert cos > 0.97


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.body = nn.Linear(8, 12)
        self.body2 = nn.Linear(12, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 11, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.body2(torch.relu(self.body(self.embed(ids))))))


def _loss_step(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (4, 5), generator=g)
    model.zero_grad()
    logits = model(ids)
    nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()


def test_split_on_a_plain_module() -> None:
    model = _Tiny()
    muon, adamw = split_params_for_muon(model)
    assert [id(p) for p in muon] == [id(model.body.weight), id(model.body2.weight)]
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in adamw) == sorted(
        ["embed.weight", "body.bias", "norm.weight", "norm.bias", "lm_head.weight"]
    )


@pytest.mark.parametrize("tied", [True, False])
def test_split_on_a_tiny_llama(tied: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg)
    muon, adamw = split_params_for_muon(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for p in muon}
    adamw_names = {names[id(p)] for p in adamw}
    projections = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    projections += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert muon_names == {f"model.layers.{i}.{p}.weight" for i in range(2) for p in projections}
    assert "model.embed_tokens.weight" in adamw_names
    assert "model.norm.weight" in adamw_names
    assert {f"model.layers.{i}.input_layernorm.weight" for i in range(2)} <= adamw_names
    lm_head = model.get_output_embeddings().weight
    assert all(p is not lm_head for p in muon)
    assert any(p is lm_head for p in adamw)
    # Every trainable parameter exactly once.
    assert len(muon) + len(adamw) == len(list(model.parameters()))


def test_split_keeps_routers_and_fused_matrices_on_adamw() -> None:
    model = nn.ModuleDict(
        {
            "gate": nn.Linear(8, 4),
            "qkv_proj": nn.Linear(8, 24),
            "gate_proj": nn.Linear(8, 16),
            "conv": nn.Conv1d(2, 2, 3),
        }
    )
    muon, _ = split_params_for_muon(model)
    assert [id(p) for p in muon] == [id(model["gate_proj"].weight)]


def test_one_step_moves_both_groups_at_the_documented_scale() -> None:
    torch.manual_seed(0)
    model = _Tiny()
    before = copy.deepcopy(model)
    muon, adamw = split_params_for_muon(model)
    lr, rms_match, wd = 0.01, 0.2, 0.1
    opt = MuonWithAuxAdamW(muon, adamw, lr=lr, momentum=0.0, rms_match=rms_match, weight_decay=wd)
    _loss_step(model, seed=0)
    opt.step()
    for p, q in zip(model.parameters(), before.parameters()):
        assert not torch.equal(p, q)
    # Muon, momentum 0: W <- W (1 - lr wd) - lr * rms_match * sqrt(max(m, n)) * NS(grad), an update
    # of RMS about lr * rms_match (NS(grad)'s singular values lie in [0.68, 1.14]).
    for w, w0 in ((model.body.weight, before.body.weight), (model.body2.weight, before.body2.weight)):
        delta_rms = (w - w0 * (1 - lr * wd)).pow(2).mean().sqrt()
        assert 0.6 * lr * rms_match < delta_rms < 1.2 * lr * rms_match


def test_adamw_group_matches_torch_adamw() -> None:
    torch.manual_seed(1)
    model = _Tiny()
    reference = copy.deepcopy(model)
    muon, adamw = split_params_for_muon(model)
    muon_ref, adamw_ref = split_params_for_muon(reference)
    kwargs = {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.05}
    opt = MuonWithAuxAdamW(muon, adamw, **kwargs)  # type: ignore[arg-type]
    opt_ref = torch.optim.AdamW(adamw_ref, **kwargs)  # type: ignore[arg-type]
    # The Muon half of the reference model moves the same way, so the gradients stay equal.
    opt_ref_muon = MuonWithAuxAdamW(muon_ref, [], **kwargs)  # type: ignore[arg-type]
    for step in range(3):
        _loss_step(model, seed=step)
        _loss_step(reference, seed=step)
        opt.step()
        opt_ref.step()
        opt_ref_muon.step()
    for p, q in zip(adamw, adamw_ref):
        torch.testing.assert_close(p, q)


def test_state_dict_round_trip() -> None:
    torch.manual_seed(2)
    model = _Tiny()
    opt = MuonWithAuxAdamW(*split_params_for_muon(model), lr=1e-2, momentum=0.9)
    for step in range(2):
        _loss_step(model, seed=step)
        opt.step()
    clone = copy.deepcopy(model)
    opt_clone = MuonWithAuxAdamW(*split_params_for_muon(clone), lr=5.0, momentum=0.1)
    opt_clone.load_state_dict(copy.deepcopy(opt.state_dict()))
    muon_group = opt_clone.param_groups[1]  # AdamW's group comes first
    assert muon_group["momentum"] == 0.9 and muon_group["lr"] == 1e-2
    for m in (model, clone):
        _loss_step(m, seed=7)
    opt.step()
    opt_clone.step()
    for p, q in zip(model.parameters(), clone.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_muon_rejects_non_matrices() -> None:
    with pytest.raises(ValueError, match="2-D"):
        MuonWithAuxAdamW([nn.Parameter(torch.zeros(3))], [], lr=1.0)
    with pytest.raises(ValueError, match="no parameters"):
        MuonWithAuxAdamW([], [], lr=1.0)
    for steps in (0, 100):  # torch.optim.Muon itself would only say so at the first step
        with pytest.raises(ValueError, match=rf"rl\.optimizer\.muon_ns_steps must be in \[1, 99\], got {steps}"):
            MuonWithAuxAdamW([nn.Parameter(torch.zeros(2, 2))], [], lr=1.0, ns_steps=steps)


_SHARDED_SCRIPT = r"""
import sys, torch, torch.distributed as dist
from pathlib import Path
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from posttrain.checkpoint import CheckpointWriter, TrainingState, capture_rng, load_checkpoint
from posttrain.distributed.process_group import exit_rank_process
from posttrain.policy.muon import MuonWithAuxAdamW, split_params_for_muon

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))

# 1. Row shards (5 rows over 2 ranks: uneven) of a tall and a wide matrix and a bias, against one process.
torch.manual_seed(0)  # the same full tensors on every rank
full = [torch.randn(5, 4), torch.randn(4, 6), torch.randn(3)]
grads = [[torch.randn(t.shape) for t in full] for _ in range(3)]
sharded = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in full]
plain = [nn.Parameter(t.clone()) for t in full]
opts = [MuonWithAuxAdamW(ps[:2], ps[2:], lr=0.1, weight_decay=0.01, fused=True) for ps in (sharded, plain)]
for step_grads in grads:
    for p, q, g in zip(sharded, plain, step_grads):
        p.grad, q.grad = distribute_tensor(g, mesh, [Shard(0)]), g.clone()
    for opt in opts:
        opt.step()
assert all(isinstance(p.data, DTensor) and p.placements == (Shard(0),) for p in sharded)
for p, q, t in zip(sharded[:2], plain[:2], full):
    moved, ref = p.detach().full_tensor() - t, q.detach() - t
    rel = float((moved - ref).norm() / ref.norm())
    assert rel < MUON_RTOL, rel
assert torch.equal(sharded[2].detach().full_tensor(), plain[2].detach())

# 2. An FSDP2 model: a checkpoint in either format resumes bitwise.
def trio(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))
    fully_shard(model, mesh=mesh)
    opt = MuonWithAuxAdamW(*split_params_for_muon(model), lr=1e-2, weight_decay=0.1, fused=True)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))

def train(model, opt, sched, seeds):
    for seed in seeds:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed * 10 + rank))  # per-rank data
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()

ref = trio(0)
assert [len(group["params"]) for group in ref[1].param_groups] == [2, 2]  # biases, then weights
train(*ref, range(2))
identity = {"data_seed": 0, "objective": {}, "ref_anchor": None, "n_mini": 1}
state = TrainingState(2, 2, 0, {}, {}, capture_rng(), identity)
resumed = []
for fmt in ("dcp", "consolidated"):
    with CheckpointWriter(Path(sys.argv[1]) / fmt, fmt=fmt) as writer:
        path = writer.save(2, *ref, state)
    resumed.append(trio(5))
    load_checkpoint(path, *resumed[-1])
for trio_ in (ref, *resumed):
    train(*trio_, range(2, 4))
for a, b, c in zip(*(t[0].parameters() for t in (ref, *resumed))):
    assert torch.equal(a.full_tensor(), b.full_tensor()) and torch.equal(a.full_tensor(), c.full_tensor())
dist.barrier()  # no rank leaves while its peer is still in the last collective
dist.destroy_process_group()
print("OK")
exit_rank_process(0)  # not a normal exit: gloo's threads may abort a finalizing interpreter
"""

# Sharded against one process: torch.optim.Muon runs on the DTensors through DTensor's dispatch,
# each rank computing its part of every product of the bf16 Newton-Schulz iteration. A tall matrix
# (iterated transposed, so column-sharded) sums bf16 partial products across ranks, rounded
# differently from one process's sums: measured 1.8% (relative norm of the displacement after 3
# steps) for the 5 x 4 matrix, 0 for the row-sharded wide one; the bias's fused AdamW is bitwise equal.
SHARDED_MUON_RTOL = 0.05


def test_fsdp2_shards_match_the_unsharded_update_and_resume_bitwise(tmp_path: Path) -> None:
    """Two gloo ranks: DTensor row shards get the unsharded Muon / AdamW update (to bf16 rounding);
    an FSDP2 model's Muon state resumes bitwise from a DCP and from a consolidated checkpoint."""
    script = tmp_path / "sharded_muon.py"
    script.write_text(f"MUON_RTOL = {SHARDED_MUON_RTOL}\n" + _SHARDED_SCRIPT)
    run_on_two_ranks(script, str(tmp_path / "ckpt"), timeout_s=120)
