"""The ``rl.data_pool`` section: how large per-sample trajectory fields move between Ray actors.

``inline`` (the default) is the plain path: a rollout replica returns its completions by value.
``ray_nixl_pool`` places each completion's large per-token fields once in the producing actor's
store and passes handles instead (``rollout/data_pool.py``; docs/distributed.md, "Data pool"). NIXL
is not available to the pool in this build: it always pools through Ray's object store and says so
in the log at start. The pool needs ``grid.backend=ray`` (``preflight/grid.py``).
"""

from __future__ import annotations

from typing import Literal

from posttrain.config.section import Section


class DataPoolConfig(Section):
    """Where large trajectory fields live between the actor that made them and the one that trains."""

    data_plane: Literal["inline", "ray_nixl_pool"] = "inline"
    """``inline``: a disaggregated rollout replica returns every completion by value (today's path).
    ``ray_nixl_pool``: the replica puts each completion's token ids, sampler logprobs, sampler top-k
    head and routing trace once into Ray's object store (NIXL is not available to the pool here; the
    start-up log says so) and returns handles; the policy rank resolves them and drops them after the
    step's optimizer commit, so Ray frees them. Same arithmetic as ``inline``. Needs
    ``grid.backend=ray``; under ``grid.gpu_placement=colocated`` nothing crosses actors and the pool
    has nothing to do."""
