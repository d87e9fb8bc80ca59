"""The Ray backend (``grid.backend=ray``): the SPMD loop of ``posttrain.distributed`` run by Ray actors.

The driver (the entry point) connects to ``grid.ray_address`` or starts a local cluster, reserves
one placement group, and starts POLICY_RANKS policy actors. Each actor sets the torch.distributed
environment (``MASTER_ADDR``/``MASTER_PORT`` of actor 0's node, ``RANK``, ``WORLD_SIZE``) and runs
the ordinary loop, exactly as a torchrun process would.

* ``colocated``: each policy actor holds its own rollout engine, as under torchrun.
* ``disaggregated``: ROLLOUT_REPLICAS rollout actors (``RolloutActor``), in bundles of their own,
  hold the engines (``rollout/replica.py``: transformers on the actor's own copy of the model, or,
  with ``rollout.backend=vllm``, an in-process vLLM engine that loads the initial weights from the
  model directory and takes every update through its ``load_weights``). Policy rank ``r`` samples on
  replica ``r mod ROLLOUT_REPLICAS`` through ``rollout/remote.py``'s ``RolloutProxy`` (the
  ``RolloutEngine`` protocol; every call bounded by ``ray.get(..., timeout=...)``). A replica keeps
  one sampling stream per policy rank (its own call counter), so sampling does not depend on which
  rank's request arrives first, and a checkpoint restores each rank's stream. After each optimizer
  step every rank gathers the full weights (a collective); the lowest rank using a replica sends
  them, through the Ray object store (``rl.weight_sync_transport=object_store``) or by broadcasts in
  a process group of the two (``nccl``: NCCL between GPUs, gloo on CPU; ``distributed/weight_sync.py``)
  or by NIXL writes into a buffer the replica registered (``nixl``; ``distributed/nixl_sync.py``),
  and all ranks wait at a barrier, so nobody samples from a replica before its new version is stamped.
  A LoRA policy (``model.lora``) gathers and sends its adapter alone (``rollout/replica_lora.py``).
  A failed or partial transfer poisons the replica: it refuses to sample, and the run stops with a
  message to resume from the last checkpoint. With ``rl.data_pool.data_plane=ray_nixl_pool`` a
  replica puts its completions' large fields into the object store and returns handles
  (``rollout/data_pool.py``); the driver logs at start that NIXL is not used for them.

Tensor-parallel replicas (``rollout.tensor_parallel_size > 1``, disaggregated, vLLM): each replica
is ROLLOUT_RANKS lane actors in a placement group of its own, forming one vLLM engine
(``launch/rollout_lanes.py``; the policy ranks' side is ``rollout/lanes_proxy.py``).

OPD: the teacher is a role of its own (``teacher/pool.py``): ``rl.teacher.replicas`` replicas of
``rl.teacher.tensor_parallel_size`` lanes, each replica in a placement group of its own, started
before the policy ranks; each rank holds a ``teacher/remote.py`` proxy. Capacity: a cluster this
driver started is checked against the roles' GPUs (``distributed/placement.py``: ``K + T`` colocated,
policy + rollout + teacher disaggregated) before any actor starts; a joined cluster is not (the
start line says why).

Any actor failure ends the run with that actor's error: the driver waits on every policy actor,
and the first one to fail (or die) makes it kill the others, which may be blocked in a collective.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from posttrain.config.schema import RunConfig
from posttrain.distributed.placement import cluster_line, cluster_shortfall, role_plan
from posttrain.errors import ConfigError, TrainingError
from posttrain.importing import import_object
from posttrain.rollout.data_pool import place_batch, ray_put, start_line, uses_pool
from posttrain.rollout.remote import NAMESPACE, free_port
from posttrain.rollout.state import EngineState
from posttrain.teacher.pool import EXIT_ENV as TEACHER_EXIT_ENV
from posttrain.teacher.pool import TeacherPool

# Fault injection for tests (launch/rollout_lanes.py): one lane of a tensor-parallel replica fails a weight load.
LANE_FAIL_ENV = "POSTTRAIN_TEST_ROLLOUT_LANE_LOAD_FAIL"

# Fault injection for tests: a rollout actor exits (as if killed) on this generate call.
EXIT_AFTER_ENV = "POSTTRAIN_TEST_ROLLOUT_EXIT_AFTER"


def _config_of(kind: str, tree: dict[str, Any]) -> RunConfig:
    """The run's config rebuilt inside an actor (``kind`` is the config class's import path)."""
    cls = import_object(kind, what="the Ray job's config class", must_be_callable=True)
    cfg: RunConfig = cls.model_validate(tree)
    return cfg


class PolicyRankActor:
    """One policy rank: the torch.distributed environment, then the loop (``train``)."""

    def address(self) -> tuple[str, int]:
        """This node's address and a free port (asked of rank 0: the process group's rendezvous)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def run(self, rank: int, world: int, master: tuple[str, int], job: dict[str, Any]) -> str:
        """Run the loop as rank ``rank`` of ``world``; returns the run directory."""
        os.environ.update(
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",  # Ray gives each actor its own GPU (CUDA_VISIBLE_DEVICES)
        )
        cfg = _config_of(job["config_class"], job["config"])
        train = import_object(job["train"], what="the Ray job's loop", must_be_callable=True)
        return str(train(cfg, argv=job["argv"]))


class RolloutActor:
    """One rollout replica: the engine ``rollout.backend`` names (``rollout/replica.py``: transformers
    on its own copy of the policy, or an in-process vLLM engine), one sampling stream per policy
    rank, weights received from the policy ranks with a version stamp."""

    def __init__(self, tree: dict[str, Any], config_class: str) -> None:
        from posttrain.rollout.replica import build_replica

        cfg = _config_of(config_class, tree)
        self.replica = build_replica(cfg)
        self.pooled = uses_pool(cfg)  # rl.data_pool.data_plane=ray_nixl_pool: completions by handle
        # the call counter here only numbers generate calls for EXIT_AFTER_ENV; the sampling streams
        # (one per policy rank) live in the replica
        self.state = EngineState("the rollout replica cannot sample: {reason}")
        self.group: Any = None  # the weight-sync pair group (nccl transport), joined on first sync
        self.nixl: Any = None  # the nixl transport's receiver (distributed/nixl_sync.py), made on first sync

    def generate(self, cell: int, prompt_token_ids: list[list[int]], n: int, params: Any) -> Any:
        self.state.check_usable()
        if os.environ.get(EXIT_AFTER_ENV) == str(self.state.next_call() + 1):
            os._exit(1)  # the test's stand-in for a killed or crashed rollout process
        batch = self.replica.generate(cell, prompt_token_ids, n, params)
        # pooled: each completion's large fields put once here (this actor owns them), handles returned
        return place_batch(batch, ray_put) if self.pooled else batch

    def load_weights(self, named_tensors: dict[str, Any], version: int) -> int:
        """Copy the full weights in; the version is stamped only once every tensor was copied."""
        try:
            self.replica.load_weights(named_tensors, version)
        except Exception as err:
            self.state.poison(f"the weight transfer of version {version} failed midway ({err}); its weights are mixed")
            raise
        self.state.commit(version)
        return version

    def join_sync(self, host: str, port: int, timeout_s: float) -> bool:
        """Join the owner's two-process group for collective weight sync (``nccl`` transport)."""
        from posttrain.distributed.weight_sync import pair_group

        self.group = pair_group(host, port, 1, timeout_s=timeout_s)
        return True

    def receive_broadcast(self, meta: list[Any], version: int, bucket_bytes: int = 256 * 2**20) -> int:
        """Receive the owner's broadcasts (``distributed/weight_sync.py``), then load them as one version.
        A transfer that breaks off poisons the replica: the stream between the two is out of step."""
        from posttrain.distributed.weight_sync import receive

        try:
            tensors = receive(self.group, meta, self.replica.device, bucket_bytes)
        except Exception as err:
            self.state.poison(f"the weight transfer of version {version} broke off ({err})")
            raise
        return self.load_weights(tensors, version)

    def prepare_nixl(self, meta: list[Any], bucket_bytes: int) -> Any:
        """``nixl`` transport: check that ``meta`` covers this replica's model (before any byte of the
        version moves; nothing is poisoned when it does not), then say where the owner writes."""
        from posttrain.distributed.nixl_sync import NixlReceiver

        self.state.check_usable()
        if self.nixl is None:
            self.nixl = NixlReceiver()
        return self.nixl.prepare(meta, self.replica.device, bucket_bytes, self.replica.weight_layout())

    def receive_nixl(self, meta: list[Any], version: int, min_bandwidth_gbps: float, probe: bool) -> int:
        """Wait for every bucket the owner writes (``prepare_nixl`` first), then load them as one
        version. A bucket that does not land in time, or (probe) lands with other bytes, poisons the
        replica: a late write of this version could still change its buffer."""
        try:
            tensors = self.nixl.wait(meta, version, min_bandwidth_gbps=min_bandwidth_gbps, probe=probe)
        except Exception as err:
            self.state.poison(f"the weight transfer of version {version} broke off ({err})")
            raise
        return self.load_weights(tensors, version)

    def state_dict(self, cell: int) -> dict[str, int]:
        return self.replica.state_dict(cell)

    def load_state_dict(self, cell: int, state: dict[str, int]) -> None:
        self.replica.load_state_dict(cell, state)

    def close(self) -> bool:
        """Release the engine (vLLM's engine core) and the weight-sync group before the driver kills
        this actor."""
        from posttrain.distributed.weight_sync import close_group

        close_group(self.group)
        self.group = None
        if self.nixl is not None:
            self.nixl.close()
            self.nixl = None
        self.replica.close()
        return True


# -- the driver -----------------------------------------------------------------------------------


def _connect(cfg: RunConfig, bundles: int) -> bool:
    """Join ``grid.ray_address``, or start a local cluster; True when this process started it."""
    import ray

    keep = ("PYTHONPATH", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", EXIT_AFTER_ENV, TEACHER_EXIT_ENV, LANE_FAIL_ENV)
    runtime_env = {"env_vars": {k: os.environ[k] for k in keep if k in os.environ}}
    if cfg.grid.ray_address is not None:
        ray.init(address=cfg.grid.ray_address, namespace=NAMESPACE, runtime_env=runtime_env)
        return False
    ray.init(
        num_cpus=max(bundles, os.cpu_count() or 1),
        namespace=NAMESPACE,
        include_dashboard=False,
        runtime_env=runtime_env,
        log_to_driver=True,
    )
    return True


def _cause(err: BaseException) -> str:
    """The actor's own exception behind a Ray error, as ``Type: message``."""
    cause = getattr(err, "cause", None) or err
    return f"{type(cause).__name__}: {cause}"


def _wait_all(refs: list[Any]) -> list[Any]:
    """Every policy rank's result; the first rank that fails (or dies) raises at once."""
    import ray

    pending, results = list(refs), {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            rank = refs.index(ref)
            try:
                results[rank] = ray.get(ref)
            except Exception as err:
                raise TrainingError(f"policy rank {rank} failed: {_cause(err)}") from None
    return [results[r] for r in range(len(refs))]


def _job(cfg: RunConfig, argv: list[str], config_class: str, train: str) -> dict[str, Any]:
    """What each policy actor needs: the config (its output root made absolute: actors do not share
    the driver's working directory), the argv for provenance, and the loop to run."""
    from posttrain.loop.run_dir import output_root

    cfg = cfg.model_copy(update={"job": cfg.job.model_copy(update={"output_root": str(output_root(cfg).resolve())})})
    return {"config": cfg.model_dump(mode="json"), "config_class": config_class, "train": train, "argv": argv}


def _close_replicas(rollouts: list[Any], timeout_s: float) -> None:
    """Let every replica shut its engine down after a successful run (best effort: the actors are
    killed right after, which frees everything anyway)."""
    import ray

    with contextlib.suppress(ray.exceptions.RayError):
        ray.get([a.close.remote() for a in rollouts], timeout=min(timeout_s, 60.0))


def train_with_ray(cfg: RunConfig, argv: list[str], config_class: str, train: str) -> Path:
    """Run the loop on Ray actors (see the module docstring); returns the run directory."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from posttrain.launch.rollout_lanes import RolloutLanes

    grid = cfg.grid
    ranks, replicas = grid.policy_ranks, grid.shapes.rollout[0]
    # rollout.tensor_parallel_size > 1: each replica is a group of lanes of its own (launch/rollout_lanes.py)
    lanes = grid.gpu_placement == "disaggregated" and grid.shapes.rollout[1] > 1
    remote_rollout = grid.gpu_placement == "disaggregated" and not lanes
    bundles = ranks + (replicas if remote_rollout else 0)
    plan = role_plan(cfg)  # the teacher's own pool too (OPD), placed apart: teacher/pool.py
    started = _connect(cfg, bundles + plan.teacher_gpus + (plan.rollout_gpus if lanes else 0))
    resources = ray.cluster_resources() if started else None  # a joined cluster is not checked
    print(cluster_line(plan, resources, grid.ray_address), file=sys.stderr, flush=True)
    shortfall = cluster_shortfall(plan, resources) if resources is not None else None
    if shortfall is not None:
        ray.shutdown()
        raise ConfigError([shortfall])
    if uses_pool(cfg):
        print(start_line(cfg), file=sys.stderr, flush=True)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    unit = {"CPU": 1.0, "GPU": 1.0} if gpus else {"CPU": 1.0}
    pg = placement_group([dict(unit) for _ in range(bundles)], strategy="PACK")
    actors: list[Any] = []
    teachers, tp_rollouts = TeacherPool(), RolloutLanes()
    try:
        ray.get(pg.ready(), timeout=grid.collective_timeout_s)

        def place(cls: type, index: int, **options: Any) -> Any:
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
            actor: Any = ray.remote(cls).options(num_cpus=1, num_gpus=gpus, scheduling_strategy=strategy, **options)
            return actor

        job = _job(cfg, argv, config_class, train)
        for i in range(replicas if remote_rollout else 0):
            actors.append(
                place(RolloutActor, ranks + i, name=f"rollout-{i}", namespace=NAMESPACE).remote(
                    job["config"], config_class
                )
            )
        rollouts = list(actors)
        ray.get([a.state_dict.remote(0) for a in rollouts], timeout=grid.collective_timeout_s)  # replicas are up
        if lanes:
            tp_rollouts.start(
                job["config"], config_class, replicas, grid.shapes.rollout[1], gpus=bool(gpus),
                timeout_s=grid.collective_timeout_s,
            )  # fmt: skip
        if plan.teacher_gpus:
            teachers.start(
                job["config"],
                config_class,
                plan.teacher_replicas,
                plan.teacher_ranks,
                gpus=bool(gpus),
                timeout_s=grid.collective_timeout_s,
            )
        policies = [place(PolicyRankActor, r).remote() for r in range(ranks)]
        actors += policies
        master = ray.get(policies[0].address.remote(), timeout=grid.collective_timeout_s)
        results = _wait_all([p.run.remote(r, ranks, master, job) for r, p in enumerate(policies)])
        _close_replicas(rollouts, grid.collective_timeout_s)
        tp_rollouts.close(grid.collective_timeout_s)
        teachers.close(grid.collective_timeout_s)
        return Path(results[0])
    except ray.exceptions.GetTimeoutError as err:
        raise TrainingError(f"the Ray cluster did not start the run's actors in time: {err}") from None
    except ray.exceptions.RayError as err:  # an actor that failed to start (a rollout replica's model load)
        raise TrainingError(f"a Ray actor of the run failed: {_cause(err)}") from None
    finally:
        for actor in actors:
            ray.kill(actor)
        teachers.kill()
        tp_rollouts.kill()
        remove_placement_group(pg)
        if started:
            ray.shutdown()
