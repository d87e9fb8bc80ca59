"""The ``nixl`` weight-sync transport (``distributed/nixl_sync.py``) over NIXL's UCX backend on host
(DRAM) memory: a real transfer between two processes, bitwise, at several bucket sizes; the
replica's coverage check refusing before any byte moves; a transfer that breaks off after one
bucket; the probe's checksum against a straightforward reference; and the replica actor's
guarantees (``RolloutActor``: no version stamped on a broken-off transfer, the replica poisoned;
nothing poisoned when coverage fails; the version stamped and the weights in after a complete one).

Skipped, with the reason, where the nixl package or its native build is not installed.
"""

from __future__ import annotations

import importlib.util
import io
import re
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from weight_sets import mixed_weight_set

from posttrain.config.loading import build_config
from posttrain.distributed import weight_sync
from posttrain.distributed.nixl_sync import (
    NixlReceiver,
    NixlSender,
    check_coverage,
    checksum,
    missing_library,
)
from posttrain.errors import TrainingError
from posttrain.preflight.common import check_weight_sync
from posttrain.preflight.findings import Findings

MISSING = missing_library()
needs_nixl = pytest.mark.skipif(MISSING is not None, reason=f"NIXL cannot run here: {MISSING}")
CPU = torch.device("cpu")


def _layout(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {name: (shape, dtype) for name, shape, dtype in weight_sync.describe(tensors)}


def test_checksum_matches_a_reference_and_sees_moved_words() -> None:
    buffer = torch.arange(48, dtype=torch.uint8)  # six little-endian int64 words
    assert checksum(buffer) == zlib.crc32(bytes(range(48)))  # host memory: CRC-32
    words = [int.from_bytes(bytes(range(8 * i, 8 * i + 8)), "little") for i in range(6)]
    assert checksum(buffer, host=False) == sum(w * (i + 1) for i, w in enumerate(words)) % 2**64
    swapped = torch.cat([buffer[8:16], buffer[:8], buffer[16:]])
    for host in (True, False):
        assert checksum(swapped, host=host) != checksum(buffer, host=host)
    assert checksum(torch.empty(0, dtype=torch.uint8), host=False) == 0
    # the word sum wraps as mod 2**64, past int64's range
    top = torch.full((16,), 255, dtype=torch.uint8)  # two words of -1
    assert checksum(top, host=False) == (-1 * 1 + -1 * 2) % 2**64


def test_coverage_names_what_is_missing_extra_or_different() -> None:
    sent = mixed_weight_set()
    meta = weight_sync.describe(sent)
    check_coverage(meta, _layout(sent))  # the same model: covered
    layout = _layout(sent)
    layout["lm_head.weight"] = ((5, 7), "float32")
    del layout["scalar"]
    layout["steps"] = ((3, 2), "int64")
    with pytest.raises(TrainingError) as err:
        check_coverage(meta, layout)
    message = str(err.value)
    assert "1 of the replica's tensor(s) not sent (first: ['lm_head.weight'])" in message
    assert "1 sent tensor(s) the replica does not have (first: ['scalar'])" in message
    assert "steps: sent (2, 3) int64, the replica has (3, 2) int64" in message
    dtype_only = _layout(sent) | {"layer.0.bias": ((3,), "float32")}
    with pytest.raises(
        TrainingError, match=re.escape("layer.0.bias: sent (3,) bfloat16, the replica has (3,) float32")
    ):
        check_coverage(meta, dtype_only)


@needs_nixl
def test_a_coverage_failure_refuses_before_any_buffer_is_registered() -> None:
    receiver = NixlReceiver()
    wrong = _layout(mixed_weight_set()) | {"big": ((41,), "float64")}
    with pytest.raises(TrainingError, match="do not cover the rollout replica's model"):
        receiver.prepare(weight_sync.describe(mixed_weight_set()), CPU, 160, wrong)
    assert receiver.buffer is None and receiver.destination is None


def _replica(bucket_bytes: int, version: int, to_owner: Any, to_test: Any) -> None:
    """The replica's process: prepare, hand the destination over, wait for the version."""
    receiver = NixlReceiver()
    meta = weight_sync.describe(mixed_weight_set())
    to_owner.put(receiver.prepare(meta, CPU, bucket_bytes, _layout(mixed_weight_set())))
    try:
        got = receiver.wait(meta, version, min_bandwidth_gbps=1.0, probe=True, floor_s=2.0)
        payload = io.BytesIO()  # as bytes: no shared-memory handle that outlives this process
        torch.save({k: v.clone() for k, v in got.items()}, payload)
        to_test.put(payload.getvalue())
    except TrainingError as err:
        to_test.put(str(err))


def _run_pair(bucket_bytes: int, first_buckets: int | None = None) -> Any:
    ctx = mp.get_context("spawn")
    to_owner, to_test = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_replica, args=(bucket_bytes, 3, to_owner, to_test))
    proc.start()
    try:
        destination = to_owner.get(timeout=60)
        sender = NixlSender()
        sent = mixed_weight_set()
        sender.send(
            sent, weight_sync.describe(sent), destination, 3, bucket_bytes=bucket_bytes, first_buckets=first_buckets
        )
        result = to_test.get(timeout=60)
        if isinstance(result, bytes):
            result = torch.load(io.BytesIO(result))
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0
    return result


@needs_nixl
@pytest.mark.parametrize("bucket_bytes", [160, 1, weight_sync.BUCKET_BYTES])
def test_nixl_writes_arrive_bitwise_between_two_processes(bucket_bytes: int) -> None:
    got = _run_pair(bucket_bytes)
    sent = mixed_weight_set()
    assert isinstance(got, dict) and list(got) == list(sent)
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@needs_nixl
def test_a_transfer_that_breaks_off_after_one_bucket_is_refused() -> None:
    # buckets of 160 bytes: [embed, bias], [big], [scalar, empty, steps, strided]; only the first is sent
    got = _run_pair(160, first_buckets=1)
    assert isinstance(got, str)
    assert "the nixl transfer of version 3 broke off: 1 of 3 bucket(s) landed, bucket 1 did not" in got


# -- the replica actor's guarantees ---------------------------------------------------------------


def _actor(model_dir: str, tmp_path: Path, overrides: Callable[..., list[str]]) -> Any:
    from posttrain.launch.ray_backend import RolloutActor

    cfg = build_config(None, overrides(model_dir, tmp_path, "nixl_actor"))
    return RolloutActor(cfg.model_dump(mode="json"), "posttrain.config.schema:GRPOConfig")


def _sync(actor: Any, sender: NixlSender, new: dict[str, torch.Tensor], version: int, **send: Any) -> Any:
    """One sync as ``RolloutProxy`` runs it: ``prepare_nixl``, then the actor waits (here in a thread,
    as the actor's own call) while the owner writes. Returns the actor's result or its exception."""
    meta = weight_sync.describe(new)
    destination = actor.prepare_nixl(meta, 4096)
    result: list[Any] = []

    def receive() -> None:
        try:
            result.append(actor.receive_nixl(meta, version, 1.0, True))
        except TrainingError as err:
            result.append(err)

    thread = threading.Thread(target=receive)
    thread.start()
    sender.send(new, meta, destination, version, bucket_bytes=4096, **send)
    thread.join(timeout=60)
    return result[0]


@needs_nixl
def test_the_replica_actor_stamps_only_a_complete_transfer(
    tiny_model_dir: str, run_overrides: Callable[..., list[str]], tmp_path: Path
) -> None:
    actor = _actor(tiny_model_dir, tmp_path, run_overrides)
    model = actor.replica.engine.model
    new = {k: v.detach().clone() + 1.0 for k, v in model.state_dict().items()}
    meta = weight_sync.describe(new)
    sender = NixlSender()

    # a list that does not cover the model: refused before any byte moves, nothing poisoned
    renamed = [("model.renamed" if i == 0 else n, s, d) for i, (n, s, d) in enumerate(meta)]
    with pytest.raises(TrainingError, match="do not cover the rollout replica's model"):
        actor.prepare_nixl(renamed, 4096)
    assert actor.state.poisoned is None and actor.state.weight_version == 0

    # complete: the weights are the sent ones and version 1 is stamped
    assert _sync(actor, sender, new, 1) == 1
    assert actor.state.weight_version == 1 and actor.replica.engine.state.weight_version == 1
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, new[name]), name

    # broken off after one bucket (the actor waits out the 10 s floor): no version 2, and the
    # replica refuses to sample
    assert len(weight_sync.plan_buckets(meta, 4096)) > 2
    broken = _sync(actor, sender, new, 2, first_buckets=1)
    assert isinstance(broken, TrainingError)
    assert "the nixl transfer of version 2 broke off: 1 of" in str(broken)
    assert actor.state.weight_version == 1 and actor.replica.engine.state.weight_version == 1
    with pytest.raises(TrainingError, match="the rollout replica cannot sample: the weight transfer of version 2"):
        actor.generate(0, [[1, 2, 3]], 1, None)
    sender.close()
    actor.close()


@needs_nixl
def test_the_probe_refuses_a_bucket_whose_bytes_changed_after_landing() -> None:
    # both ends driven in turn by this thread: NIXL's progress threads move what nobody polls
    receiver, sender = NixlReceiver(progress_thread=True), NixlSender(progress_thread=True)
    sent = mixed_weight_set()
    meta = weight_sync.describe(sent)
    for probe in (True, False):
        destination = receiver.prepare(meta, CPU, 160, _layout(sent))
        sender.send(sent, meta, destination, 5, bucket_bytes=160, probe=probe)
        assert receiver.buffer is not None
        receiver.buffer[200] ^= 1  # one bit of bucket 1 ("big", bytes 160..480) flipped in place
        if probe:
            with pytest.raises(TrainingError, match="bucket 1 of version 5 landed with other bytes"):
                receiver.wait(meta, 5, min_bandwidth_gbps=1.0, probe=True)
        else:  # without the probe the flipped bit goes through: what the probe is for
            got = receiver.wait(meta, 5, min_bandwidth_gbps=1.0, probe=False)
            assert not torch.equal(got["big"], sent["big"]) and torch.equal(got["steps"], sent["steps"])
    sender.close()
    receiver.close()


@needs_nixl
def test_a_replica_that_registers_a_new_buffer_still_receives_bitwise() -> None:
    """A new list (here: another bucket size) makes the replica register a new buffer, and the owner
    load the replica's new metadata."""
    receiver, sender = NixlReceiver(progress_thread=True), NixlSender(progress_thread=True)
    sent = mixed_weight_set()
    meta = weight_sync.describe(sent)
    for version, bucket_bytes in enumerate((160, 1, 160), start=1):
        destination = receiver.prepare(meta, CPU, bucket_bytes, _layout(sent))
        sender.send(sent, meta, destination, version, bucket_bytes=bucket_bytes)
        got = receiver.wait(meta, version, min_bandwidth_gbps=1.0, probe=True)
        assert all(torch.equal(got[name], tensor) for name, tensor in sent.items()), bucket_bytes
    sender.close()
    receiver.close()


# -- preflight ------------------------------------------------------------------------------------

DISAGGREGATED_NIXL = ["grid.backend=ray", "grid.gpu_placement=disaggregated", "rl.weight_sync_transport=nixl"]


def _weight_sync_errors(overrides: list[str]) -> list[str]:
    out = Findings()
    check_weight_sync(build_config(None, overrides), out)
    return out.errors


@needs_nixl
def test_preflight_accepts_nixl_on_disaggregated_replicas() -> None:
    assert _weight_sync_errors(DISAGGREGATED_NIXL) == []


def test_preflight_refuses_nixl_without_a_native_build_or_on_colocated_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    colocated = _weight_sync_errors(["grid.backend=ray", "rl.weight_sync_transport=nixl"])
    assert colocated == [
        "rl.weight_sync_transport=nixl applies to grid.gpu_placement=disaggregated; colocated engines receive "
        "the weights in their own process: use inprocess"
    ]
    real = importlib.util.find_spec
    builds = {"nixl_cu12", "nixl_cu13", "nixl_rocm"}
    # the meta package alone: its Python API, no native build to move bytes with
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "nixl" else None if name in builds else real(name, *a),
    )
    (error,) = _weight_sync_errors(DISAGGREGATED_NIXL)
    assert "the nixl package has no native build installed (one of nixl-cu12, nixl-cu13, nixl-rocm)" in error
    assert missing_library() == "the nixl package has no native build installed (nixl-cu12, nixl-cu13 or nixl-rocm)"


def test_preflight_refuses_a_nixl_build_for_another_cuda_than_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    from posttrain.preflight import common

    real = importlib.util.find_spec
    builds = {"nixl": object(), "nixl_cu12": object(), "nixl_cu13": None}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: builds[name] if name in builds else real(name, *a)
    )
    monkeypatch.setattr(common, "_torch_cuda_major", lambda: 13)
    assert _weight_sync_errors(DISAGGREGATED_NIXL) == [
        "rl.weight_sync_transport=nixl: torch is built for CUDA 13 but nixl-cu13 is not installed: "
        "pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1"
    ]
    monkeypatch.setattr(common, "_torch_cuda_major", lambda: 12)  # the build that is there
    assert _weight_sync_errors(DISAGGREGATED_NIXL) == []
    monkeypatch.setattr(common, "_torch_cuda_major", lambda: None)  # CPU torch: any build
    assert _weight_sync_errors(DISAGGREGATED_NIXL) == []
