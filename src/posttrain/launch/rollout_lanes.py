"""Tensor-parallel rollout replicas under ``grid.backend=ray`` (disaggregated,
``rollout.tensor_parallel_size > 1``): ROLLOUT_REPLICAS replicas, each ROLLOUT_RANKS lane actors
(one device each, one placement group per replica packed on one node) forming ONE vLLM engine of
that tensor-parallel width (``distributed_executor_backend=external_launcher``: every lane is a
rank of the engine's torch.distributed world, rendezvous at lane 0; gloo between them on CPU,
NCCL on GPUs).

``RolloutLane`` is a ``RolloutActor`` (the same weight receivers, streams and close) with three
differences: the leader (lane 0) forwards every sampling call to its followers and returns the
completions only once their digests equal its own (``rollout/lanes_proxy.py``); a weight load
stamps nothing until the owner's ``commit`` (sent once every lane loaded); and ``poison`` lets the
owner mark every lane unusable when a transfer failed on any of them. Single-device replicas keep
the plain ``RolloutActor`` (``launch/ray_backend.py``), untouched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from posttrain.distributed.lane_groups import LaneGroups
from posttrain.errors import TrainingError
from posttrain.launch.ray_backend import LANE_FAIL_ENV, RolloutActor, _config_of
from posttrain.rollout.data_pool import place_batch, ray_put, uses_pool
from posttrain.rollout.lanes_proxy import batch_digest, lane_name
from posttrain.rollout.remote import NAMESPACE, free_port
from posttrain.rollout.state import EngineState

# Fault injection for tests: "replica:lane:version": that lane's load of that weight version raises
# (after the other lanes loaded theirs), as a failed transfer into one rank would.
LOAD_FAIL_ENV = LANE_FAIL_ENV

# what every lane passes to vLLM: one rank of an SPMD engine (the same seed on every rank: each rank
# samples, and the ranks must draw the same tokens)
LAUNCHER_ARGS = {"distributed_executor_backend": "external_launcher", "disable_custom_all_reduce": True}


def _load_fail_version(replica: int, lane: int) -> int | None:
    for item in filter(None, os.environ.get(LOAD_FAIL_ENV, "").split(",")):
        r, ln, version = (int(x) for x in item.split(":"))
        if (r, ln) == (replica, lane):
            return version
    return None


def _drop_stale_cpu_segments(lane: int, lanes: int) -> None:
    """vLLM's CPU build names a TP group's shared-memory segments after the engine's init method,
    ``env://`` for every external_launcher engine, and leaves them behind (also after a clean
    exit): the next TP engine of that width on this host would fail with errno 17 (EEXIST). This
    rank's segment of a former engine goes before the new one is built. GPUs (NCCL) have none."""
    import torch

    if torch.cuda.is_available():
        return
    ranks = "-".join(str(r) for r in range(lanes))
    Path(f"/dev/shm/-tp:0-[{ranks}]-cpushm_{lane}").unlink(missing_ok=True)


class RolloutLane(RolloutActor):
    """One rank of one tensor-parallel rollout replica (a Ray actor)."""

    def __init__(self, tree: dict[str, Any], config_class: str, replica: int, lane: int, lanes: int) -> None:
        # no super().__init__: the engine is built by ``start`` once lane 0's rendezvous is known
        self.cfg = _config_of(config_class, tree)
        self.index, self.lane, self.lanes = replica, lane, lanes
        self.pooled = uses_pool(self.cfg) and lane == 0  # only the leader returns completions
        self.state = EngineState(f"rollout replica {replica}, lane {lane} cannot sample: {{reason}}")
        self.group: Any = None
        self.nixl: Any = None
        self.replica: Any = None
        self.followers: list[Any] = []
        self.loaded: int | None = None  # the version loaded and not yet committed
        self.fail_on = _load_fail_version(replica, lane)

    def address(self) -> tuple[str, int]:
        """This node's address and a free port: lane 0's are the engine's rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def start(self, master: tuple[str, int]) -> bool:
        """Build this rank's part of the engine (every lane at once: they meet at ``master``)."""
        import ray

        from posttrain.rollout.replica import build_replica

        os.environ.update(
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
            RANK=str(self.lane),
            WORLD_SIZE=str(self.lanes),
            LOCAL_RANK="0",  # Ray gives each lane its own GPU
        )
        _drop_stale_cpu_segments(self.lane, self.lanes)
        self.replica = build_replica(self.cfg, launcher_args=dict(LAUNCHER_ARGS))
        if self.lane == 0:
            self.followers = [
                ray.get_actor(lane_name(self.index, n), namespace=NAMESPACE) for n in range(1, self.lanes)
            ]
        return True

    def generate(self, cell: int, prompt_token_ids: list[list[int]], n: int, params: Any) -> Any:
        """The leader: the same call on every lane, in the order the leader got it; the completions
        once every follower sampled the same ones."""
        import ray

        self.state.check_usable()
        follows = [f.follow.remote(cell, prompt_token_ids, n, params) for f in self.followers]
        batch = self.replica.generate(cell, prompt_token_ids, n, params)
        mine = batch_digest(batch)
        theirs = ray.get(follows, timeout=self.cfg.grid.collective_timeout_s)
        for lane, digest in enumerate(theirs, start=1):
            if digest != mine:
                message = (
                    f"rollout replica {self.index}, lane {lane}: its completions (digest {digest[:12]}) differ "
                    f"from the leader's ({mine[:12]}); the ranks of one engine are out of step"
                )
                raise self.state.poison(message)
        return place_batch(batch, ray_put) if self.pooled else batch

    def follow(self, cell: int, prompt_token_ids: list[list[int]], n: int, params: Any) -> str:
        """A follower: the leader's call on this rank; only the digest goes back."""
        self.state.check_usable()
        return batch_digest(self.replica.generate(cell, prompt_token_ids, n, params))

    def load_weights(self, named_tensors: dict[str, Any], version: int) -> int:
        """Load the full tensors (vLLM keeps this rank's shard); stamped only by ``commit``."""
        try:
            if self.fail_on == version:
                raise TrainingError(f"lane {self.lane}: the test's injected load failure of version {version}")
            self.replica.load_weights(named_tensors, version)
        except Exception as err:
            self.state.poison(f"the weight transfer of version {version} failed on lane {self.lane} ({err})")
            raise
        self.loaded = version
        return version

    def commit(self, version: int) -> int:
        """Stamp ``version``: every lane of the replica loaded it."""
        self.state.check_usable()
        if self.loaded != version:
            raise TrainingError(f"lane {self.lane} was asked to stamp version {version} but loaded {self.loaded}")
        self.state.commit(version)
        return version

    def poison(self, reason: str) -> bool:
        """The owner's verdict: a transfer failed on some lane, so this lane's weights are no version."""
        self.state.poison(reason)
        return True

    def weight_version(self) -> int:
        return self.state.weight_version


class RolloutLanes(LaneGroups):
    """The driver's handles on the tensor-parallel replicas: ``lanes[replica][lane]``, one placement
    group per replica (``distributed/lane_groups.py``)."""

    def start(
        self, tree: dict[str, Any], config_class: str, replicas: int, ranks: int, *, gpus: bool, timeout_s: float
    ) -> None:
        """Place ``replicas`` replicas of ``ranks`` lanes, named ``rollout-R-L``; returns once every
        engine is built. What was placed before a failure is in ``self`` for ``kill``."""
        self.place(
            RolloutLane,
            lane_name,
            NAMESPACE,
            tree=tree,
            config_class=config_class,
            replicas=replicas,
            ranks=ranks,
            gpus=gpus,
            timeout_s=timeout_s,
        )
