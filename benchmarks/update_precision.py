"""The policy update in each precision, at workload W's size: where mixed precision's time goes.

    python benchmarks/update_precision.py --shapes 0.5b,1.5b [--arms bf16,mixed,autocast] [--out r.json]

For each random-weight model shape (``benchmarks/make_random_model.py``'s) and each arm, times
``PolicyTrainer.train_on`` (forward, backward, AdamW, as a run's update) on one synthetic collected
batch of W's size (32 prompts of 44 tokens x 8 completions of 256 tokens by default, random ids and
advantages, micro-batches of ``--micro-batch``), median of ``--repeats`` after one warm-up, with the
MFU at 6 N per trained token on a bf16 peak of 989 TFLOP/s (H200). Arms:

- ``bf16``: ``model.dtype=bfloat16``, pure bf16 weights and updates (the GPU default before fp32
  master weights);
- ``mixed``: the shipped default, fp32 master weights read as bf16 copies for the forward
  (``models.precision.compute_weights``);
- ``autocast``: fp32 master weights under ``torch.autocast(bfloat16)``, the path ``mixed`` replaced
  (reproduced here by swapping the trainer's compute context, for the before/after);
- ``mixed_compiled``: ``mixed`` with ``model.compile=true`` (each decoder layer compiled on its own);
- ``mixed_body_compiled``: ``mixed`` with the whole decoder body compiled as one graph instead (not a
  knob: whether the per-layer calls' own host cost matters; on the CPU it did not, and it compiled
  for 194 s against 11 s, ``update_host_cost.py``);
- ``mixed_graphs``: each decoder layer compiled with ``mode="reduce-overhead"`` (not a knob:
  inductor's CUDA graphs, one replay per layer and shape instead of a launch per kernel; CUDA only).
  On the H200 (2026-12-04) it took 1.8 s against 0.10 s: a layer's graph runs while the previous
  layers' backwards are pending, which keeps CUDA-graph trees off their fast path;
- ``mixed_body_graphs``: the whole decoder body compiled as one graph with ``mode="reduce-overhead"``
  and ``torch.compiler.cudagraph_mark_step_begin()`` before each update (not a knob: one forward and
  one backward replay per update, so no backward is pending when a graph runs; CUDA only).
- ``mixed_cuda_graphs``: ``model.cuda_graphs=true``: the body's forward and backward recorded once per
  padded shape as two CUDA graphs, the bf16 casts inside the graph, the LM head, loss and optimizer
  eager (``models/cuda_graphs.py``; CUDA only). The other arms keep the eager body.
- ``mixed_fused_cuda_graphs``: both, the fused kernels recorded into the body's graphs.
- an arm name ending in ``_mbcast`` (``mixed_fused_mbcast``): that arm with its weights cast once per
  micro-batch, as before the twenty-third session, instead of once per mini-batch (before/after);
- ending in ``_rowbuild``: that arm with its micro-batches laid out on the host as before the
  twenty-sixth session (a Python loop with a few small tensor operations per row and per-token
  lists; since then ``policy.batching.ragged_slots`` places every token at once);
- ending in ``_ligernorm``: that arm with Liger's RMSNorm kernels, as before the twenty-eighth session
  (since then the modules Liger patches run ``models/block_kernels.py``'s row-tiled kernels);
- ending in ``_rowcopy``: that arm with its inputs moved to the device as before the twenty-fifth
  session (the sampler's logprobs a row at a time, the rest from pageable memory: host waits);
- an arm name ending in ``_lse`` (``mixed_fused_lse``): that arm with the logprob head of before the
  twenty-second session, ``gather(logits) - logsumexp(logits.float())`` per chunk; ending in ``_trt``:
  with the two Triton kernels of ``model.triton_logprob_head`` (CUDA; on by default there since the
  twenty-fifth session), instead of torch's one fp32 ``log_softmax`` per chunk, which the other arms
  keep (``benchmarks/logprob_heads.py``), for the before/after in one process.

``--profile`` runs each arm's update once more under torch.profiler and prints the wall time against
the GPU's busy time (kernel time summed), the kernels launched and the aten calls: an update whose
busy time is a small share of its wall time is bound by its host-side launches, not by arithmetic.
It also prints where the busy time goes: the 20 kernels that take most of it, and torch.profiler's
operator table by self device time (both, 40 rows, in the JSON).
The ``tiny30`` shape (the 135M shape's 30 layers at width 64, the same vocabulary) has the 135M
shape's launches with almost none of its arithmetic: on a GPU, the floor of the small update.

``--syncs`` runs each arm's update once more with ``torch.cuda.set_sync_debug_mode("warn")`` and
prints where the host waited for the GPU: each synchronizing call's count, by the innermost frame
outside torch and the innermost posttrain frame that led to it (CUDA only; a sync stalls the launch
queue, so the GPU idles while the host catches up).

``--vary-lengths K`` cycles the timed updates through K completion lengths, as a run's batches
change from step to step: what a CUDA-graph arm pays to record a graph per new shape, and whether it
then replays.

``--share on,off,auto`` repeats each arm per ``model.share_prompt_prefix`` value (the line and the
JSON say which path ``auto`` took) and ``--prompt-len`` sets the prompts' length: where running each
group's prompt once pays on a GPU (policy/shared_prefix.sharing_pays).

No rollout engine: the update does not depend on it (the W step's other parts are grpo_step.py's).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import statistics
import time
from typing import Any

import torch

PEAK_BF16_FLOPS = 989e12
TOP_KERNELS = 40  # --profile: the kernels and operators listed, by GPU time
SAMPLES, PROMPT_LEN = 8, 44
TOKENIZER_DIR = "tests/fixtures/smollm2_tokenizer"  # SmolLM2's config, as side_by_side.sh's models


def make_model(shape: str, dtype: torch.dtype, device: str) -> Any:
    """The random-weight model make_random_model.py saves for ``shape``, built in memory."""
    from make_random_model import shape_config  # this directory's, on sys.path (main)
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(shape_config(TOKENIZER_DIR, shape)).to(dtype)


def make_batch(prompts: int, completion_len: int, prompt_len: int = PROMPT_LEN) -> Any:
    from posttrain.policy.train_batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(100, 40000, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    n = prompts * SAMPLES
    completions = [torch.randint(100, 40000, (completion_len,), generator=g).tolist() for _ in range(n)]
    return TrainBatch(
        prompt_ids=[prompt_ids[i // SAMPLES] for i in range(n)],
        completion_ids=completions,
        advantages_B=torch.randn(n, generator=g),
        in_loss_B=torch.ones(n, dtype=torch.bool),
        sampler_logprobs=[[-10.0] * completion_len for _ in completions],
        group_size=SAMPLES,
    )


ARM_SUFFIXES = {
    "_lse": "logsumexp",
    "_trt": "triton",
    "_mbcast": "cast per micro-batch",
    "_rowcopy": "inputs copied per row, synchronously",
    "_rowbuild": "micro-batches laid out per row on the host",
    "_ligernorm": "Liger's RMSNorm kernels",
}


def split_arm(arm: str) -> tuple[str, str, str]:
    """``(base arm, logprob head, emulated earlier path)`` of an arm name ending in at most one head
    suffix and, after it, at most one emulation suffix of ``ARM_SUFFIXES`` (``mixed_fused_trt_rowbuild``:
    the Triton head with the earlier layouts). The head: ``logsumexp``, ``triton``, else the default
    ``log_softmax``; the emulation: ``mbcast``, ``rowcopy``, ``rowbuild``, ``ligernorm`` or ""."""
    emulation = next((s for s in ("_mbcast", "_rowcopy", "_rowbuild", "_ligernorm") if arm.endswith(s)), "")
    arm = arm.removesuffix(emulation) if emulation else arm
    head = next((s for s in ("_lse", "_trt") if arm.endswith(s)), "")
    arm = arm.removesuffix(head) if head else arm
    return arm, ARM_SUFFIXES[head] if head else "log_softmax", emulation.lstrip("_")


def trainer_for(model: Any, arm: str, args: argparse.Namespace, share: str = "auto") -> Any:
    from logprob_heads import use_logprob_head  # this directory's, on sys.path (main)

    from posttrain.config.schema import GRPOConfig
    from posttrain.models.structure import split_body_and_head
    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer

    arm, head, emulation = split_arm(arm)
    use_logprob_head(head)
    cfg = GRPOConfig()
    cfg.rl.group_size, cfg.rl.batch_per_replica = SAMPLES, args.prompts * SAMPLES
    cfg.rl.micro_batch_per_replica = args.micro_batch
    cfg.rl.optimizer.lr, cfg.rl.kl_beta = 1e-6, 0.0
    cfg.rollout.max_tokens = args.completion_len
    if arm not in ("bf16", "autocast"):  # fp32 weights, bf16 compute: the GPU's auto, named so a CPU run mixes too
        cfg.model.compute_dtype = "bfloat16"
    cfg.model.compile = arm == "mixed_compiled"
    cfg.model.cuda_graphs = arm in ("mixed_cuda_graphs", "mixed_fused_cuda_graphs")
    cfg.model.share_prompt_prefix = {"auto": "auto", "on": True, "off": False}[share]
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=0)
    if arm == "mixed_body_compiled":
        split_body_and_head(model)[0].compile(dynamic=True)
    elif arm == "mixed_body_graphs":  # fixed shapes here: one recording, then replays
        split_body_and_head(model)[0].compile(mode="reduce-overhead")
    elif arm == "mixed_graphs":  # as model.compile's compile_layers, in inductor's CUDA-graph mode
        for layer in split_body_and_head(model)[0].layers:
            layer.compile(dynamic=True, mode="reduce-overhead")
    elif arm == "autocast":
        device = trainer.device

        def autocast(_model: Any) -> Any:
            return torch.autocast(device.type, dtype=torch.bfloat16)

        trainer._compute = autocast  # type: ignore[method-assign]  # the replaced path, for the before/after
    elif arm in ("mixed_fused", "mixed_fused_cuda_graphs"):  # model.fused_kernels: Liger's RMSNorm, SwiGLU, RoPE
        from posttrain.models.fused_kernels import apply_fused_kernels

        apply_fused_kernels(model)
    elif arm not in ("bf16", "mixed", "mixed_compiled", "mixed_cuda_graphs"):
        raise SystemExit(f"unknown arm {arm!r}")
    if emulation == "mbcast":
        cast_weights_per_micro_batch(trainer)
    elif emulation == "ligernorm":
        from posttrain.models.block_kernels import use_liger_rms_norm

        use_liger_rms_norm(model)
    return trainer


@contextlib.contextmanager
def inputs_copied_per_row() -> Any:
    """The micro-batch's inputs moved as before the twenty-fifth session (the before/after arm
    ``_rowcopy``): the sampler's logprobs copied to the device row by row, the rows' advantages,
    loss flags and lengths as synchronous copies from pageable memory, the model batch's tensors as
    ``non_blocking`` copies from pageable memory (``policy/transfer.py`` says why each waits)."""
    from posttrain.policy import batching, routing, shared_prefix, train_batch, trainer

    def pageable(t: Any, device: Any) -> Any:
        return t.to(device)

    def pageable_non_blocking(t: Any, device: Any) -> Any:
        return t.to(device, non_blocking=True)

    def pad_rows_per_row(rows: list[Any], width: int, device: Any) -> Any:
        out = torch.zeros(len(rows), width, dtype=torch.float32, device=device)
        for i, row in enumerate(rows):
            n = min(width, row.numel())
            out[i, :n] = row[:n]
        return out

    def sampler_rows_per_row(batch: Any, rows: list[int], width: int, device: Any) -> Any:
        if all(lp is None for lp in batch.sampler_logprobs):
            return None, None
        chosen = [batch.sampler_logprobs[i] for i in rows]
        rows_T = [torch.tensor(lp if lp is not None else [], dtype=torch.float32) for lp in chosen]
        recorded_B = None if all(lp is not None for lp in chosen) else torch.tensor([lp is not None for lp in chosen])
        return pad_rows_per_row(rows_T, width, device), None if recorded_B is None else recorded_B.to(device)

    patches = [(m, "to_device", pageable) for m in (routing, shared_prefix, train_batch, trainer)]
    patches += [(batching, "to_device", pageable_non_blocking)]
    patches += [(trainer, "sampler_logprobs_rows", sampler_rows_per_row)]
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    for m, name, value in patches:
        setattr(m, name, value)
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


@contextlib.contextmanager
def layouts_built_per_row() -> Any:
    """The micro-batches laid out on the host as before the twenty-sixth session (the before/after
    arm ``_rowbuild``): each row's tokens converted and written by a few small tensor operations of
    their own, the completion tokens' rows, columns and sources as per-token Python lists, the
    sampler's logprobs converted a row at a time. Same tensors, same device copies."""
    from posttrain.policy import batching, train_batch, trainer

    def per_row_batch(
        prompt_ids: Any, completion_ids: Any, *, pad_id: int, device: Any, pack_capacity: Any = None
    ) -> Any:
        sequences = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
        lengths = [len(x) for x in sequences]
        width = max(lengths, default=0)
        layout = [[b] for b in range(len(sequences))]
        if pack_capacity is not None:
            width = max(width, pack_capacity)
            layout = batching.pack_rows(lengths, width)
        ids_RL = torch.full((len(layout), width), pad_id, dtype=torch.long)
        mask_RL = torch.zeros((len(layout), width), dtype=torch.long)
        pos_RL = torch.zeros((len(layout), width), dtype=torch.long)
        start_B = [0] * len(sequences)
        for r, members in enumerate(layout):
            col = 0
            for b in members:
                n = lengths[b]
                ids_RL[r, col : col + n] = torch.tensor(sequences[b], dtype=torch.long)
                mask_RL[r, col : col + n] = 1
                pos_RL[r, col : col + n] = torch.arange(n)
                start_B[b], col = r * width + col, col + n
            pos_RL[r, col:] = torch.arange(width - col)
        longest = max((len(c) for c in completion_ids), default=0)
        comp_BT = torch.full((len(completion_ids), longest), pad_id, dtype=torch.long)
        cmask_BT = torch.zeros((len(completion_ids), longest), dtype=torch.float32)
        rows: list[int] = []
        cols: list[int] = []
        for b, completion in enumerate(completion_ids):
            comp_BT[b, : len(completion)] = torch.tensor(completion, dtype=torch.long)
            cmask_BT[b, : len(completion)] = 1.0
            rows += [b] * len(completion)
            cols += range(len(completion))
        sources = [start_B[b] + len(prompt_ids[b]) - 1 + t for b, t in zip(rows, cols)]
        put = functools.partial(batching.to_device, device=device)
        return batching.PolicyBatch(
            put(ids_RL),
            put(mask_RL),
            None if pack_capacity is None else put(pos_RL),
            put(cmask_BT),
            put(comp_BT),
            put(torch.tensor(rows, dtype=torch.long)),
            put(torch.tensor(cols, dtype=torch.long)),
            put(torch.tensor(sources, dtype=torch.long)),
            start_B,
        )

    def pad_lists_per_row(values: list[Any], width: int, dtype: Any = torch.float32) -> Any:
        out = torch.zeros(len(values), width, dtype=dtype)
        for i, row in enumerate(values):
            row_T = torch.tensor(row if row is not None else [], dtype=dtype)
            out[i, : min(width, row_T.numel())] = row_T[:width]
        return out

    saved = (trainer.build_policy_batch, train_batch.pad_lists)
    trainer.build_policy_batch, train_batch.pad_lists = per_row_batch, pad_lists_per_row
    try:
        yield
    finally:
        trainer.build_policy_batch, train_batch.pad_lists = saved


def cast_weights_per_micro_batch(trainer: Any) -> None:
    """The update as it cast its weights before the twenty-third session: once per micro-batch, each
    pass's entry open over its forward and its backward (a checkpointed chunk recomputes in the
    backward from the same copies). ``train_on``'s one entry per mini-batch is replaced by one that
    casts afresh as each pass begins (``_loss_inputs``) and lets the last pass's copies go at its
    end (the before/after arm ``_mbcast``)."""
    import sys

    compute, loss_inputs = trainer._compute, trainer._loss_inputs
    open_entry = contextlib.ExitStack()  # the current pass's entry
    entered: list[Any] = []  # the model train_on entered for

    @contextlib.contextmanager
    def per_pass(model: Any) -> Any:
        entered[:] = [model]
        with open_entry:  # closes the last pass's entry
            yield

    def entry(model: Any) -> Any:
        return per_pass(model) if sys._getframe(1).f_code.co_name == "train_on" else compute(model)

    def fresh_cast(*args: Any, **kwargs: Any) -> Any:
        open_entry.close()  # the previous pass's backward has run
        open_entry.enter_context(compute(entered[0]))
        return loss_inputs(*args, **kwargs)

    trainer._compute, trainer._loss_inputs = entry, fresh_cast


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def update(trainer: Any, batch: Any, step: int, arm: str) -> None:
    """One ``train_on``; a CUDA-graph arm first tells inductor that a new step begins (its graphs'
    outputs from the last update are dead), so the trees replay instead of re-recording."""
    if split_arm(arm)[0].endswith("graphs"):
        torch.compiler.cudagraph_mark_step_begin()
    trainer.train_on(batch, step=step)


def profile_update(trainer: Any, batch: Any, step: int, arm: str) -> dict[str, Any]:
    """One more update under torch.profiler (gpu_profile.profile_call): its wall time against the GPU's
    busy time, the kernels and CUDA-graph replays launched, the aten calls made."""
    from gpu_profile import profile_call  # this directory's, on sys.path (main)

    return profile_call(lambda: update(trainer, batch, step, arm), top=TOP_KERNELS)[1]


def count_syncs(trainer: Any, batch: Any, step: int, arm: str) -> dict[str, int]:
    """One more update with CUDA's sync debug mode on: each place the host waited for the GPU, as
    "innermost frame outside torch <- innermost posttrain frame", with how often."""
    from collections import Counter

    from posttrain.policy.transfer import host_waits

    def where(frame: Any) -> str:
        path = frame.filename
        for root in ("/posttrain/", "/transformers/", "/benchmarks/"):
            if root in path:
                path = root.strip("/") + "/" + path.split(root, 1)[1]
        return f"{path}:{frame.lineno} {frame.name}"

    sites: Counter[str] = Counter()
    for stack in host_waits(lambda: update(trainer, batch, step, arm)):
        outside_torch = next((f for f in reversed(stack) if "/torch/" not in f.filename), stack[-1])
        ours = next((f for f in reversed(stack) if "/posttrain/" in f.filename), outside_torch)
        sites[where(outside_torch) + ("" if ours is outside_torch else " <- " + where(ours))] += 1
    return dict(sites.most_common())


def run_arm(shape: str, arm: str, args: argparse.Namespace, share: str = "auto") -> dict[str, Any]:
    """One arm: its timed updates, and the profile and sync count when asked for."""
    emulation = split_arm(arm)[2]
    earlier = {"rowcopy": inputs_copied_per_row, "rowbuild": layouts_built_per_row}.get(emulation)
    with earlier() if earlier else contextlib.nullcontext():
        return _run_arm(shape, arm, args, share)


def _run_arm(shape: str, arm: str, args: argparse.Namespace, share: str) -> dict[str, Any]:
    dtype = torch.bfloat16 if arm == "bf16" else torch.float32
    model = make_model(shape, dtype, args.device)
    params = sum(p.numel() for p in model.parameters())
    trainer = trainer_for(model, arm, args, share)
    # --vary-lengths K: the updates cycle through K completion lengths (completion_len, -1, ...), as a
    # run's batches do; a CUDA-graph arm records a graph the first time it meets each shape
    batches = [make_batch(args.prompts, args.completion_len - k, args.prompt_len) for k in range(args.vary_lengths)]
    batch = batches[0]
    tokens = args.prompts * SAMPLES * (args.prompt_len + args.completion_len - (len(batches) - 1) / 2)  # their mean
    times = []
    for i in range(args.repeats + 1):
        sync(args.device)
        start = time.perf_counter()
        update(trainer, batches[i % len(batches)], i + 1, arm)
        sync(args.device)
        times.append(time.perf_counter() - start)
    median = statistics.median(times[1:])
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    result = {
        "shape": shape,
        "arm": arm,
        "share_prompt_prefix": share,
        "shared": trainer._share,
        "graph_shapes": trainer.graphs.shapes if trainer.graphs is not None else None,
        "graph_record_s": trainer.graphs.capture_seconds if trainer.graphs is not None else None,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "completion_len": args.completion_len,
        "vary_lengths": args.vary_lengths,
        "params": params,
        "seconds": times,
        "median_s": median,
        "mfu": 6 * params * tokens / median / PEAK_BF16_FLOPS,
        "peak_alloc_gib": peak,
    }
    print(
        f"{shape:5s} {arm:15s} share={share}({'on' if trainer._share else 'off'}) "
        f"{args.prompts}x{SAMPLES} {args.prompt_len}+{args.completion_len} update {median:.3f} s  "
        f"MFU {100 * result['mfu']:.1f} %  peak {peak:.1f} GiB  "
        f"(all {', '.join(f'{t:.3f}' for t in times)})",
        flush=True,
    )
    if args.profile:
        result["profile"] = prof = profile_update(trainer, batch, args.repeats + 2, arm)
        print(
            f"      profiled: wall {1e3 * prof['wall_s']:.1f} ms, GPU busy {1e3 * prof['gpu_busy_s']:.1f} ms "
            f"({prof['kernels']} kernels; {prof['kernel_launches']} launches, {prof['graph_launches']} graph "
            f"replays), {prof['aten_calls']} aten calls",
            flush=True,
        )
        busy = prof["gpu_busy_s"] or 1.0
        for k in prof["top_kernels"][:20]:
            share, ms = 100 * k["gpu_s"] / busy, 1e3 * k["gpu_s"]
            print(f"        {share:5.1f} %  {ms:7.2f} ms  x{k['count']:<5d} {k['name'][:110]}")
        print(prof["ops_table"], flush=True)
    if args.syncs and args.device == "cuda":
        result["syncs"] = syncs = count_syncs(trainer, batch, args.repeats + 3, arm)
        print(f"      host syncs in one update: {sum(syncs.values())}", flush=True)
        for site, count in syncs.items():
            print(f"        x{count:<4d} {site[:200]}", flush=True)
    del trainer, model
    if args.device == "cuda":
        # the 1.5B arms' peaks grew by about 4 GiB an arm on 2026-12-05 (both heads alike): collect any
        # cycle that still holds the arm's tensors, and record what stays allocated after it
        gc.collect()
        torch.cuda.empty_cache()
        result["left_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
        print(f"      left allocated after the arm: {result['left_allocated_gib']:.2f} GiB", flush=True)
        torch.cuda.reset_peak_memory_stats()
    return result


def main() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="0.5b,1.5b")
    p.add_argument("--arms", default="bf16,mixed,autocast,mixed_compiled")
    p.add_argument("--prompts", type=int, default=32, help="x 8 completions (W: 32)")
    p.add_argument("--completion-len", type=int, default=256, help="tokens per completion (W: 256)")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help=f"tokens per prompt (W: {PROMPT_LEN})")
    p.add_argument("--share", default="auto", help="model.share_prompt_prefix values, comma-separated: auto,on,off")
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", action="store_true", help="one more update per arm under torch.profiler")
    p.add_argument("--syncs", action="store_true", help="one more update per arm counting host syncs (CUDA)")
    p.add_argument(
        "--vary-lengths",
        type=int,
        default=1,
        help="cycle the updates through this many completion lengths (completion-len, -1, ...); the profiled "
        "update takes the first",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = []
    for shape in args.shapes.split(","):
        for arm in args.arms.split(","):
            for share in args.share.split(","):
                results.append(run_arm(shape, arm, args, share))
                if args.out:  # after each arm: a run cut short keeps what it measured
                    Path(args.out).write_text(json.dumps({"device": args.device, "results": results}, indent=1))


if __name__ == "__main__":
    main()
