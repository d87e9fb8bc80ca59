"""FSDP2 policy ranks: the process group, the sharded model, DP-global reductions and data cells.

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

Nothing here is used, and nothing changes, when the policy's parameters are plain tensors (one
process, no FSDP): ``DataParallel.of`` returns None and the trainer keeps its single-process path.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from posttrain.algorithm.objectives import LossNormalizer, LossStats
from posttrain.config.schema import GRPOConfig
from posttrain.errors import ConfigError, PosttrainError, TrainingError
from posttrain.policy.logprobs import split_body_and_head

# A collective that has not finished after this long raises instead of hanging the run (a crashed
# or desynchronised peer). Generous: the first all-gather of a large model includes its warm-up.
DEFAULT_TIMEOUT_S = 600.0

BatchT = TypeVar("BatchT")


# -- process group and mesh ---------------------------------------------------------------------


def init_process_group(
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> None:
    """Join the default process group: NCCL on CUDA, gloo on the CPU, with a timeout on every collective.

    Without ``init_method`` / ``rank`` / ``world_size`` it reads torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). On CUDA each process uses the GPU ``LOCAL_RANK``
    of those it sees (``cuda:0`` when it sees one: ``pin_torchrun_gpu`` and Ray's actors do that).
    A second call is a no-op.
    """
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank is not None and world_size is not None:
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(backend, **kwargs)


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
    if dp is None:  # unreachable after the check above; narrows the type
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


# -- DP-global reductions -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """The policy's data-parallel mesh, and the reductions the trainer needs over it.

    Every method is a collective: all ranks call it in the same order (the trainer does, because
    every rank runs the same number of mini- and micro-batches; ``check_cells`` enforces it).
    """

    mesh: DeviceMesh

    @classmethod
    def of(cls, model: nn.Module) -> DataParallel | None:
        """The mesh ``model`` is sharded over; None for a plain (single-process) model."""
        first = next(model.parameters(), None)
        return cls(first.device_mesh) if isinstance(first, DTensor) else None

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
        weight version (``rollout/vllm_engine.py:records_logprobs``): the same on every rank.
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
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return float(total)

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


# -- full weights (weight sync, export) --------------------------------------------------------


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


# -- data cells ---------------------------------------------------------------------------------


def cell_rows(num_rows: int, *, group_size: int, mini_batch: int, cell: int, cells: int) -> list[int]:
    """Rows of the collected batch that data cell ``cell`` of ``cells`` trains on.

    Each mini-batch (optimizer step) is split into ``cells`` contiguous slices of whole groups, and
    the cell takes its slice of every mini-batch in order. With one mini-batch per collected batch
    this is simply "cell r gets the r-th contiguous slice of groups"; with several, the cell's k-th
    local mini-batch is its slice of the global k-th, so the optimizer steps match one process.
    Uneven cells are refused, not padded: every rank must run the same micro-batches (collectives),
    and the preflight refuses configs whose mini-batch groups do not divide over the policy ranks.
    """
    if not 0 <= cell < cells:
        raise ValueError(f"cell={cell} is outside the {cells} data cells")
    rows: list[int] = []
    for start in range(0, num_rows, mini_batch):
        size = min(mini_batch, num_rows - start)
        if size % (group_size * cells):
            raise ValueError(
                f"a mini-batch of {size} trajectories is not {cells} equal slices of whole groups of "
                f"{group_size}: rl.mini_batch_per_replica (or rl.batch_per_replica) must be a multiple of "
                f"rl.group_size x POLICY_RANKS = {group_size * cells}"
            )
        per_cell = size // cells
        rows.extend(range(start + cell * per_cell, start + (cell + 1) * per_cell))
    return rows


def take_rows(batch: BatchT, rows: list[int]) -> BatchT:
    """A copy of the dataclass ``batch`` (a ``TrainBatch``: ``completion_ids`` counts its rows) holding
    only ``rows``.

    Every list or tensor field is per trajectory and is indexed; other fields (``group_size``,
    None) are kept. A list or tensor of another length is an error, never silently kept whole.
    """
    if not dataclasses.is_dataclass(batch) or isinstance(batch, type):
        raise TypeError(f"take_rows needs a dataclass instance, got {type(batch).__name__}")
    n = len(batch.completion_ids)  # type: ignore[attr-defined]
    index = torch.tensor(rows, dtype=torch.long)
    picked: dict[str, Any] = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, (list, Tensor)):
            if len(value) != n:
                raise ValueError(f"{type(batch).__name__}.{f.name} has {len(value)} rows, expected {n}")
            picked[f.name] = value[index.to(value.device)] if isinstance(value, Tensor) else [value[i] for i in rows]
    return dataclasses.replace(batch, **picked)


def cell_config(cfg: GRPOConfig, cells: int) -> GRPOConfig:
    """The config as one data cell sees it: ``rl.batch_per_replica`` and ``rl.mini_batch_per_replica``
    divided by ``cells`` (the number of optimizer steps, ``n_mini``, is unchanged).
    ``rl.micro_batch_per_replica`` is per rank already and stays."""
    rl = cfg.rl
    if rl.batch_per_replica % cells or rl.mini_batch % cells:
        raise ConfigError(
            [
                f"rl.batch_per_replica={rl.batch_per_replica} and the mini-batch ({rl.mini_batch}) must divide "
                f"evenly over the {cells} data cells (policy ranks)"
            ]
        )
    update: dict[str, Any] = {"batch_per_replica": rl.batch_per_replica // cells}
    if rl.mini_batch_per_replica is not None:
        update["mini_batch_per_replica"] = rl.mini_batch_per_replica // cells
    return cfg.model_copy(update={"rl": rl.model_copy(update=update)})


# -- small collectives over the default group (run-level coordination, not training) -------------


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` without a process group). A collective."""
    _, world = rank_and_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's picklable ``obj`` on every rank (``obj`` itself without a process group). A collective."""
    _, world = rank_and_world()
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (a stop request, a failure). A collective."""
    _, world = rank_and_world()
    if world == 1:
        return flag
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t[0] > 0)


# -- rank-aware logging -------------------------------------------------------------------------


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_rank_zero() -> bool:
    """True on the rank that writes run files and console lines (and in a single process)."""
    return rank_and_world()[0] == 0


class RankFilter(logging.Filter):
    """Tags records with ``[rank r/w]`` in a multi-rank run and drops those below ``min_level_off_zero``
    on ranks other than 0, so N ranks do not print N copies of every info line."""

    def __init__(self, min_level_off_zero: int = logging.WARNING) -> None:
        super().__init__()
        self.min_level_off_zero = min_level_off_zero

    def filter(self, record: logging.LogRecord) -> bool:
        rank, world = rank_and_world()
        if world > 1 and not getattr(record, "rank_tagged", False):
            record.msg = f"[rank {rank}/{world}] {record.msg}"
            record.rank_tagged = True  # a record passing several filtered handlers is tagged once
        return rank == 0 or record.levelno >= self.min_level_off_zero
