"""Weight sync between two processes: the ``nixl`` transport (NIXL writes over its UCX backend) against
the ``nccl`` one (broadcasts in a pair group: NCCL between two GPUs, gloo on the CPU).

The owner (this process) sends a model's full state dict in packed buckets to a replica process,
as ``RolloutProxy`` does after every optimizer step, for each transport in turn; each sync is timed
from the owner's first byte until the replica holds every tensor (with ``nixl``: notifications in,
and, with the probe on, every bucket re-read and its checksum compared). The first sync of each
transport opens its connection and is left out; the median of the rest is reported, with the rate
in GB/s. The tensors are random, with the names and shapes of a Llama-family model built on the meta
device (SmolLM2-135M by default: 30 layers, hidden 576, vocabulary 49,152, tied embeddings sent
under both names, as the policy sends them; ``--shape`` takes another body of
``make_random_model.py``, e.g. ``0.5b`` or ``1.5b``). Nothing is downloaded. Prints a markdown table
(``--out`` also writes it to a file).

    .venv/bin/python benchmarks/weight_sync_transports.py                     # CPU: nixl (DRAM) vs gloo
    .venv/bin/python benchmarks/weight_sync_transports.py --dtype bfloat16 --bucket-mib 64 256
    python benchmarks/weight_sync_transports.py --device cuda                 # two GPUs: nixl (VRAM) vs NCCL
    python benchmarks/weight_sync_transports.py --device cuda --shape 1.5b --dtype bfloat16

With ``--device cuda`` the replica uses the second visible GPU (``nccl`` needs two; with one GPU
only ``nixl`` runs, both ends on it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, NamedTuple

import torch
import torch.multiprocessing as mp

SHAPE_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
)


def model_tensors(dtype: torch.dtype, device: torch.device, shape: str = "135m") -> dict[str, torch.Tensor]:
    """Random tensors with the names and shapes of the model's ``state_dict`` (tied names twice):
    SmolLM2-135M's, with ``shape``'s body from ``make_random_model.SHAPES`` in place of its own."""
    from make_random_model import SHAPES
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{**SHAPE_135M, **SHAPES[shape]}))
    gen = torch.Generator().manual_seed(0)
    out, made = {}, {}
    for name, value in model.state_dict(keep_vars=True).items():  # parameters: a tied one is one object
        if id(value) not in made:  # a tied tensor is one tensor under two names, as in the policy
            made[id(value)] = torch.randn(value.shape, generator=gen).to(device=device, dtype=dtype)
        out[name] = made[id(value)]
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Case(NamedTuple):
    """One row: the transport, its bucket size, syncs to time, whether the nixl probe is on."""

    transport: str
    bucket: int
    rounds: int
    probe: bool


def _replica(case: Case, meta: list[Any], device: str, q: Any, ack: Any) -> None:
    """The replica process: receive ``rounds`` syncs, acknowledging each once every tensor is in."""
    from posttrain.distributed import nixl_sync, weight_sync

    dev = torch.device(device)
    if case.transport == "nccl":
        host, port = q.get()
        group = weight_sync.pair_group(host, port, 1, timeout_s=120)
        for r in range(case.rounds):
            weight_sync.receive(group, meta, dev, case.bucket)
            _sync(dev)
            ack.put(r)
        weight_sync.close_group(group)
        return
    receiver = nixl_sync.NixlReceiver()
    ack.put(receiver.prepare(meta, dev, case.bucket, None))
    for r in range(case.rounds):
        receiver.wait(meta, r, min_bandwidth_gbps=0.1, probe=case.probe)
        ack.put(r)
    receiver.close()


def measure(case: Case, tensors: dict[str, torch.Tensor], replica_device: str) -> list[float]:
    """Seconds of each sync after the first (which opens the connection)."""
    import socket

    from posttrain.distributed import nixl_sync, weight_sync

    meta = weight_sync.describe(tensors)
    ctx = mp.get_context("spawn")
    q, ack = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_replica, args=(case, meta, replica_device, q, ack))
    transport, bucket = case.transport, case.bucket
    proc.start()
    times = []
    try:
        if transport == "nccl":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            q.put(("127.0.0.1", port))
            group = weight_sync.pair_group("127.0.0.1", port, 0, timeout_s=120)
        else:
            sender, destination = nixl_sync.NixlSender(), ack.get(timeout=120)
        for r in range(case.rounds):
            start = time.perf_counter()
            if transport == "nccl":
                weight_sync.send(group, tensors, bucket)
            else:
                sender.send(
                    tensors, meta, destination, r, bucket_bytes=bucket, min_bandwidth_gbps=0.1, probe=case.probe
                )
            assert ack.get(timeout=600) == r
            times.append(time.perf_counter() - start)
        if transport == "nccl":
            weight_sync.close_group(group)
        else:
            sender.close()
    finally:
        proc.join(timeout=120)
    return times[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    from make_random_model import SHAPES

    p.add_argument("--shape", default="135m", choices=sorted(SHAPES), help="a body of make_random_model.py")
    p.add_argument("--bucket-mib", type=int, nargs="+", default=[256])
    p.add_argument("--rounds", type=int, default=6, help="syncs per row (the first is left out)")
    p.add_argument("--transports", nargs="+", default=["nccl", "nixl"], choices=["nccl", "nixl"])
    p.add_argument("--out", default=None)
    args = p.parse_args()

    cuda = args.device == "cuda"
    owner = torch.device("cuda", 0) if cuda else torch.device("cpu")
    replica = f"cuda:{1 if torch.cuda.device_count() > 1 else 0}" if cuda else "cpu"
    tensors = model_tensors(getattr(torch, args.dtype), owner, args.shape)
    distinct = {id(t): t for t in tensors.values()}
    sent_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    lines = [
        f"{len(tensors)} tensors ({len(distinct)} distinct), {sent_bytes / 1e6:.0f} MB sent per sync, "
        f"{args.dtype}, shape {args.shape}, owner {owner}, replica {replica}",
        "",
        "| transport | backend | bucket | probe | median sync | GB/s | all syncs (s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    print("\n".join(lines), flush=True)
    for mib in args.bucket_mib:
        for transport in args.transports:
            probes = [True, False] if transport == "nixl" else [False]
            if transport == "nccl" and cuda and replica == "cuda:0":
                continue  # NCCL cannot pair two ranks on one GPU
            for probe in probes:
                times = measure(Case(transport, mib * 2**20, args.rounds, probe), tensors, replica)
                median = statistics.median(times)
                backend = "UCX" if transport == "nixl" else ("NCCL" if cuda else "gloo")
                shown = ("on" if probe else "off") if transport == "nixl" else "-"
                row = (
                    f"| {transport} | {backend} | {mib} MiB | {shown} "
                    f"| {median:.3f} s | {sent_bytes / median / 1e9:.2f} | {', '.join(f'{t:.3f}' for t in times)} |"
                )
                lines.append(row)
                print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
