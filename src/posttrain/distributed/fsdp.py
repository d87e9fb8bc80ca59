"""FSDP2 policy ranks: the device mesh, the sharded model, DP-global reductions, full weights.

The policy trains as ``POLICY_RANKS`` processes over one data-parallel device mesh, ``dp_shard``
ranks wide (FSDP: parameters, gradients and optimizer state sharded) and ``dp_replicate`` deep
(HSDP: whole shard groups replicated). Every rank is one *data cell*: it trains on its own slice of
the collected batch, and the update must equal the one a single process makes on the whole batch.
Three things make it so:

* the loss normaliser (token and sequence counts of an optimizer step) is all-reduced before any
  micro-batch runs, so each rank's loss is its exact share of the global loss (``DataParallel``);
* gradients are SUMMED across ranks, not averaged: FSDP2 divides by the data-parallel size by
  default, which on top of a global normaliser would shrink the step by ``1 / POLICY_RANKS``
  (``shard_policy`` sets the divide factor to 1);
* every decision taken from a reduction (clip coefficient, zero-gradient skip, non-finite abort)
  comes from a value that is identical on every rank, so no rank steps while another does not.

In one process the policy's parameters are plain tensors and ``DataParallel.of`` returns
``SingleProcess``: the same reductions, each of them the identity, so the trainer has one path.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from posttrain.algorithm.objectives import LossNormalizer, LossStats
from posttrain.distributed.passes import Pass, agreed_passes, pass_kinds, split_passes
from posttrain.errors import ConfigError, PosttrainError, TrainingError
from posttrain.models.structure import split_body_and_head


def build_dp_mesh(dp_replicate: int = 1, dp_shard: int | None = None) -> DeviceMesh:
    """The data-parallel mesh over every rank of the default group: 1-D ``(dp_shard,)`` for FSDP, or
    2-D ``(dp_replicate, dp_shard)`` for HSDP (shard inside a group, replicate across groups).

    ``dp_shard=None`` takes ``world_size // dp_replicate``. The product must be the world size.
    """
    world = dist.get_world_size()
    shard = dp_shard if dp_shard is not None else world // max(dp_replicate, 1)
    if dp_replicate < 1 or shard < 1 or dp_replicate * shard != world:
        raise ConfigError(
            [
                f"grid.dp_replicate={dp_replicate} x grid.dp_shard={shard} must equal the {world} policy ranks "
                "(POLICY_RANKS of grid.shapes.policy)"
            ]
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if dp_replicate == 1:
        return init_device_mesh(device_type, (shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device_type, (dp_replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))


# -- sharding -----------------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated decoder blocks of a Hugging Face causal LM (``model.get_decoder().layers``)."""
    body, _ = split_body_and_head(model)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise PosttrainError(
            f"{type(model).__name__}: its decoder has no `layers` ModuleList, so posttrain cannot shard it "
            "per decoder layer with FSDP2"
        )
    return layers


def shard_policy(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None) -> DataParallel:
    """Apply FSDP2 in place: one unit per decoder layer, one for the two vocabulary matrices (input
    embedding and LM head, tied or not), and the decoder body as the root unit (its final norm).

    The trainer runs the decoder body, then the LM head chunk by chunk outside any module's
    ``forward`` (``policy.logprobs``). FSDP2 needs one root module whose forward runs first: the
    body. The head joins the embedding in one unit (``fully_shard([embedding, head])``), which is
    how FSDP2 shares a tied weight and lets a module be called on its own after the root forward.

    ``reshard_after_forward``: True for the decoder layers (ZeRO-3: a layer's full weights exist
    only while it computes; backward re-gathers them); False for the vocabulary unit (resharding
    would re-gather the embedding/LM-head matrix for every logprob chunk) and for the root (needed
    again at once when backward starts).

    Gradients are reduce-scattered with SUM (divide factor 1): the trainer's loss on each rank is
    already that rank's share of the globally normalised loss, so the sum is the full-batch gradient.
    """
    layers = decoder_layers(model)
    body, head = split_body_and_head(model)
    get_embedding = getattr(model, "get_input_embeddings", None)
    embedding = get_embedding() if callable(get_embedding) else None
    if not isinstance(embedding, nn.Module):
        raise PosttrainError(
            f"{type(model).__name__} has no get_input_embeddings(); posttrain shards *ForCausalLM models"
        )
    policy = mp_policy or MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard([embedding, head], mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    visual_owner = getattr(model, "model", None)
    visual = getattr(visual_owner, "visual", None)
    if isinstance(visual, nn.Module) and isinstance(visual_owner, nn.Module):
        # A vision-language policy (Qwen3-VL): the trainer runs the multimodal body (model.model:
        # vision tower, merger, language model; policy/images.py) first, so that is the root unit,
        # and the tower is one unit of its own.
        fully_shard(visual, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
        body = visual_owner
    fully_shard(body, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        # A parameter outside every unit would keep a rank-local gradient: the ranks would diverge.
        raise PosttrainError(f"FSDP2 left parameters unsharded (outside the decoder body and LM head): {plain[:4]}")
    dp = DataParallel.of(model)
    if not isinstance(dp, DataParallel):  # unreachable after the check above; narrows the type
        raise PosttrainError("sharding produced no DTensor parameters")
    return dp


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def first_nonfinite(named: list[tuple[str, Tensor | None]]) -> str:
    """Name of the first tensor with a non-finite entry in THIS rank's shard ('?' if none here).

    Local on purpose: a full check would be a collective per tensor, and ranks stop at different ones.
    """
    for name, t in named:
        if t is not None and not bool(torch.isfinite(_local(t)).all()):
            return name
    return "?"


def largest_entry(named: list[tuple[str, Tensor | None]]) -> str:
    """Name of the tensor with the largest absolute entry in THIS rank's shard ('?' if none here): where
    to look when a norm overflows although every entry is finite."""
    best, name = -1.0, "?"
    for n, t in named:
        if t is not None and t.numel():
            peak = float(_local(t).detach().abs().max())
            if peak > best:
                best, name = peak, n
    return name


# -- DP-global reductions -----------------------------------------------------------------------


def clip_to_total_norm(params: list[nn.Parameter], max_norm: float, total: Tensor) -> float:
    """Scale the gradients of ``params`` as ``clip_grad_norm_`` does, given their ``total`` norm, and
    return the norm. The scaling pass is skipped when torch's clamped coefficient is exactly 1 (the
    usual step: multiplying by 1 changes no bit), which saves one read and write of every gradient;
    a non-finite norm leaves the gradients as they are, so the caller can name the parameter."""
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))  # torch's own coefficient, in its dtype
    if coef < 1.0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return float(total)


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """The policy's data-parallel mesh, and the reductions the trainer needs over it.

    Every method is a collective: all ranks call it in the same order (the trainer does, because
    every rank runs the same number of mini- and micro-batches; ``check_cells`` enforces it).
    """

    mesh: DeviceMesh

    @staticmethod
    def of(model: nn.Module) -> DataParallel | SingleProcess:
        """The mesh ``model`` is sharded over; ``SingleProcess`` for a plain (unsharded) model."""
        first = next(model.parameters(), None)
        return DataParallel(first.device_mesh) if isinstance(first, DTensor) else SingleProcess()

    @property
    def size(self) -> int:
        """Policy ranks (data cells) in the mesh."""
        return self.mesh.size()

    @property
    def cell(self) -> int:
        """This rank's data-cell index: its row-major position in the mesh."""
        coord = self.mesh.get_coordinate()
        if coord is None:
            raise PosttrainError("this process is not part of the policy's device mesh")
        index = 0
        for dim, c in enumerate(coord):
            index = index * self.mesh.size(dim) + c
        return index

    def passes(self, micro_batches: list[list[int]], free_B: Tensor | None, unit: int = 1) -> list[Pass]:
        """The mini-batch's passes, the same on every rank: FSDP's gathers and gradient reductions
        pair up across ranks, and each rank's rows tie differently. One all-reduce of each
        micro-batch's kind decides (``distributed/passes.py``; ``unit``: the rows a wholly free
        micro-batch runs with autograd to split alike); every rank holds as many micro-batches
        (``check_cells``)."""
        if free_B is None:
            return [(rows, True) for rows in micro_batches]
        kinds = pass_kinds(micro_batches, free_B, unit).to(self.mesh.device_type)
        return agreed_passes(micro_batches, free_B, self.all_reduce_(kinds, dist.ReduceOp.MIN).cpu(), unit)

    def all_reduce_(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        """In-place all-reduce over every rank of the mesh (one collective per mesh dimension)."""
        for dim in range(self.mesh.ndim):
            dist.all_reduce(tensor, op=op, group=self.mesh.get_group(dim))
        return tensor

    def _comm(self, values: list[Tensor], dtype: torch.dtype) -> Tensor:
        return torch.stack([v.detach().reshape(()).to(dtype) for v in values]).to(self.mesh.device_type)

    def check_cells(self, rows: int) -> None:
        """Every rank must hold the same number of trajectories: the ranks run the same number of
        micro-batches, each of which is a collective (FSDP all-gather / reduce-scatter)."""
        t = self.all_reduce_(torch.tensor([rows, -rows], device=self.mesh.device_type), dist.ReduceOp.MAX)
        most, fewest = int(t[0]), -int(t[1])
        if most != fewest:
            raise TrainingError(
                f"data cells differ in size ({fewest} to {most} trajectories across the {self.size} policy ranks): "
                "every rank must train on an equal slice of whole groups"
            )

    def global_normalizer(self, norm: LossNormalizer) -> LossNormalizer:
        """The step's token and sequence counts summed over all ranks (float64 on the wire: exact)."""
        local = [torch.as_tensor(norm.num_tokens), torch.as_tensor(norm.num_seqs)]
        total = self.all_reduce_(self._comm(local, torch.float64))
        like = local[0]
        return LossNormalizer(
            num_tokens=total[0].to(like.device, like.dtype), num_seqs=total[1].to(like.device, like.dtype)
        )

    def sum(self, tensor: Tensor) -> Tensor:
        """The all-rank sum of a detached tensor (a new tensor, on the input's device)."""
        out = self.all_reduce_(tensor.detach().clone().to(self.mesh.device_type))
        return out.to(tensor.device)

    def merge_stats(self, stats: LossStats) -> LossStats:
        """``stats`` of every rank combined: SUM per field, MAX for ``LossStats.MAX_FIELDS``.

        Which fields are None depends on the config and, for the train/inference gap, on whether this
        step's rollout recorded the sampler's logprobs, which every rank decides alike from the
        weight version (``rollout/state.py:records_logprobs``): the same on every rank.
        """
        present = [f.name for f in dataclasses.fields(stats) if getattr(stats, f.name) is not None]
        merged: dict[str, Tensor] = {}
        for names, op in (
            ([n for n in present if n not in LossStats.MAX_FIELDS], dist.ReduceOp.SUM),
            ([n for n in present if n in LossStats.MAX_FIELDS], dist.ReduceOp.MAX),
        ):
            if not names:
                continue
            values = [getattr(stats, n) for n in names]
            reduced = self.all_reduce_(self._comm(values, torch.float64), op)
            for i, (name, v) in enumerate(zip(names, values)):
                merged[name] = reduced[i].to(v.device, v.dtype)
        return dataclasses.replace(stats, **merged)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        """Clip to the GLOBAL gradient norm and return it (a plain float, the same on every rank).

        The per-shard norms combine through DTensor (``full_tensor`` is the all-reduce), so the
        clip coefficient, and every decision taken from the norm, agree across ranks.
        """
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        return clip_to_total_norm(params, max_norm, total)

    def all_finite(self, tensors: list[Tensor]) -> bool:
        """Whether every rank's shards of ``tensors`` are finite (one all-reduce of a flag)."""
        local = torch.stack([torch.isfinite(_local(t)).all() for t in tensors]).all()
        flag = torch.tensor([1.0 if bool(local) else 0.0], device=self.mesh.device_type)
        return bool(self.all_reduce_(flag, dist.ReduceOp.MIN)[0] > 0)

    @staticmethod
    def reshard(model: nn.Module) -> None:
        """Free gathered weights of units that keep them after forward (no communication).

        A gathered copy left by a forward without backward (a no-grad pass) would otherwise be
        reused by the next forward after the optimizer has changed the shards.
        """
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


class SingleProcess:
    """``DataParallel``'s reductions for an unsharded policy in one process: each is the identity
    (or the plain local computation), so the trainer runs one path for any number of ranks."""

    size = 1
    cell = 0

    def check_cells(self, rows: int) -> None:
        """One cell: nothing to compare."""

    @staticmethod
    def passes(micro_batches: list[list[int]], free_B: Tensor | None, unit: int = 1) -> list[Pass]:
        """Each micro-batch split into its free rows, run without autograd, and its rows that learn, the
        free passes first (``distributed/passes.py``); no other rank waits on this one's passes, so a
        wholly free micro-batch runs whole without autograd (``unit`` is for ranks that must agree)."""
        return [(rows, True) for rows in micro_batches] if free_B is None else split_passes(micro_batches, free_B)

    def global_normalizer(self, norm: LossNormalizer) -> LossNormalizer:
        return norm

    def sum(self, tensor: Tensor) -> Tensor:
        return tensor

    def merge_stats(self, stats: LossStats) -> LossStats:
        return stats

    @staticmethod
    def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
        """Clip to the gradient norm and return it (one host sync per step)."""
        grads = [p.grad for p in params if p.grad is not None]
        return clip_to_total_norm(params, max_norm, torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True))

    @staticmethod
    def all_finite(tensors: list[Tensor]) -> bool:
        return bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all())

    @staticmethod
    def reshard(model: nn.Module) -> None:
        """No gathered copies exist without FSDP."""


# -- full weights (weight sync, export) --------------------------------------------------------


def is_sharded(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a DTensor (an FSDP2-sharded policy): its full state
    exists only through collectives, which every rank must call in step."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def checkpoint_view(model: nn.Module, view: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """What a checkpoint saves of ``model``: ``view(model)`` (a smaller module, e.g. LoRA's adapter
    alone) in one process; the model itself when sharded, whose writer and reader address the whole
    state by name (the view would hold DTensor shards it cannot gather on its own)."""
    return model if is_sharded(model) else view(model)


def full_state_dict(model: nn.Module, *, to_cpu: bool = True, rank0_only: bool = True) -> dict[str, Tensor]:
    """The unsharded ``state_dict`` of a (possibly FSDP2-sharded) model.

    A collective: every rank must call it. Each distinct sharded tensor is all-gathered once (tied
    weights share one gather). With ``rank0_only`` the other ranks get an empty dict and keep no
    full copy; colocated weight sync, where every rank feeds its own engine, passes False.
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    done: dict[int, Tensor | None] = {}
    out: dict[str, Tensor] = {}
    for name, value in model.state_dict().items():
        if id(value) not in done:
            full = value.full_tensor() if isinstance(value, DTensor) else value.detach()
            done[id(value)] = (full.cpu() if to_cpu else full) if keep else None
        full_or_none = done[id(value)]
        if full_or_none is not None:
            out[name] = full_or_none
    return out


@dataclasses.dataclass(frozen=True)
class PolicyWeights:
    """The policy's current weights as a rollout engine receives them (``RolloutEngine.receive_weights``).

    An engine that samples with the policy module itself (the transformers engine in one process)
    asks ``shares(its_module)`` and has nothing to copy; every other engine takes
    ``full_state_dict()``: the module's own tensors when it is unsharded, the gathered full tensors
    when it is FSDP2-sharded (then a collective: every policy rank's engine calls it, in step).
    """

    module: nn.Module

    def shares(self, module: nn.Module) -> bool:
        """Whether ``module`` is the (unsharded) policy module itself."""
        return module is self.module

    def full_state_dict(self) -> dict[str, Tensor]:
        """The policy's whole ``state_dict`` on its device (see ``full_state_dict``)."""
        return full_state_dict(self.module, to_cpu=False, rank0_only=False)


def will_shard_policy() -> bool:
    """Whether the policy is about to be sharded over several ranks (``shard_for_world``): what is
    built from the whole model first (a rollout engine's own copy) must then not share its module."""
    from posttrain.distributed.world import rank_and_world

    return rank_and_world()[1] > 1


def mixed_precision_policy(param_dtype: torch.dtype, compute_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP2's form of the run's precision (``models/precision.py``): with a compute dtype narrower
    than the parameters, each unit all-gathers its weights in the compute dtype and computes in it,
    while gradients are reduce-scattered in fp32 into fp32 shards (the master weights the optimizer
    steps). Equal dtypes: FSDP2's default policy, nothing cast."""
    if compute_dtype == param_dtype:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def mixed_forward(
    model: nn.Module, plain: contextlib.AbstractContextManager[None]
) -> contextlib.AbstractContextManager[None]:
    """The context a mixed-precision forward of ``model`` runs in: ``plain`` (its weights as
    compute-dtype copies) for a plain module; nothing for an FSDP2-sharded one, whose
    MixedPrecisionPolicy (``mixed_precision_policy``) computes in the compute dtype already."""
    return contextlib.nullcontext() if is_sharded(model) else plain


def shard_for_world(
    model: nn.Module, dp_replicate: int, dp_shard: int | None, *, compute_dtype: torch.dtype | None = None
) -> DataParallel | SingleProcess:
    """FSDP2 over the policy ranks' mesh when the run has several (``shard_policy``), computing in
    ``compute_dtype`` (None: the parameters' dtype); the model as it is, with ``SingleProcess``
    reductions, in one process (the trainer casts the weights per forward there)."""
    if not will_shard_policy():
        return SingleProcess()
    param_dtype = next(model.parameters()).dtype
    policy = mixed_precision_policy(param_dtype, compute_dtype or param_dtype)
    return shard_policy(model, build_dp_mesh(dp_replicate, dp_shard), mp_policy=policy)
