"""Replicas of lane actors on Ray: each replica a placement group of one-device bundles packed on one
node (``STRICT_PACK``: a tensor-parallel group never spans nodes), one actor per bundle.

Shared by the roles whose replicas are several ranks of one engine: the OPD teacher pool
(``teacher/pool.py``) and tensor-parallel rollout replicas (``launch/rollout_lanes.py``). Each lane
actor class takes ``(tree, config_class, replica, lane, lanes)`` and has ``address()`` (its
replica's rendezvous, asked of lane 0), ``start(master)`` and ``close()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LaneGroups:
    """The lane actors (``lanes[replica][lane]``) and the placement group of each replica."""

    lanes: list[list[Any]] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)

    def actors(self) -> list[Any]:
        return [lane for replica in self.lanes for lane in replica]

    def place(
        self,
        actor_class: type,
        name_of: Callable[[int, int], str],
        namespace: str,
        *,
        tree: dict[str, Any],
        config_class: str,
        replicas: int,
        ranks: int,
        gpus: bool,
        timeout_s: float,
    ) -> None:
        """Place ``replicas`` replicas of ``ranks`` lanes of ``actor_class``, named ``name_of(replica,
        lane)`` in ``namespace``, and start them; returns once every lane started (within
        ``timeout_s`` per stage). What was placed before a failure is in ``self`` for ``kill``."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        unit = {"CPU": 1.0, "GPU": 1.0} if gpus else {"CPU": 1.0}
        for replica in range(replicas):
            group = placement_group([dict(unit) for _ in range(ranks)], strategy="STRICT_PACK")
            self.groups.append(group)
            ray.get(group.ready(), timeout=timeout_s)
            lanes = []
            for lane in range(ranks):
                strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=lane)
                actor: Any = ray.remote(actor_class).options(
                    num_cpus=1,
                    num_gpus=1 if gpus else 0,
                    scheduling_strategy=strategy,
                    name=name_of(replica, lane),
                    namespace=namespace,
                )
                lanes.append(actor.remote(tree, config_class, replica, lane, ranks))
            self.lanes.append(lanes)
        masters = ray.get([lanes[0].address.remote() for lanes in self.lanes], timeout=timeout_s)
        # every replica's engines load at once
        starts = [lane.start.remote(m) for lanes, m in zip(self.lanes, masters, strict=True) for lane in lanes]
        ray.get(starts, timeout=timeout_s)

    def close(self, timeout_s: float) -> None:
        """Let every lane shut its engine down (best effort: the actors are killed right after)."""
        import ray

        with contextlib.suppress(ray.exceptions.RayError):
            ray.get([a.close.remote() for a in self.actors()], timeout=min(timeout_s, 60.0))

    def kill(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors():
            ray.kill(actor)
        for group in self.groups:
            remove_placement_group(group)
