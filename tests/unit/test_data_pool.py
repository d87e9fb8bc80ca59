"""The data pool's bookkeeping without Ray (``rollout/data_pool.py``), on a store of plain dicts:
what is placed, what comes back, what the step holds and lets go; and its preflight rule and
config field.

A ``DictStore`` stands in for Ray's object store the way a second backend would: ``put`` returns a
new key, ``get_many`` looks keys up, and an object lives while some ledger holds its key
(``live_keys`` counts what a reference-counting store would still keep).
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from posttrain.config.loading import build_config
from posttrain.config.opd import OPDConfig
from posttrain.errors import ConfigError, TrainingError
from posttrain.preflight.grpo import grpo_preflight
from posttrain.preflight.opd import opd_preflight
from posttrain.rollout.base import Completion, RolloutBatch
from posttrain.rollout.data_pool import (
    HANDLE_KEY,
    PoolHandle,
    StepLedger,
    place_batch,
    resolve_batch,
    start_line,
    uses_pool,
)

POOL = "rl.data_pool.data_plane=ray_nixl_pool"


class DictStore:
    """Keys to pickled payloads (pickled, as Ray serializes them: a resolved value is a copy)."""

    def __init__(self) -> None:
        self.objects: dict[int, bytes] = {}
        self.puts = 0

    def put(self, value: Any) -> int:
        self.puts += 1
        self.objects[self.puts] = pickle.dumps(value)
        return self.puts

    def get_many(self, keys: list[int]) -> list[Any]:
        return [pickle.loads(self.objects[k]) for k in keys]


def _batch() -> RolloutBatch:
    experts = torch.arange(2 * 3 * 2, dtype=torch.int32).view(2, 3, 2)
    completions = [
        Completion(0, [5, 6, 2], [-0.5, -1.25, -0.125], "stop", "ab", {"head_ids": [[5, 1]] * 3}),
        Completion(0, [7], None, "length", "c", {"routed_experts": experts, "note": "kept"}),
    ]
    for c in completions[:1]:
        c.extra["head_logprobs"] = [[-0.5, -2.0]] * 3
    return RolloutBatch([[1, 2]], completions, weight_version=3, stats={"rollout/gen_s": 1.0})


def test_placed_completions_keep_only_small_fields_and_one_handle_each() -> None:
    store = DictStore()
    placed = place_batch(_batch(), store.put)
    assert store.puts == 2  # one object per completion, each placed once
    first, second = placed.completions
    assert (first.token_ids, first.logprobs, first.text, first.finish_reason) == ([], None, "ab", "stop")
    assert set(first.extra) == {HANDLE_KEY}
    assert set(second.extra) == {HANDLE_KEY, "note"}  # what the pool does not know stays by value
    assert first.extra[HANDLE_KEY] == PoolHandle(1, ("token_ids", "logprobs", "head_ids", "head_logprobs"))
    assert second.extra[HANDLE_KEY] == PoolHandle(2, ("token_ids", "logprobs", "routed_experts"))
    assert (placed.prompt_token_ids, placed.weight_version, placed.stats) == ([[1, 2]], 3, {"rollout/gen_s": 1.0})
    # what crosses actors by value is small: no payload list is left in the placed batch
    assert len(pickle.dumps(placed)) < len(pickle.dumps(_batch()))


def test_resolving_gives_back_the_exact_completions_and_their_refs() -> None:
    store, original = DictStore(), _batch()
    resolved, refs = resolve_batch(place_batch(original, store.put), store.get_many)
    assert refs == [1, 2]
    for got, want in zip(resolved.completions, original.completions, strict=True):
        assert (got.token_ids, got.logprobs, got.text, got.finish_reason) == (
            want.token_ids,
            want.logprobs,
            want.text,
            want.finish_reason,
        )
        assert set(got.extra) == set(want.extra)
        for key, value in want.extra.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got.extra[key], value) and got.extra[key].dtype == value.dtype
            else:
                assert got.extra[key] == value


def test_an_inline_batch_passes_unchanged_and_fetches_nothing() -> None:
    original = _batch()

    def no_fetch(keys: list[Any]) -> list[Any]:
        raise AssertionError(f"fetched {keys}")

    resolved, refs = resolve_batch(original, no_fetch)
    assert resolved is original and refs == []


def test_a_payload_of_other_fields_is_refused_by_name() -> None:
    store = DictStore()
    placed = place_batch(_batch(), store.put)
    store.objects[1] = pickle.dumps({"token_ids": [1]})
    with pytest.raises(
        TrainingError, match=r"returned \['token_ids'\] for a handle of fields \['token_ids', 'logprobs'"
    ):
        resolve_batch(placed, store.get_many)


def test_the_ledger_holds_a_step_and_lets_it_go_at_the_commit() -> None:
    """Over 100 steps of two batches each (a training draw and an evaluation draw) the ledger never
    holds more than one step's refs, and releases every ref it was given."""
    store, ledger = DictStore(), StepLedger()
    live_after_release = []
    for _ in range(100):
        for _draw in range(2):
            _, refs = resolve_batch(place_batch(_batch(), store.put), store.get_many)
            ledger.hold(refs)
        assert ledger.live == 4
        assert ledger.release() == 4
        live_after_release.append(ledger.live)
    assert live_after_release == [0] * 100
    assert ledger.released_total == store.puts == 400
    assert ledger.release() == 0  # a second release (the proxy's close) has nothing left


def test_the_pool_is_refused_under_the_local_backend_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    errors = grpo_preflight(build_config(None, [POOL])).errors
    assert any(
        e.startswith("rl.data_pool.data_plane=ray_nixl_pool needs grid.backend=ray")
        and "use rl.data_pool.data_plane=inline" in e
        for e in errors
    ), errors
    assert not any("data_pool" in e for e in grpo_preflight(build_config(None, [])).errors)
    opd = opd_preflight(build_config(None, [POOL], OPDConfig)).errors
    assert any(e.startswith("rl.data_pool.data_plane=ray_nixl_pool needs grid.backend=ray") for e in opd), opd


def test_the_field_defaults_to_inline_and_names_its_values() -> None:
    cfg = build_config(None, [])
    assert cfg.rl.data_pool.data_plane == "inline" and not uses_pool(cfg)
    pooled = build_config(None, [POOL, "grid.backend=ray", "grid.gpu_placement=disaggregated"])
    assert uses_pool(pooled)
    line = start_line(pooled)
    assert line.startswith("rl.data_pool.data_plane=ray_nixl_pool: NIXL unavailable (")
    assert line.endswith("pooling through Ray's object store")
    assert "nothing is pooled" in start_line(build_config(None, [POOL, "grid.backend=ray"]))
    with pytest.raises(
        ConfigError, match=r"rl.data_pool.data_plane='nixl': Input should be 'inline' or 'ray_nixl_pool'"
    ):
        build_config(None, ["rl.data_pool.data_plane=nixl"])
