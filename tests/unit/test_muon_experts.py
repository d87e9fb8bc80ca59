"""Muon on sparse-MoE expert stacks (``ExpertStackMuon`` inside ``MuonWithAuxAdamW``): Newton-Schulz
per expert, fused gate/up halves split, routers on AdamW, state round trips, and FSDP2 expert-axis
shards updated locally (two gloo ranks).

References: a hand-checked tiny stack (rank-1 halves, whose Newton-Schulz result is a known scalar
times the normalised row), and ``torch.optim.Muon`` run on every expert's gate, up and down matrix
as independent 2-D parameters (bitwise the same on CPU: the batched iteration is torch's, matrix
for matrix).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_on_two_ranks
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz

from posttrain.checkpoint import CheckpointWriter, TrainingState, capture_rng, load_checkpoint
from posttrain.policy.muon import (
    ExpertStack,
    MuonWithAuxAdamW,
    muon_param_split,
    split_params_for_muon,
    zeropower_via_newtonschulz_batched,
)

COEFFS = (3.4445, -4.7750, 2.0315)


class _Experts(nn.Module):
    """transformers' Qwen3-MoE expert layout, [E, 2I, H] gate rows then up rows, and [E, H, I]."""

    def __init__(self, experts: int, inter: int, hidden: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter))


def _stacks(module: _Experts) -> list[ExpertStack]:
    return [ExpertStack(module.gate_up_proj, 2), ExpertStack(module.down_proj, 1)]


# -- the batched iteration ------------------------------------------------------------------------


def test_torchs_newton_schulz_takes_2d_input_only() -> None:
    """Why the batched iteration exists: torch's own refuses a stack."""
    with pytest.raises(ValueError, match="2D matrix"):
        _zeropower_via_newtonschulz(torch.randn(2, 4, 6), COEFFS, 5, 1e-7)


@pytest.mark.parametrize("shape", [(3, 4, 6), (3, 6, 4), (2, 5, 5), (4, 16, 48)])
def test_batched_newton_schulz_is_torchs_matrix_for_matrix(shape: tuple[int, int, int]) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    out = zeropower_via_newtonschulz_batched(g, COEFFS, 5, 1e-7)
    ref = torch.stack([_zeropower_via_newtonschulz(m, COEFFS, 5, 1e-7) for m in g])
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


# -- a hand-checked tiny stack ------------------------------------------------------------------------


def _rank1_ns_factor(steps: int = 5) -> float:
    """A rank-1 matrix normalised by its Frobenius norm has the single singular value 1; the quintic
    maps it through ``s <- a s + b s^3 + c s^5``, so NS(g) = s_5 · g / |g|."""
    a, b, c = COEFFS
    s = 1.0
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s  # 0.69644 for 5 steps


def test_a_tiny_stack_by_hand() -> None:
    """E=2, I=1, H=2: every gate, up and down matrix is a single row (column), so each half's update
    is s_5 times that row normalised, scaled by torch's 0.2 · sqrt(max(1, 2)). Orthogonalising a
    fused [2I, H] slice as one matrix would mix gate and up (checked at the end)."""
    experts = _Experts(2, 1, 2)
    with torch.no_grad():
        experts.gate_up_proj.zero_()
        experts.down_proj.zero_()
    grad_gate_up = torch.tensor([[[3.0, 4.0], [0.0, 2.0]], [[1.0, 0.0], [-1.0, -1.0]]])  # [E, 2I, H]
    grad_down = torch.tensor([[[2.0], [0.0]], [[0.0], [-3.0]]])  # [E, H, I]
    experts.gate_up_proj.grad, experts.down_proj.grad = grad_gate_up.clone(), grad_down.clone()
    opt = MuonWithAuxAdamW([], [], _stacks(experts), lr=1.0, momentum=0.0)
    opt.step()
    scale = 0.2 * math.sqrt(2) * _rank1_ns_factor()
    r = 1 / math.sqrt(2)
    want_gate_up = -scale * torch.tensor([[[0.6, 0.8], [0.0, 1.0]], [[1.0, 0.0], [-r, -r]]])
    want_down = -scale * torch.tensor([[[1.0], [0.0]], [[0.0], [-1.0]]])
    # Newton-Schulz runs in bfloat16: 1-2% off the exact scalar (measured 1.8% at most here)
    torch.testing.assert_close(experts.gate_up_proj.detach(), want_gate_up, rtol=0.03, atol=1e-3)
    torch.testing.assert_close(experts.down_proj.detach(), want_down, rtol=0.03, atol=1e-3)
    # the fused slice as one 2 x 2 matrix: its up row is not parallel to [0, 1] at all
    fused = _zeropower_via_newtonschulz(grad_gate_up[0], COEFFS, 5, 1e-7).float()
    assert float(fused[1, 0].abs()) > 0.3


# -- against independent 2-D Muon per expert matrix -----------------------------------------------


def _per_matrix_params(experts: _Experts) -> list[nn.Parameter]:
    """Every expert's gate, up and down matrix as an independent 2-D parameter."""
    inter = experts.down_proj.shape[2]
    out = []
    for e in range(experts.gate_up_proj.shape[0]):
        out.append(nn.Parameter(experts.gate_up_proj.detach()[e, :inter].clone()))
        out.append(nn.Parameter(experts.gate_up_proj.detach()[e, inter:].clone()))
        out.append(nn.Parameter(experts.down_proj.detach()[e].clone()))
    return out


def _per_matrix_grads(gate_up: torch.Tensor, down: torch.Tensor) -> list[torch.Tensor]:
    inter = down.shape[2]
    return [m for e in range(gate_up.shape[0]) for m in (gate_up[e, :inter], gate_up[e, inter:], down[e])]


@pytest.mark.parametrize(
    "hyper",
    [
        {"lr": 0.02},
        {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "rms_match": 0.5},
        {"lr": 0.05, "nesterov": False, "ns_steps": 3},
    ],
)
def test_stacks_step_like_torch_muon_on_every_expert_matrix(hyper: dict) -> None:
    """Four steps on fixed gradients: the stacks (3 experts, I=4, H=6: tall gate/up halves, a wide
    down) equal torch.optim.Muon run on the 9 expert matrices one by one, weights and momentum."""
    torch.manual_seed(0)
    experts = _Experts(3, 4, 6)
    reference = _per_matrix_params(experts)
    g = torch.Generator().manual_seed(1)
    grads = [(torch.randn(3, 8, 6, generator=g), torch.randn(3, 6, 4, generator=g)) for _ in range(4)]
    opt = MuonWithAuxAdamW([], [], _stacks(experts), **hyper)
    ref_opt = MuonWithAuxAdamW(reference, [], **hyper)  # torch.optim.Muon on 2-D weights
    for gate_up, down in grads:
        experts.gate_up_proj.grad, experts.down_proj.grad = gate_up.clone(), down.clone()
        for p, grad in zip(reference, _per_matrix_grads(gate_up, down)):
            p.grad = grad.clone()
        opt.step()
        ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(_per_matrix_params(experts), reference))
    bufs = [opt.state[p]["momentum_buffer"] for p in (experts.gate_up_proj, experts.down_proj)]
    ref_bufs = [ref_opt.state[p]["momentum_buffer"] for p in reference]
    assert all(torch.equal(a, b) for a, b in zip(_per_matrix_grads(*bufs), ref_bufs))


def test_an_unsplit_gate_up_is_a_different_update() -> None:
    """The per-matrix reference has teeth: a stack declared with no halves (gate and up
    orthogonalised as one [2I, H] matrix) moves the gate/up weights far from it."""
    torch.manual_seed(0)
    split = _Experts(3, 4, 6)
    fused = copy.deepcopy(split)
    grad = torch.randn(3, 8, 6, generator=torch.Generator().manual_seed(1))
    start = split.gate_up_proj.detach().clone()
    for module, halves in ((split, 2), (fused, 1)):
        module.gate_up_proj.grad = grad.clone()
        MuonWithAuxAdamW([], [], [ExpertStack(module.gate_up_proj, halves)], lr=0.02).step()
    a, b = split.gate_up_proj.detach() - start, fused.gate_up_proj.detach() - start
    assert float((a - b).norm() / a.norm()) > 0.2


# -- a Qwen3-MoE policy -------------------------------------------------------------------------------


def _qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],  # one dense layer: its gate/up/down Linears are Muon's 2-D weights
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    nn.init.normal_(model.model.layers[0].mlp.gate.weight, std=0.5)  # transformers starts routers at zero
    return model


def test_the_split_of_a_qwen3_moe_keeps_routers_on_adamw() -> None:
    model = _qwen3_moe()
    split = muon_param_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    experts = [(names[id(s.param)], s.halves) for s in split.experts]
    assert experts == [("model.layers.0.mlp.experts.gate_up_proj", 2), ("model.layers.0.mlp.experts.down_proj", 1)]
    adamw = {names[id(p)] for p in split.adamw}
    assert "model.layers.0.mlp.gate.weight" in adamw  # the router
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= adamw
    muon = {names[id(p)] for p in split.muon}
    assert {f"model.layers.1.mlp.{k}_proj.weight" for k in ("gate", "up", "down")} <= muon
    assert all(".experts." not in n for n in muon | adamw) and "model.layers.0.mlp.gate.weight" not in muon
    assert len(split.muon) + len(split.adamw) + len(split.experts) == len(list(model.parameters()))
    # torch.optim.Muon's own split (2-D only) keeps the stacks on AdamW, as before
    assert {id(s.param) for s in split.experts} <= {id(p) for p in split_params_for_muon(model)[1]}


def _lm_step(model: nn.Module, seed: int) -> None:
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(seed))
    logits = model(ids).logits
    nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()


def _trio(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    from posttrain.config.loading import build_config
    from posttrain.policy.optim import build_optimizer

    model = _qwen3_moe()
    if seed:  # another init: everything must come from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1)
    overrides = ["rl.optimizer.name=muon", "rl.optimizer.lr=1e-2", "rl.optimizer.weight_decay=0.1"]
    cfg = build_config(None, [*overrides, "rl.optimizer.muon_rms_match=0.4"]).rl.optimizer
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def _train(model: nn.Module, opt: torch.optim.Optimizer, sched: object, seed: int) -> None:
    _lm_step(model, seed)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()  # type: ignore[attr-defined]


def test_build_optimizer_gives_the_stacks_the_muon_groups_settings() -> None:
    model, opt, _ = _trio(0)
    groups = opt.param_groups
    assert [g.get("expert_halves") for g in groups] == [None, None, 2, 1]  # AdamW, Muon, gate/up, down
    muon_group = groups[1]
    for group in groups[2:]:
        for key in ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "ns_coefficients", "adjust_lr_fn"):
            assert group[key] == muon_group[key], key
    assert muon_group["initial_lr"] == pytest.approx(1e-2 * 2)  # rms_match 0.4 = torch's 0.2 x 2
    assert muon_group["weight_decay"] == pytest.approx(0.1 / 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train(model, opt, _, seed=0)
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), name  # experts, routers and the rest all move


@pytest.mark.parametrize("fmt", ["consolidated", "dcp"])
def test_a_checkpoint_resumes_bitwise(tmp_path: Path, fmt: str) -> None:
    ref = _trio(0)
    for s in range(2):
        _train(*ref, seed=s)
    identity = {"data_seed": 0, "objective": {}, "ref_anchor": None, "n_mini": 1}
    state = TrainingState(2, 2, 0, {}, {}, capture_rng(), identity)
    with CheckpointWriter(tmp_path, fmt=fmt) as writer:  # type: ignore[arg-type]
        path = writer.save(2, *ref, state)
    resumed = _trio(seed=9)
    load_checkpoint(path, *resumed)
    assert resumed[1].state_dict()["param_groups"] == ref[1].state_dict()["param_groups"]
    for s in (2, 3):
        _train(*ref, seed=s)
        _train(*resumed, seed=s)
    for (name, p), q in zip(ref[0].named_parameters(), resumed[0].parameters()):
        assert torch.equal(p, q), name
    stack = ref[0].model.layers[0].mlp.experts.gate_up_proj
    twin = resumed[0].model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(ref[1].state[stack]["momentum_buffer"], resumed[1].state[twin]["momentum_buffer"])


def test_a_state_from_before_expert_muon_is_refused_by_name() -> None:
    """Before this change the stacks were on the auxiliary AdamW: two groups, no ``expert_halves``."""
    model, opt, _ = _trio(0)
    muon, adamw = split_params_for_muon(model)
    old_opt = MuonWithAuxAdamW(muon, adamw, lr=1e-2)
    with pytest.raises(ValueError, match=r"before declared expert stacks took per-expert Newton-Schulz.*export-hf"):
        opt.load_state_dict(old_opt.state_dict())
    assert opt.param_groups[2]["expert_halves"] == 2  # nothing of it was taken


def test_malformed_stacks_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\[E, halves \* m, n\]; got shape \(2, 3, 4\) with 2 halves"):
        MuonWithAuxAdamW([], [], [ExpertStack(nn.Parameter(torch.zeros(2, 3, 4)), 2)], lr=1.0)
    with pytest.raises(ValueError, match=r"got shape \(3, 4\)"):
        MuonWithAuxAdamW([], [], [ExpertStack(nn.Parameter(torch.zeros(3, 4)), 1)], lr=1.0)


# -- FSDP2: expert-axis shards, two gloo ranks ------------------------------------------------------

_SHARDED_SCRIPT = r"""
import datetime, sys, torch, torch.distributed as dist
from pathlib import Path
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from posttrain.checkpoint import CheckpointWriter, TrainingState, capture_rng, load_checkpoint
from posttrain.distributed.process_group import exit_rank_process
from posttrain.policy.muon import ExpertStack, MuonWithAuxAdamW

# a collective the expert step should not make would stop a lone rank here, not hang the test
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))

# 1. Expert-axis shards (4 experts: 2 per rank; 3 experts: 2 and 1) against one process: bitwise.
for experts in (4, 3):
    torch.manual_seed(experts)  # the same full tensors and gradients on every rank
    full = [torch.randn(experts, 8, 6), torch.randn(experts, 6, 4)]
    grads = [[torch.randn(t.shape) for t in full] for _ in range(3)]
    sharded = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in full]
    plain = [nn.Parameter(t.clone()) for t in full]
    opts = [
        MuonWithAuxAdamW([], [], [ExpertStack(ps[0], 2), ExpertStack(ps[1], 1)], lr=0.1, weight_decay=0.01)
        for ps in (sharded, plain)
    ]
    for step_grads in grads:
        for p, q, g in zip(sharded, plain, step_grads):
            p.grad, q.grad = distribute_tensor(g, mesh, [Shard(0)]), g.clone()
        for opt in opts:
            opt.step()
    for p, q in zip(sharded, plain):
        assert isinstance(p.data, DTensor) and p.placements == (Shard(0),)
        assert torch.equal(p.detach().full_tensor(), q.detach()), experts
        assert torch.equal(opts[0].state[p]["momentum_buffer"].full_tensor(), opts[1].state[q]["momentum_buffer"])
    # one more step on rank 0 alone: no collective, and its experts still match one process's
    if rank == 0:  # rank 0's shard holds the first experts (torch.chunk's split: 2 of 4, 2 of 3)
        for p, q, g in zip(sharded, plain, grads[0]):
            mine = g[: p.to_local().shape[0]].clone()
            p.grad = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False, shape=g.shape, stride=g.stride())
            q.grad = g.clone()
        for opt in opts:
            opt.step()
        for p, q in zip(sharded, plain):
            assert torch.equal(p.to_local(), q.detach()[: p.to_local().shape[0]])
    dist.barrier()

# 2. A stack sharded across one expert's rows is refused by name.
bad = nn.Parameter(distribute_tensor(torch.randn(2, 8, 6), mesh, [Shard(1)]))
bad.grad = distribute_tensor(torch.randn(2, 8, 6), mesh, [Shard(1)])
try:
    MuonWithAuxAdamW([], [], [ExpertStack(bad, 2)], lr=0.1).step()
    raise SystemExit("a Shard(1) stack was not refused")
except ValueError as exc:
    assert "each rank must hold whole experts" in str(exc) and "Shard(dim=1)" in str(exc), exc

# 3. posttrain's FSDP2 sharding of a Qwen3-MoE: fully_shard's default Shard(0) puts whole experts on
#    each rank; built by build_optimizer, a checkpoint in either format resumes bitwise.
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from posttrain.config.loading import build_config
from posttrain.distributed.fsdp import shard_policy
from posttrain.policy.optim import build_optimizer

def trio(seed):
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    for layer in model.model.layers:
        nn.init.normal_(layer.mlp.gate.weight, std=0.5)
    shard_policy(model, mesh)
    cfg = build_config(None, ["rl.optimizer.name=muon", "rl.optimizer.lr=1e-2", "rl.optimizer.weight_decay=0.1"])
    opt = build_optimizer(model, cfg.rl.optimizer, torch.device("cpu"))
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))

def train(model, opt, sched, seeds):
    for seed in seeds:
        ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(seed * 10 + rank))  # per-rank data
        logits = model(ids).logits
        nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        sched.step()

ref = trio(0)
stack = ref[0].model.layers[0].mlp.experts.gate_up_proj
assert stack.placements == (Shard(0),) and tuple(stack.to_local().shape) == (2, 32, 32), stack.placements
assert [g.get("expert_halves") for g in ref[1].param_groups] == [None, None, 2, 1]
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
for (name, a), b, c in zip(*(t[0].named_parameters() for t in (ref, *resumed))):
    b, c = b[1], c[1]
    assert torch.equal(a.full_tensor(), b.full_tensor()) and torch.equal(a.full_tensor(), c.full_tensor()), name
dist.barrier()  # no rank leaves while its peer is still in the last collective
dist.destroy_process_group()
print("OK")
exit_rank_process(0)  # not a normal exit: gloo's threads may abort a finalizing interpreter
"""


def test_expert_axis_shards_step_locally_and_resume_bitwise(tmp_path: Path) -> None:
    """Two gloo ranks: Shard(0) expert stacks get one process's update bitwise (also with uneven
    shards, and on one rank stepping alone: no collective); a Shard(1) stack is refused; posttrain's
    FSDP2 sharding of a Qwen3-MoE holds whole experts per rank and its Muon state resumes bitwise."""
    script = tmp_path / "sharded_expert_muon.py"
    script.write_text(_SHARDED_SCRIPT)
    run_on_two_ranks(script, str(tmp_path / "ckpt"), timeout_s=180)
