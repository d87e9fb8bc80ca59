"""A policy rank's proxy to a tensor-parallel rollout replica (``grid.backend=ray``, disaggregated,
``rollout.tensor_parallel_size > 1``).

Such a replica is ``ROLLOUT_RANKS = rollout.tensor_parallel_size`` lane actors, one device each,
forming ONE vLLM engine (``launch/rollout_lanes.py``: ``distributed_executor_backend=
external_launcher``, every lane a rank of the engine's torch.distributed world). vLLM's
external-launcher mode is SPMD: every rank runs its own scheduler and must see the same calls in
the same order. So:

* **Sampling** goes to the leader (lane 0) alone, which forwards the same call to its followers in
  the order it receives calls (one caller per follower: Ray keeps that order), enters the engine
  with them, and returns the completions once every follower's digest of its own completions equals
  the leader's; the followers return that digest only (``batch_digest``). Several policy ranks may
  share a replica: their calls are ordered by the leader, not by the network.
* **Weights** reach every lane: the owner sends the full tensors to each lane (``object_store``:
  one ``ray.put``, every lane fetches it; ``nccl``: one pair group per lane, the same bucketed
  broadcasts to each in turn), each lane's vLLM loader keeps its own shard (vLLM's weight loaders
  narrow a full checkpoint tensor to the rank's slice). A lane loads without stamping; only once
  every lane loaded does the owner ask every lane to stamp the version (``commit``). A transfer
  that fails on any lane poisons every lane of the replica and stamps nothing; the proxy then
  refuses to sample, as a single-device replica's does.

``nixl`` is refused for these replicas by the preflight (its writes land in one registered buffer of
one process; ``preflight/rollout_tp.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import time
from typing import Any

from posttrain.config.schema import RunConfig
from posttrain.errors import TrainingError
from posttrain.rollout.data_pool import uses_pool
from posttrain.rollout.remote import NAMESPACE, RolloutProxy, SyncOptions, free_port


def lane_name(replica: int, lane: int) -> str:
    """The Ray actor name of one lane of a tensor-parallel rollout replica."""
    return f"rollout-{replica}-{lane}"


def batch_digest(batch: Any) -> str:
    """sha256 of a batch's completions (token ids, sampler logprobs by their float64 bits) and
    version: the ranks of one engine compute the same gathered logits and sample the same tokens,
    so they agree bit for bit or something desynchronised them."""
    h = hashlib.sha256(f"v={batch.weight_version};n={len(batch.completions)}".encode())
    for c in batch.completions:
        logprobs = c.logprobs or []
        h.update(struct.pack(f"<qq{len(c.token_ids)}q", c.prompt_index, len(c.token_ids), *c.token_ids))
        h.update(struct.pack(f"<q{len(logprobs)}d", len(logprobs), *logprobs))
    return h.hexdigest()


class LanesProxy(RolloutProxy):
    """The ``RolloutEngine`` protocol over a replica of several lanes: sampling through the leader
    (inherited: ``self.actor`` is lane 0), every weight version to every lane, two-phase."""

    def __init__(self, lanes: list[Any], replica: int, cell: int, *, owner: bool, **options: Any) -> None:
        super().__init__(lanes[0], cell, owner=owner, **options)
        self.lanes, self.replica = lanes, replica
        self.groups: list[Any] = [None] * len(lanes)  # nccl: one pair group per lane, opened on first use

    def _all(self, refs: list[Any], what: str) -> list[Any]:
        """Every lane's answer; the first lane that fails, dies or stays silent raises at once,
        naming it (the others may be waiting for it)."""
        import ray

        pending, answers = list(refs), {}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(refs.index(r) for r in pending)
                raise TrainingError(
                    f"rollout replica {self.replica}, lane(s) {late}: no answer to {what} within {self.timeout_s:.0f}s"
                )
            lane = refs.index(ready[0])
            try:
                answers[lane] = ray.get(ready[0])
            except ray.exceptions.RayActorError:
                raise TrainingError(f"rollout replica {self.replica}, lane {lane}: died during {what}") from None
            except ray.exceptions.RayTaskError as err:
                cause = getattr(err, "cause", None) or err
                raise TrainingError(
                    f"rollout replica {self.replica}, lane {lane}: {what} failed: {type(cause).__name__}: {cause}"
                ) from None
        return [answers[lane] for lane in range(len(refs))]

    def _send(self, named_tensors: dict[str, Any], version: int) -> None:
        """Every lane loads the full tensors, then every lane stamps ``version``; a failure on any
        lane poisons them all (best effort: a dead lane cannot be told) and is raised."""
        import ray

        try:
            if self.transport == "nccl":
                self._send_lanes_collective(named_tensors, version)
            else:  # object_store: one copy in the store, fetched by every lane
                payload = ray.put({k: v.detach().cpu() for k, v in named_tensors.items()})
                self._all([lane.load_weights.remote(payload, version) for lane in self.lanes], "load_weights")
            self._all([lane.commit.remote(version) for lane in self.lanes], "commit")
        except Exception as err:
            reason = f"the weight transfer of version {version} failed on a lane of the replica ({err})"
            stamped = "unknown (a lane did not answer)"
            with contextlib.suppress(Exception):
                wait = min(self.timeout_s, 30.0)
                ray.get([lane.poison.remote(reason) for lane in self.lanes], timeout=wait)
                stamped = str(ray.get([lane.weight_version.remote() for lane in self.lanes], timeout=wait))
            raise TrainingError(
                f"{err}; every lane of the replica is poisoned and none stamped version {version} (lane versions: "
                f"{stamped})"
            ) from err

    def _send_lanes_collective(self, named_tensors: dict[str, Any], version: int) -> None:
        """The bucketed broadcasts of ``distributed/weight_sync.py`` to each lane in turn, over a pair
        group per lane (every lane's receive is in flight while the owner sends to the others)."""
        import ray

        from posttrain.distributed import weight_sync

        for lane, group in enumerate(self.groups):
            if group is None:
                host, port = ray.util.get_node_ip_address(), free_port()
                joined = self.lanes[lane].join_sync.remote(host, port, self.timeout_s)
                self.groups[lane] = weight_sync.pair_group(host, port, 0, timeout_s=self.timeout_s)
                self._all([joined], "join_sync")
        meta = weight_sync.describe(named_tensors)
        received = [lane.receive_broadcast.remote(meta, version, self.sync.bucket_bytes) for lane in self.lanes]
        for group in self.groups:
            weight_sync.send(group, named_tensors, self.sync.bucket_bytes)
        self._all(received, "receive_broadcast")

    def load_state_dict(self, state: Any) -> None:
        """Every lane keeps this cell's stream (the same calls reach every lane, so they stay equal)."""
        self._all([lane.load_state_dict.remote(self.cell, dict(state)) for lane in self.lanes], "load_state_dict")

    def close(self) -> None:
        from posttrain.distributed.weight_sync import close_group

        for group in self.groups:
            close_group(group)
        self.groups = [None] * len(self.lanes)
        super().close()


def lanes_proxy(cfg: RunConfig, rank: int) -> LanesProxy:
    """This policy rank's proxy to its tensor-parallel replica (``rank mod ROLLOUT_REPLICAS``), its
    lanes found by name."""
    import ray

    replicas, ranks = cfg.grid.shapes.rollout
    replica = rank % replicas
    lanes = [ray.get_actor(lane_name(replica, lane), namespace=NAMESPACE) for lane in range(ranks)]
    return LanesProxy(
        lanes,
        replica,
        rank,
        owner=rank < replicas,
        timeout_s=cfg.grid.collective_timeout_s,
        transport=cfg.rl.weight_sync_transport,
        sync=SyncOptions.of(cfg.rl),
        pooled=uses_pool(cfg),
    )
