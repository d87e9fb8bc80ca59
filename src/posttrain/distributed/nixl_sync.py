"""NIXL weight sync between a policy rank and a disaggregated rollout replica
(``rl.weight_sync_transport=nixl``).

The same packed buckets as the ``nccl`` transport (``weight_sync.plan_buckets``: consecutive tensors,
each at a 16-byte-aligned offset, both sides derive the boundaries from the same ``describe`` list),
moved by NIXL one-sided WRITEs instead of broadcasts:

* The replica (``NixlReceiver``) first checks that the owner's list covers its own model exactly
  (every name, shape and dtype; ``check_coverage``), *before* any byte moves, then registers one
  destination buffer holding every bucket at its offset (kept, and registered once, while the list
  stays the same) and hands the owner its agent metadata and the buffer's address (``Destination``).
* The owner (``NixlSender``) packs each bucket into one of two registered staging slots and WRITEs it
  to its offset in the replica's buffer; the write carries a notification ``version:bucket:checksum``
  that NIXL delivers once the bytes landed. While one slot is on the wire the next is packed (two
  buckets in flight at most, bounding the owner's extra memory as the nccl path does).
* The replica waits for every bucket's notification, each within ``10 s + bytes / min bandwidth``
  (``rl.weight_sync_min_bandwidth_gbps``); a bucket that does not come is a broken-off transfer
  (``TrainingError``; the caller poisons the replica and stamps nothing). With the probe on
  (``rl.weight_sync_probe``) it re-reads every landed bucket and compares its checksum with the
  owner's before it hands the tensors on, so a version is stamped only on bytes known to be the
  owner's.

Tensors on a CUDA device are registered as VRAM (GPU-direct where UCX has a path), CPU tensors as
DRAM: the CPU tests run NIXL's UCX backend over host memory. Zero-byte buckets move nothing but
still send their notification, so the count of buckets is the same on both sides.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import time
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from posttrain.distributed.weight_sync import (
    BUCKET_BYTES,
    TensorMeta,
    _nbytes,
    _offsets,
    plan_buckets,
)
from posttrain.errors import TrainingError

BACKEND = "UCX"
FLOOR_S = 10.0  # seconds every bucket may take on top of its bytes at the minimum bandwidth
_POLL_S = 0.0005
_CHECKSUM_WORDS = 1 << 22  # int64 words per checksum chunk: bounds the positions tensor to 32 MiB
_MASK = (1 << 64) - 1
_names = itertools.count()

Layout = dict[str, tuple[tuple[int, ...], str]]


def missing_library() -> str | None:
    """Why NIXL cannot be used here (``None`` when its Python API and a native build are installed)."""
    if importlib.util.find_spec("nixl") is None:
        return "the nixl package is not installed (pip install 'posttrain[nixl]')"
    if not any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl_cu13", "nixl_rocm")):
        return "the nixl package has no native build installed (nixl-cu12, nixl-cu13 or nixl-rocm)"
    try:  # the meta package picks the build for the CUDA it detects, which may not be the one installed
        import nixl._api  # noqa: F401
    except ImportError as err:
        return f"import nixl fails: {err}"
    return None


def _agent(role: str, progress_thread: bool) -> Any:
    """A NIXL agent with the UCX backend; its name is unique to this process."""
    reason = missing_library()
    if reason is not None:
        raise TrainingError(f"rl.weight_sync_transport=nixl: {reason}")
    from nixl._api import nixl_agent, nixl_agent_config

    # By default no progress thread: both ends poll while a sync is on (check_xfer_state,
    # get_new_notifs), which drives UCX; a spinning thread per agent cost 3x the sync time on a
    # 2-core CPU machine (benchmarks/weight_sync_transports.py: 1.37 s against 0.45 s for 651 MB).
    # Two agents driven in turn by one thread (tests) need it: nobody polls the idle one.
    config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[BACKEND])
    agent = nixl_agent(f"posttrain-{role}-{os.getpid()}-{next(_names)}", config)
    if BACKEND not in agent.backends:
        raise TrainingError(f"rl.weight_sync_transport=nixl: NIXL's {BACKEND} backend did not start on this node")
    return agent


def _pack_into(slot: torch.Tensor, entries: list[TensorMeta], tensors: list[torch.Tensor]) -> None:
    """``weight_sync``'s packed layout written straight into a registered slot (no extra buffer)."""
    offsets, _ = _offsets(entries)
    for tensor, offset in zip(tensors, offsets, strict=True):
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        slot[offset : offset + flat.numel()].copy_(flat)


def _mem_type(tensor: torch.Tensor) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


def bucket_deadline_s(nbytes: int, min_bandwidth_gbps: float, floor_s: float = FLOOR_S) -> float:
    """How long one bucket of ``nbytes`` may take before the transfer counts as broken off."""
    return floor_s + nbytes / (min_bandwidth_gbps * 1e9)


def checksum(buffer: torch.Tensor, host: bool | None = None) -> int:
    """A packed bucket's checksum. ``host`` (default: the buffer is not on a GPU): CRC-32 of its bytes
    (zlib, ~1 GB/s on one CPU core; a GPU buffer is copied to the host first). Else a position-weighted
    sum of its 64-bit words mod 2**64, computed on the buffer's device (a pass of GPU kernels; slow on
    a CPU). Either way any changed, missing or moved byte changes it (not a cryptographic hash: it
    guards the transfer, not against an adversary). Bucket sizes are multiples of 16 bytes, so the
    words are whole. Both ends pick the kind from the replica's memory (``Destination.mem_type``)."""
    if host if host is not None else not buffer.is_cuda:
        return zlib.crc32(buffer.detach().cpu().numpy().data)
    words = buffer.view(torch.int64)
    total = 0
    for start in range(0, words.numel(), _CHECKSUM_WORDS):
        chunk = words[start : start + _CHECKSUM_WORDS]
        positions = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=chunk.device)
        total = (total + int((chunk * positions).sum())) & _MASK  # int64 arithmetic wraps, as mod 2**64
    return total


def check_coverage(meta: list[TensorMeta], layout: Layout) -> None:
    """The owner's list must name every tensor of the replica's model with its shape and dtype, and
    nothing else: raised (``TrainingError``) before any byte of the version moves."""
    sent = {name: (tuple(shape), dtype) for name, shape, dtype in meta}
    missing = sorted(set(layout) - set(sent))
    extra = sorted(set(sent) - set(layout))
    wrong = [
        f"{name}: sent {sent[name][0]} {sent[name][1]}, the replica has {layout[name][0]} {layout[name][1]}"
        for name in sorted(set(layout) & set(sent))
        if (tuple(layout[name][0]), layout[name][1]) != sent[name]
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} of the replica's tensor(s) not sent (first: {missing[:3]})")
    if extra:
        problems.append(f"{len(extra)} sent tensor(s) the replica does not have (first: {extra[:3]})")
    if wrong:
        problems.append(f"{len(wrong)} with another shape or dtype (first: {wrong[0]})")
    if problems:
        raise TrainingError(
            "rl.weight_sync_transport=nixl: the policy's weights do not cover the rollout replica's model: "
            + "; ".join(problems)
            + "; the policy and the rollout model must have the same architecture and dtype"
        )


@dataclasses.dataclass(frozen=True)
class Destination:
    """What the owner needs to WRITE into a replica: its agent, and its buffer (address, bytes,
    device id, NIXL memory type) with each bucket's offset in it. Picklable (a Ray call's result)."""

    agent_name: str
    agent_metadata: bytes
    address: int
    nbytes: int
    device_id: int
    mem_type: str
    bucket_offsets: tuple[int, ...]


class NixlReceiver:
    """The replica's side: coverage check, one registered destination buffer, the wait for every bucket.
    ``progress_thread``: NIXL's own (only when nobody polls this agent during a transfer)."""

    def __init__(self, progress_thread: bool = False) -> None:
        self.agent = _agent("replica", progress_thread)
        self.buffer: torch.Tensor | None = None
        self.registered: Any = None
        self.key: tuple[Any, ...] | None = None
        self.destination: Destination | None = None
        self.bucket_bytes = BUCKET_BYTES

    def prepare(
        self, meta: list[TensorMeta], device: torch.device, bucket_bytes: int, layout: Layout | None
    ) -> Destination:
        """Check ``meta`` against ``layout`` (the replica model's tensors; ``None``: the engine checks
        names itself when it loads), then (re)build the destination buffer when the list changed."""
        if layout is not None:
            check_coverage(meta, layout)
        self.agent.get_new_notifs()  # drop anything left of an earlier version
        key = (tuple((n, tuple(s), d) for n, s, d in meta), str(device), bucket_bytes)
        if key != self.key or self.destination is None:
            self._allocate(meta, device, bucket_bytes)
            self.key = key
        assert self.destination is not None
        return self.destination

    def _allocate(self, meta: list[TensorMeta], device: torch.device, bucket_bytes: int) -> None:
        self._release()
        starts, end = [], 0
        for bucket in plan_buckets(meta, bucket_bytes):
            starts.append(end)
            end += _offsets([meta[i] for i in bucket])[1]
        # one byte at least: NIXL cannot register an empty region
        self.buffer = torch.empty(max(end, 16), dtype=torch.uint8, device=device)
        self.registered = self.agent.register_memory(self.buffer)
        self.bucket_bytes = bucket_bytes
        self.destination = Destination(
            self.agent.name,
            self.agent.get_agent_metadata(),
            self.buffer.data_ptr(),
            end,
            max(self.buffer.get_device(), 0),
            _mem_type(self.buffer),
            tuple(starts),
        )

    def wait(
        self,
        meta: list[TensorMeta],
        version: int,
        *,
        min_bandwidth_gbps: float,
        probe: bool,
        floor_s: float = FLOOR_S,
    ) -> dict[str, torch.Tensor]:
        """Every bucket of ``version``, as views of the destination buffer (valid until the next
        ``prepare``). Raises ``TrainingError`` when a bucket does not land in time, or (``probe``)
        when a landed bucket's checksum is not the owner's."""
        assert self.buffer is not None and self.destination is not None, "prepare() first"
        buckets = plan_buckets(meta, self.bucket_bytes)
        out: dict[str, torch.Tensor] = {}
        # each bucket is checked as it lands, while the next one is still on the wire
        for k, owner_sum in self._landed(meta, buckets, version, min_bandwidth_gbps, floor_s):
            entries = [meta[i] for i in buckets[k]]
            offsets, size = _offsets(entries)
            start = self.destination.bucket_offsets[k]
            landed = self.buffer[start : start + size]
            if probe and checksum(landed) != owner_sum:
                raise TrainingError(
                    f"rl.weight_sync_probe: bucket {k} of version {version} landed with other bytes than the "
                    "policy sent (checksum mismatch)"
                )
            for (name, shape, dtype), offset in zip(entries, offsets, strict=True):
                n = _nbytes(shape, dtype)
                out[name] = landed[offset : offset + n].view(getattr(torch, dtype)).reshape(shape)
        return {name: out[name] for name, _, _ in meta}  # in the owner's order

    def _landed(
        self,
        meta: list[TensorMeta],
        buckets: list[list[int]],
        version: int,
        min_bandwidth_gbps: float,
        floor_s: float,
    ) -> Iterator[tuple[int, int]]:
        """``(bucket, the owner's checksum)`` for every bucket of ``version`` in order, as the
        notifications its writes carry come in; raises once one is later than its deadline."""
        sums: dict[int, int] = {}

        def deadline_of(k: int) -> float:
            size = _offsets([meta[i] for i in buckets[k]])[1]
            return time.monotonic() + bucket_deadline_s(size, min_bandwidth_gbps, floor_s)

        # the first bucket also waits for the owner to connect and pack it
        deadline = deadline_of(0) + floor_s if buckets else 0.0
        for k in range(len(buckets)):
            while k not in sums:
                for messages in self.agent.get_new_notifs().values():
                    for message in messages:
                        tag, bucket, value = message.decode().split(":")
                        if int(tag) == version:
                            sums[int(bucket)] = int(value)
                if k in sums:
                    break
                if time.monotonic() > deadline:
                    raise TrainingError(
                        f"the nixl transfer of version {version} broke off: {k} of {len(buckets)} bucket(s) "
                        f"landed, bucket {k} did not within its deadline ({floor_s:g} s + its bytes at "
                        f"rl.weight_sync_min_bandwidth_gbps={min_bandwidth_gbps})"
                    )
                time.sleep(_POLL_S)
            yield k, sums[k]
            if k + 1 < len(buckets):
                deadline = deadline_of(k + 1)

    def _release(self) -> None:
        if self.registered is not None:
            self.agent.deregister_memory(self.registered)
        self.registered, self.buffer, self.destination, self.key = None, None, None, None

    def close(self) -> None:
        """Deregister the destination buffer (the agent goes with the process)."""
        self._release()


class NixlSender:
    """The owner's side: two registered staging slots, one WRITE (with its notification) per bucket.
    ``progress_thread``: as for ``NixlReceiver``."""

    def __init__(self, progress_thread: bool = False) -> None:
        self.agent = _agent("owner", progress_thread)
        self.slots: torch.Tensor | None = None
        self.registered: Any = None
        # the replica's agent name -> (the metadata loaded, the name NIXL loaded it as)
        self.remotes: dict[str, tuple[bytes, str]] = {}

    def _staging(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two slots of at least ``size`` bytes on ``device``, registered once (again when they grow)."""
        size = max(size, 16)
        if self.slots is None or self.slots.numel() < 2 * size or self.slots.device != device:
            self.close()
            self.slots = torch.empty(2 * size, dtype=torch.uint8, device=device)
            self.registered = self.agent.register_memory(self.slots)
        half = self.slots.numel() // 2
        return self.slots[:half], self.slots[half:]

    def send(
        self,
        named_tensors: dict[str, torch.Tensor],
        meta: list[TensorMeta],
        destination: Destination,
        version: int,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        min_bandwidth_gbps: float = 1.0,
        probe: bool = True,
        first_buckets: int | None = None,
    ) -> None:
        """WRITE every bucket (or the first ``first_buckets``: a broken-off transfer, for tests) to the
        replica, each with its ``version:bucket:checksum`` notification (checksum 0 without
        ``probe``); returns once all landed."""
        remote = self._remote(destination)
        tensors = list(named_tensors.values())
        buckets = plan_buckets(meta, bucket_bytes)[:first_buckets]
        sizes = [_offsets([meta[i] for i in b])[1] for b in buckets]
        device = tensors[0].device if tensors else torch.device("cpu")
        slots = self._staging(max(sizes, default=0), device)
        in_flight: list[tuple[Any, float] | None] = [None, None]
        for k, bucket in enumerate(buckets):
            self._finish(in_flight[k % 2], version)  # the slot's previous bucket landed
            in_flight[k % 2] = None
            message = f"{version}:{k}:"
            if sizes[k] == 0:
                self.agent.send_notif(remote, (message + "0").encode())  # the checksum of no bytes
                continue
            slot = slots[k % 2][: sizes[k]]
            _pack_into(slot, [meta[i] for i in bucket], [tensors[i] for i in bucket])
            message += str(checksum(slot, host=destination.mem_type == "DRAM") if probe else 0)
            where = [(destination.address + destination.bucket_offsets[k], sizes[k], destination.device_id)]
            handle = self.agent.initialize_xfer(
                "WRITE",
                self.agent.get_xfer_descs(slot),
                self.agent.get_xfer_descs(where, destination.mem_type),
                remote,
                message.encode(),
            )
            if self.agent.transfer(handle) == "ERR":
                raise TrainingError(f"the nixl write of bucket {k} of version {version} failed to start")
            in_flight[k % 2] = (handle, time.monotonic() + bucket_deadline_s(sizes[k], min_bandwidth_gbps))
        for pending in in_flight:
            self._finish(pending, version)

    def _remote(self, destination: Destination) -> str:
        """The replica's agent, loaded again when its metadata changed (a new buffer registered)."""
        known = self.remotes.get(destination.agent_name)
        if known is None or known[0] != destination.agent_metadata:
            if known is not None:
                self.agent.remove_remote_agent(known[1])
            loaded = self.agent.add_remote_agent(destination.agent_metadata)
            self.remotes[destination.agent_name] = (destination.agent_metadata, loaded)
        return self.remotes[destination.agent_name][1]

    def _finish(self, pending: tuple[Any, float] | None, version: int) -> None:
        """Wait for one write (``None``: nothing in flight) and release its handle."""
        if pending is None:
            return
        handle, deadline = pending
        try:
            while (state := self.agent.check_xfer_state(handle)) == "PROC":
                if time.monotonic() > deadline:
                    raise TrainingError(f"a nixl write of version {version} did not complete within its deadline")
                time.sleep(_POLL_S)
            if state != "DONE":
                raise TrainingError(f"a nixl write of version {version} failed ({state})")
        finally:
            self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        """Deregister the staging slots."""
        if self.registered is not None:
            self.agent.deregister_memory(self.registered)
        self.registered, self.slots = None, None
