"""Muon: the Newton-Schulz iteration on known matrices, the update rule, the parameter split and
the optimizer state round trip."""

from __future__ import annotations

import copy
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from posttrain.policy.muon import MuonWithAuxAdamW, newton_schulz_orthogonalize, split_params_for_muon


def _known_matrix(m: int, n: int, singular_values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``U diag(S) V^T`` with seeded orthogonal U, V; returns it and its polar factor ``U V^T``."""
    g = torch.Generator().manual_seed(0)
    r = len(singular_values)
    U, _ = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))
    S = torch.tensor(singular_values, dtype=torch.float64)
    return (U * S) @ V.T, U @ V.T


@pytest.mark.parametrize(("m", "n"), [(8, 6), (6, 8), (7, 7)])
def test_newton_schulz_is_close_to_the_polar_factor(m: int, n: int) -> None:
    r = min(m, n)
    # Condition number 50: the quintic's 5 steps still lift the smallest singular value into the band.
    sv = torch.logspace(math.log10(10.0), math.log10(0.2), r).tolist()
    G, polar = _known_matrix(m, n, sv)
    ortho = newton_schulz_orthogonalize(G.float(), steps=5)
    assert ortho.shape == G.shape and ortho.dtype == torch.float32
    s = torch.linalg.svdvals(ortho.double())
    # The documented band of the (3.4445, -4.7750, 2.0315) quintic, with a little slack.
    assert s.min() > 0.65 and s.max() < 1.2, s
    # Same singular vectors as G: ortho = U f(S) V^T, so U^T ortho V is diagonal.
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    inner = U.T @ ortho.double() @ Vh.T
    off_diag = inner - torch.diag(torch.diagonal(inner))
    assert off_diag.abs().max() < 1e-4
    cos = (ortho.double() * polar).sum() / (ortho.double().norm() * polar.norm())
    assert cos > 0.97


def test_newton_schulz_is_scale_invariant_and_batched() -> None:
    g = torch.Generator().manual_seed(1)
    G = torch.randn(3, 5, 9, generator=g)
    out = newton_schulz_orthogonalize(G, steps=5)
    torch.testing.assert_close(out, newton_schulz_orthogonalize(1000.0 * G, steps=5), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[1], newton_schulz_orthogonalize(G[1], steps=5))


def test_newton_schulz_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz_orthogonalize(torch.ones(4), steps=5)
    with pytest.raises(ValueError, match="muon_ns_steps"):
        newton_schulz_orthogonalize(torch.ones(2, 2), steps=0)


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


def test_one_step_updates_both_groups_with_the_documented_rule() -> None:
    torch.manual_seed(0)
    model = _Tiny()
    before = copy.deepcopy(model)
    muon, adamw = split_params_for_muon(model)
    lr, rms_match = 0.01, 0.2
    opt = MuonWithAuxAdamW(muon, adamw, lr=lr, momentum=0.0, rms_match=rms_match, weight_decay=0.1)
    _loss_step(model, seed=0)
    grad = model.body.weight.grad.clone()
    opt.step()
    for p, q in zip(model.parameters(), before.parameters()):
        assert not torch.equal(p, q)
    # Muon, momentum 0: W <- W (1 - lr wd) - lr * rms_match * sqrt(max(m, n)) * NS(grad).
    expected = before.body.weight * (1 - lr * 0.1) - lr * rms_match * math.sqrt(12) * newton_schulz_orthogonalize(
        grad, 5
    )
    torch.testing.assert_close(model.body.weight, expected)
    delta_rms = (model.body.weight - before.body.weight * (1 - lr * 0.1)).pow(2).mean().sqrt()
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
    assert opt_clone.param_groups[0]["momentum"] == 0.9 and opt_clone.param_groups[0]["lr"] == 1e-2
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


_SHARDED_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from posttrain.distributed.process_group import exit_rank_process
from posttrain.policy.muon import MuonWithAuxAdamW

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)  # the same full tensors on every rank
w, b = torch.randn(5, 4), torch.randn(3)   # 5 rows over 2 ranks: an uneven shard
grads = [(torch.randn(5, 4), torch.randn(3)) for _ in range(2)]
p = nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
pb = nn.Parameter(distribute_tensor(b.clone(), mesh, [Shard(0)]))
q, qb = nn.Parameter(w.clone()), nn.Parameter(b.clone())
sharded = MuonWithAuxAdamW([p], [pb], lr=0.1, weight_decay=0.01)
plain = MuonWithAuxAdamW([q], [qb], lr=0.1, weight_decay=0.01)
for g, gb in grads:
    p.grad = distribute_tensor(g, mesh, [Shard(0)])
    pb.grad = distribute_tensor(gb, mesh, [Shard(0)])
    q.grad, qb.grad = g.clone(), gb.clone()
    sharded.step()
    plain.step()
assert isinstance(p.data, DTensor) and p.placements == (Shard(0),)
torch.testing.assert_close(p.full_tensor(), q.detach())
torch.testing.assert_close(pb.full_tensor(), qb.detach())
dist.barrier()  # no rank leaves while its peer is still in the last collective
dist.destroy_process_group()
print("OK")
exit_rank_process(0)  # not a normal exit: gloo's threads may abort a finalizing interpreter
"""


def test_dtensor_shards_match_the_unsharded_update(tmp_path: Path) -> None:
    """Two gloo ranks holding FSDP-style row shards get exactly the unsharded Muon / AdamW update."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "sharded_muon.py"
    script.write_text(_SHARDED_SCRIPT)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env["OMP_NUM_THREADS"] = "1"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0 and "OK" in out, out
