"""The topology section: role shapes, placement, data parallelism and the declared allocation
(checked by ``posttrain.preflight.grid``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from posttrain.config.section import Section


class GridShapes(Section):
    """Role shapes: ``[REPLICAS, RANKS]``."""

    policy: list[int] = Field(default_factory=lambda: [1, 1])
    """``[1, POLICY_RANKS]``; POLICY_REPLICAS must be 1."""
    rollout: list[int] = Field(default_factory=lambda: [1, 1])
    """``[ROLLOUT_REPLICAS, ROLLOUT_RANKS]``; ROLLOUT_RANKS must equal ``rollout.tensor_parallel_size``."""


class GridConfig(Section):
    """Topology."""

    backend: Literal["local", "ray"] = "local"
    """``local``: one process (or one torchrun world, TP 1); ``ray``: roles as Ray actors."""
    gpu_placement: Literal["colocated", "disaggregated"] = "colocated"
    """Whether rollout and policy share one device pool or own disjoint pools."""
    shapes: GridShapes = Field(default_factory=GridShapes)
    """Role shapes."""
    ray_address: str | None = None
    """Address of an existing Ray cluster; ``null`` starts a local one."""
    dp_replicate: int = Field(1, ge=1)
    """Policy data parallelism, replicated axis (HSDP): ``dp_replicate x dp_shard`` must equal
    POLICY_RANKS. Each replica holds a whole sharded copy; 1 is plain FSDP over all policy ranks.
    Every policy rank is one data cell either way."""
    dp_shard: int | None = Field(None, ge=1)
    """Policy data parallelism, sharded axis (FSDP): parameters, gradients and optimizer state are
    split over this many ranks. ``null``: POLICY_RANKS // ``dp_replicate``."""
    num_nodes: int | None = Field(None, ge=1)
    """Nodes of the allocation, declared so that a too-small allocation is refused before anything
    starts; ``null``: not declared (checked against torchrun's ``WORLD_SIZE`` when launched with it)."""
    gpus_per_node: int | None = Field(None, ge=1)
    """GPUs per node of the declared allocation (set together with ``num_nodes``)."""
    collective_timeout_s: float = Field(600.0, gt=0, le=604800.0)
    """Seconds a collective between policy ranks may wait before it raises (a crashed or
    desynchronised peer stops the run instead of hanging it). Generous: the first all-gather of a
    large model includes its warm-up. At most a week (604800 s): a longer wait is a hang."""

    @property
    def policy_ranks(self) -> int:
        """POLICY_RANKS: the second entry of ``shapes.policy``."""
        return self.shapes.policy[-1]

    @property
    def rollout_gpus(self) -> int:
        """GPUs the rollout engines take: ROLLOUT_REPLICAS x ROLLOUT_RANKS."""
        return self.shapes.rollout[0] * self.shapes.rollout[-1]

    @property
    def gpus_needed(self) -> int:
        """GPUs the shapes need: colocated roles share one pool, disaggregated ones own theirs."""
        if self.gpu_placement == "colocated":
            return max(self.policy_ranks, self.rollout_gpus)
        return self.policy_ranks + self.rollout_gpus
