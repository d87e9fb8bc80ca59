"""The data pool (``rl.data_pool.data_plane=ray_nixl_pool``): large per-sample fields by handle.

A disaggregated rollout replica (``launch/ray_backend.py``'s ``RolloutActor``) puts each completion's
large per-token fields (``POOLED_FIELDS``: token ids, sampler logprobs, and the ``Completion.extra``
entries ``POOLED_EXTRA``: the sampler's top-k head, the MoE routing trace) once into a store, and
returns the completions with a ``PoolHandle`` in their place (``place_batch``). The policy rank's
``RolloutProxy`` resolves the handles in one fetch (``resolve_batch``) and keeps them in a
``StepLedger`` until the step's optimizer commit (its weight sync), then drops them, and the store
frees the payloads. Nothing is copied but the payloads, so training is bitwise that of ``inline``.

The store is Ray's object store (``ray.put`` in the producing actor: the object is owned there and
borrowed by the policy rank); NIXL is not available to the pool in this build, which the driver
says at start (``start_line``). The functions below take the store's ``put`` / ``get`` as arguments,
so the bookkeeping is plain code (``tests/unit/test_data_pool.py`` runs it on a dict).

What is not pooled: the completion's text, finish reason and prompt index (small, and the reward
reads them), the prompts, and the teacher's top-k, which the teacher computes inside the policy
rank that trains on it (``loop/opd.py``): it never crosses actors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from posttrain.errors import TrainingError
from posttrain.rollout.base import Completion, RolloutBatch

POOLED_FIELDS = ("token_ids", "logprobs")
POOLED_EXTRA = ("head_ids", "head_logprobs", "routed_experts")
HANDLE_KEY = "data_pool_handle"
"""The ``Completion.extra`` key of a placed completion's handle."""

# Test probe: after each release the owner rank appends the object store's object count to this file;
# every PROBE_SETTLE_EVERY-th version it first waits (up to PROBE_SETTLE_S) for the store to empty.
PROBE_ENV = "POSTTRAIN_TEST_DATA_POOL_PROBE"
PROBE_SETTLE_EVERY, PROBE_SETTLE_S = 10, 5.0

Put = Callable[[Any], Any]
GetMany = Callable[[list[Any]], list[Any]]


@dataclass(frozen=True)
class PoolHandle:
    """One placed completion: ``ref`` (the store's handle) holds the fields named in ``fields``."""

    ref: Any
    fields: tuple[str, ...]


def uses_pool(cfg: Any) -> bool:
    """Whether this run pools trajectory fields (``rl.data_pool.data_plane=ray_nixl_pool``)."""
    return bool(cfg.rl.data_pool.data_plane == "ray_nixl_pool")


def nixl_unavailable_reason() -> str:
    """Why the pool cannot move payloads through NIXL here (it falls back to Ray's object store)."""
    if importlib.util.find_spec("nixl") is None:
        return "the nixl package is not installed"
    return "the pool's NIXL path is not built; nixl is used for weight sync only"


def start_line(cfg: Any) -> str:
    """The driver's log line at start for a pooled run."""
    line = (
        f"rl.data_pool.data_plane=ray_nixl_pool: NIXL unavailable ({nixl_unavailable_reason()}), "
        "pooling through Ray's object store"
    )
    if cfg.grid.gpu_placement != "disaggregated":
        line += " (grid.gpu_placement=colocated: trajectories never leave their policy rank, nothing is pooled)"
    return line


def place_batch(batch: RolloutBatch, put: Put) -> RolloutBatch:
    """The producer's side: every completion's large fields put once (one object per completion),
    the completion keeping its small fields and a ``PoolHandle`` (``token_ids`` empty and ``logprobs``
    None until resolved)."""
    placed = []
    for c in batch.completions:
        payload: dict[str, Any] = {"token_ids": c.token_ids, "logprobs": c.logprobs}
        payload.update({k: c.extra[k] for k in POOLED_EXTRA if k in c.extra})
        extra = {k: v for k, v in c.extra.items() if k not in POOLED_EXTRA}
        extra[HANDLE_KEY] = PoolHandle(put(payload), tuple(payload))
        placed.append(replace(c, token_ids=[], logprobs=None, extra=extra))
    return replace(batch, completions=placed)


def _restore(c: Completion, handle: PoolHandle, payload: Any) -> Completion:
    if not isinstance(payload, dict) or set(payload) != set(handle.fields):
        got = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise TrainingError(f"the data pool returned {got} for a handle of fields {list(handle.fields)}")
    extra = {k: v for k, v in c.extra.items() if k != HANDLE_KEY}
    extra.update({k: payload[k] for k in POOLED_EXTRA if k in payload})
    return replace(c, token_ids=payload["token_ids"], logprobs=payload["logprobs"], extra=extra)


def resolve_batch(batch: RolloutBatch, get_many: GetMany) -> tuple[RolloutBatch, list[Any]]:
    """The consumer's side: the completions with their fields back (one fetch for the batch), and
    the handles' refs, which the caller keeps alive until the step commits (``StepLedger``).
    Completions without a handle (an ``inline`` replica) pass unchanged."""
    handles = [c.extra.get(HANDLE_KEY) for c in batch.completions]
    refs = [h.ref for h in handles if isinstance(h, PoolHandle)]
    if not refs:
        return batch, []
    payloads = iter(get_many(refs))
    completions = [
        _restore(c, h, next(payloads)) if isinstance(h, PoolHandle) else c
        for c, h in zip(batch.completions, handles, strict=True)
    ]
    return replace(batch, completions=completions), refs


class StepLedger:
    """The refs a policy rank holds for the current step. ``release`` (after the optimizer commit)
    drops them: once no one holds a ref, the store frees its object."""

    def __init__(self) -> None:
        self.refs: list[Any] = []
        self.released_total = 0

    def hold(self, refs: list[Any]) -> None:
        self.refs.extend(refs)

    @property
    def live(self) -> int:
        return len(self.refs)

    def release(self) -> int:
        """Drop every held ref; returns how many."""
        n = len(self.refs)
        self.refs = []  # the last reference to each ref object: Ray's reference count drops here
        self.released_total += n
        return n


def ray_put(value: Any) -> Any:
    import ray

    return ray.put(value)


def ray_getter(timeout_s: float) -> GetMany:
    """``get_many`` through Ray, bounded by ``timeout_s``."""

    def get_many(refs: list[Any]) -> list[Any]:
        import ray

        values: list[Any] = ray.get(refs, timeout=timeout_s)
        return values

    return get_many


def probe_store(version: int, released: int, *, final: bool = False, settle_s: float = 0.0) -> None:
    """With ``PROBE_ENV`` set (tests), append the object store's live object count and bytes after a
    release: what the leak test reads. Ray frees unreferenced objects in batches (about once a
    second), so a count read right after a release still holds the last steps' objects; with
    ``settle_s`` the probe waits up to that long for the store to empty first."""
    path = os.environ.get(PROBE_ENV)
    if not path:
        return
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    if version % PROBE_SETTLE_EVERY == 0:
        settle_s = max(settle_s, PROBE_SETTLE_S)
    deadline = time.monotonic() + settle_s
    while True:
        stats = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address)).store_stats
        if stats.num_local_objects == 0 or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    row = {"version": version, "released": released, "final": final, "settled": settle_s > 0}
    row["objects"] = stats.num_local_objects
    row["bytes"] = stats.object_store_bytes_used
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
