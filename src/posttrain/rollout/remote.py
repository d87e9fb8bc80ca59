"""A policy rank's proxy to a remote rollout replica (``grid.gpu_placement=disaggregated``, Ray).

The replica is a Ray actor (``launch/ray_backend.py``'s ``RolloutActor``, holding a
``rollout/replica.py`` engine) that several policy ranks sample on: policy rank ``r`` uses replica
``r mod ROLLOUT_REPLICAS`` and is cell ``r`` of it (the replica keeps one sampling stream per cell).
``RolloutProxy`` is the ``RolloutEngine`` protocol over Ray calls, each bounded by a timeout.

Weights: every policy rank gathers the full weights (``PolicyWeights.full_state_dict()``, a
collective); the lowest rank using a replica (its *owner*) sends them, through the Ray object store
(``rl.weight_sync_transport=object_store``) or by broadcasts in a process group of the two
(``nccl``: NCCL between GPUs, gloo on CPU; ``distributed/weight_sync.py``) or by NIXL writes into a
buffer the replica registered (``nixl``; ``distributed/nixl_sync.py``); then all policy ranks
wait at a barrier, so nobody samples from a replica before its new version is stamped. A LoRA
policy gathers and sends its adapter alone (``rollout/replica_lora.py``). A failed
transfer poisons the proxy: it refuses to sample, with the hint to resume from the last checkpoint.
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from posttrain.config.schema import BaseRLConfig, RunConfig
from posttrain.distributed.world import barrier
from posttrain.errors import TrainingError
from posttrain.rollout.data_pool import StepLedger, probe_store, resolve_batch, uses_pool
from posttrain.rollout.replica_lora import sync_tensors
from posttrain.rollout.state import RESUME_HINT, EngineState

if TYPE_CHECKING:
    from posttrain.distributed.fsdp import PolicyWeights

NAMESPACE = "posttrain"
CALL_TIMEOUT_S = 600.0


def free_port() -> int:
    """A TCP port free on this node now (a rendezvous for a process group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class SyncOptions(NamedTuple):
    """The ``rl.weight_sync_*`` knobs the owner's transport reads (``nccl``: the bucket size)."""

    bucket_bytes: int = 256 * 2**20
    probe: bool = True
    min_bandwidth_gbps: float = 1.0

    @classmethod
    def of(cls, rl: BaseRLConfig) -> SyncOptions:
        """The options a run's ``rl`` section sets."""
        return cls(rl.weight_sync_bucket_bytes, rl.weight_sync_probe, rl.weight_sync_min_bandwidth_gbps)


class RolloutProxy:
    """A policy rank's view of its rollout replica: the ``RolloutEngine`` protocol over Ray calls,
    each bounded by ``timeout_s``. ``owner``: this rank sends the replica its weights."""

    def __init__(
        self,
        actor: Any,
        cell: int,
        *,
        owner: bool,
        timeout_s: float = CALL_TIMEOUT_S,
        transport: str = "object_store",
        pooled: bool = False,
        sync: SyncOptions | None = None,
    ) -> None:
        self.actor, self.cell, self.owner, self.timeout_s = actor, cell, owner, timeout_s
        self.transport = transport
        self.sync = sync or SyncOptions()
        self.nixl: Any = None  # the nixl transport's sender (distributed/nixl_sync.py), made on first use
        self.state = EngineState("{reason}. " + RESUME_HINT)
        self.group: Any = None
        # rl.data_pool.data_plane=ray_nixl_pool: the replica returns handles (rollout/data_pool.py),
        # resolved here and held until the step's optimizer commit (the weight sync)
        self.pooled, self.ledger = pooled, StepLedger()

    @property
    def weight_version(self) -> int:
        return self.state.weight_version

    def _get(self, ref: Any, what: str) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TrainingError(f"the rollout replica did not answer {what} within {self.timeout_s:.0f}s") from None
        except ray.exceptions.RayActorError as err:
            raise TrainingError(
                f"the rollout replica died during {what}; the run stops (resume from the last checkpoint with "
                f"rl.resume=auto): {err}"
            ) from None

    def generate(self, prompt_token_ids: list[list[int]], n: int, params: Any) -> Any:
        self.state.check_usable()
        batch = self._get(self.actor.generate.remote(self.cell, prompt_token_ids, n, params), "generate")
        if not self.pooled:
            return batch
        batch, refs = resolve_batch(batch, lambda handles: self._get(handles, "the data pool's fetch"))
        self.ledger.hold(refs)
        return batch

    def receive_weights(self, weights: PolicyWeights, version: int) -> None:
        """Every policy rank gathers the full weights (a collective), the owner sends them to the
        replica, then all ranks meet at a barrier: no rank samples from a shared replica before its
        new version is in. A LoRA policy sends its adapter alone (``rollout/replica_lora.py``)."""
        named_tensors = sync_tensors(weights)
        if self.owner:
            start = time.perf_counter()
            try:
                self._send(named_tensors, version)
            except Exception as err:
                raise self.state.poison(
                    f"weight sync of version {version} to the rollout replica failed: {err}"
                ) from err
            self.sync_s = time.perf_counter() - start
        self.state.commit(version)
        released = self.ledger.release()  # after the optimizer commit: the step's payloads may go
        barrier()
        if self.pooled and self.owner:
            probe_store(version, released)

    def _send(self, named_tensors: dict[str, Any], version: int) -> None:
        """The owner's transfer of one version over ``rl.weight_sync_transport`` (a tensor-parallel
        replica sends to each of its lanes instead: ``rollout/lanes_proxy.py``)."""
        if self.transport == "nccl":
            self._send_collective(named_tensors, version)
        elif self.transport == "nixl":
            self._send_nixl(named_tensors, version)
        else:
            payload = {k: v.detach().cpu() for k, v in named_tensors.items()}
            self._get(self.actor.load_weights.remote(payload, version), "load_weights")

    def _send_collective(self, named_tensors: dict[str, Any], version: int) -> None:
        """Broadcast the weights to the replica in the two-process group (opened on first use)."""
        import ray

        from posttrain.distributed import weight_sync

        if self.group is None:
            host, port = ray.util.get_node_ip_address(), free_port()
            joined = self.actor.join_sync.remote(host, port, self.timeout_s)
            self.group = weight_sync.pair_group(host, port, 0, timeout_s=self.timeout_s)
            self._get(joined, "join_sync")
        received = self.actor.receive_broadcast.remote(
            weight_sync.describe(named_tensors), version, self.sync.bucket_bytes
        )
        weight_sync.send(self.group, named_tensors, self.sync.bucket_bytes)
        self._get(received, "receive_broadcast")

    def _send_nixl(self, named_tensors: dict[str, Any], version: int) -> None:
        """NIXL writes of the packed buckets into the replica's registered buffer, after the replica
        checked that the list covers its model (``distributed/nixl_sync.py``)."""
        from posttrain.distributed import nixl_sync, weight_sync

        if self.nixl is None:
            self.nixl = nixl_sync.NixlSender()
        meta, sync = weight_sync.describe(named_tensors), self.sync
        destination = self._get(self.actor.prepare_nixl.remote(meta, sync.bucket_bytes), "prepare_nixl")
        received = self.actor.receive_nixl.remote(meta, version, sync.min_bandwidth_gbps, sync.probe)
        self.nixl.send(
            named_tensors,
            meta,
            destination,
            version,
            bucket_bytes=sync.bucket_bytes,
            min_bandwidth_gbps=sync.min_bandwidth_gbps,
            probe=sync.probe,
        )
        self._get(received, "receive_nixl")

    def state_dict(self) -> dict[str, int]:
        state: dict[str, int] = self._get(self.actor.state_dict.remote(self.cell), "state_dict")
        return state

    def load_state_dict(self, state: Any) -> None:
        self._get(self.actor.load_state_dict.remote(self.cell, dict(state)), "load_state_dict")

    def close(self) -> None:
        """Release this side of the weight-sync group; the driver owns the replica's lifetime."""
        from posttrain.distributed.weight_sync import close_group

        close_group(self.group)
        self.group = None
        if self.nixl is not None:
            self.nixl.close()
            self.nixl = None
        released = self.ledger.release()
        if self.pooled and self.owner:
            probe_store(self.weight_version, released, final=True, settle_s=10.0)


def rollout_proxy(cfg: RunConfig, rank: int) -> RolloutProxy:
    """This policy rank's proxy to its replica (``rank mod ROLLOUT_REPLICAS``), found by name."""
    import ray

    if cfg.rollout.tensor_parallel_size > 1:  # a replica of several lanes, one vLLM engine
        from posttrain.rollout.lanes_proxy import lanes_proxy

        return lanes_proxy(cfg, rank)

    replicas = cfg.grid.shapes.rollout[0]
    actor = ray.get_actor(f"rollout-{rank % replicas}", namespace=NAMESPACE)
    return RolloutProxy(
        actor,
        rank,
        owner=rank < replicas,
        timeout_s=cfg.grid.collective_timeout_s,
        transport=cfg.rl.weight_sync_transport,
        sync=SyncOptions.of(cfg.rl),
        pooled=uses_pool(cfg),
    )
