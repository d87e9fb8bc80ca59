"""How many GPUs each role of a run takes, the capacity arithmetic behind that number, and the check
of a Ray cluster's resources against it.

Roles own whole devices (no fractional GPUs):

* policy: POLICY_RANKS GPUs;
* rollout: ROLLOUT_REPLICAS x ROLLOUT_RANKS GPUs, sharing the policy's pool when colocated (every
  policy rank holds an engine), a pool of their own when disaggregated (a tensor-parallel replica,
  ROLLOUT_RANKS = ``rollout.tensor_parallel_size`` > 1, is that many one-GPU lanes packed on one node);
* teacher (OPD under ``grid.backend=ray``): ``rl.teacher.replicas x rl.teacher.tensor_parallel_size``
  GPUs, always a pool of its own (the teacher is frozen and shares no weights with the student).
  Under ``grid.backend=local`` the teacher lives in each policy rank and takes no GPU of its own.

So colocated OPD needs ``K + T`` GPUs (K the shared student pool, T the teacher's) and disaggregated
OPD ``policy + rollout + teacher``. Reads the config only: no torch, no cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from posttrain.config.schema import RunConfig

TEACHER_SHAPE = "rl.teacher.replicas x rl.teacher.tensor_parallel_size"


@dataclass(frozen=True)
class RolePlan:
    """The GPUs of each role of one run."""

    placement: str
    """``grid.gpu_placement``: ``colocated`` or ``disaggregated``."""
    policy_ranks: int
    rollout_replicas: int
    rollout_ranks: int
    teacher_replicas: int = 0
    """0: no teacher role of its own (GRPO, or an in-process teacher under ``grid.backend=local``)."""
    teacher_ranks: int = 0

    @property
    def rollout_gpus(self) -> int:
        return self.rollout_replicas * self.rollout_ranks

    @property
    def teacher_gpus(self) -> int:
        """T: the teacher's own pool."""
        return self.teacher_replicas * self.teacher_ranks

    @property
    def student_gpus(self) -> int:
        """K: the student's pools (policy and rollout, shared when colocated)."""
        if self.placement == "colocated":
            return max(self.policy_ranks, self.rollout_gpus)
        return self.policy_ranks + self.rollout_gpus

    @property
    def total(self) -> int:
        """GPUs the whole run needs (also the number of single-GPU actors it places)."""
        return self.student_gpus + self.teacher_gpus

    def arithmetic(self) -> str:
        """How ``total`` comes about, in the config's own names."""
        policy = f"POLICY_RANKS={self.policy_ranks}"
        rollout = f"ROLLOUT_REPLICAS x ROLLOUT_RANKS={self.rollout_gpus}"
        if self.rollout_ranks > 1:  # tensor-parallel replicas: every rank of every replica is a GPU
            rollout = f"ROLLOUT_REPLICAS x ROLLOUT_RANKS={self.rollout_replicas} x {self.rollout_ranks}"
        teacher = f"{TEACHER_SHAPE}={self.teacher_replicas} x {self.teacher_ranks}"
        if not self.teacher_gpus:
            if self.placement == "colocated":
                return f"colocated, one shared pool: max({policy}, {rollout})"
            return f"disaggregated, two pools: {policy} + {rollout}"
        if self.placement == "colocated":
            return (
                f"colocated OPD, K + T: the student's shared pool K = max({policy}, {rollout}) = "
                f"{self.student_gpus} plus the teacher's own pool T = {teacher} = {self.teacher_gpus}"
            )
        return f"disaggregated OPD, three pools: {policy} + {rollout} + {teacher}"


def role_plan(cfg: RunConfig) -> RolePlan:
    """The GPUs of each role ``cfg`` asks for (shapes assumed well formed: the preflight checks them)."""
    grid = cfg.grid
    teacher = getattr(cfg.rl, "teacher", None)  # OPD's rl.teacher; GRPO has none
    own = teacher is not None and grid.backend == "ray"
    return RolePlan(
        placement=grid.gpu_placement,
        policy_ranks=grid.policy_ranks,
        rollout_replicas=grid.shapes.rollout[0],
        rollout_ranks=grid.shapes.rollout[-1],
        teacher_replicas=int(getattr(teacher, "replicas", 1)) if own else 0,
        teacher_ranks=int(getattr(teacher, "tensor_parallel_size", 1)) if own else 0,
    )


def cluster_shortfall(plan: RolePlan, resources: Mapping[str, float]) -> str | None:
    """Why a Ray cluster with ``resources`` (``ray.cluster_resources()``) cannot hold the run, or None.

    A cluster with GPUs must have ``plan.total`` of them. One without any runs every role on CPU,
    one CPU per actor (the same number of actors)."""
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    if gpus > 0 and gpus < plan.total:
        return (
            f"the Ray cluster this run started has {gpus} GPU(s) but the roles need {plan.total} "
            f"({plan.arithmetic()}); shrink the shapes or run on a machine with more GPUs"
        )
    if gpus == 0 and cpus < plan.total:
        return (
            f"the Ray cluster this run started has no GPU and {cpus} CPU(s), but the roles need {plan.total} "
            f"actors of one CPU each ({plan.arithmetic()})"
        )
    return None


def cluster_line(plan: RolePlan, resources: Mapping[str, float] | None, address: str | None) -> str:
    """The driver's start line about capacity: checked for a cluster it started (``resources``),
    not for one it joined (``address``), and why not."""
    need = f"the roles need {plan.total} GPU(s) ({plan.arithmetic()})"
    if resources is None:
        return (
            f"joined the Ray cluster at {address}: its capacity is not checked ({need}); worker nodes may still "
            "be registering, so a shortfall seen now would prove nothing. The placement groups wait up to "
            "grid.collective_timeout_s for the GPUs"
        )
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    if not gpus:
        need = f"{plan.total} actors of one CPU each, every role on CPU ({plan.arithmetic()})"
        return f"started a local Ray cluster ({cpus} CPU(s), no GPU): capacity checked, the roles need {need}"
    return f"started a local Ray cluster ({cpus} CPU(s), {gpus} GPU(s)): capacity checked, {need}"
