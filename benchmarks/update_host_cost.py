"""The small update's host cost, measured on a CPU: what a launch-bound GPU update pays per operation.

    python benchmarks/update_host_cost.py [--arms eager,layers,body] [--count] [--out r.json]

The default recipe's update (``PolicyTrainer.train_on`` on 4 prompts x 8 completions, 44 + 16
tokens, one micro-batch) on a Llama with the 135M shape's structure (30 layers, grouped key/value
heads, tied embeddings) at width 32 with a 512-token vocabulary: the same operations as the 135M
model, with almost no arithmetic, so the time is what the host spends per operation (Python,
dispatch, autograd), which is what a GPU update of this size waits on. Arms:

- ``eager``: as shipped;
- ``layers``: ``model.compile=true`` (each decoder layer compiled on its own, dynamic shapes);
- ``body``: the whole decoder body compiled as one graph (not a knob; the probe).

Each arm warms up on three batches, then times nine updates over batches whose lengths vary as a
run's do (median and min). ``--count`` also counts the aten operations one eager update dispatches,
attributed to the source file that issued them (or, in backward, to the autograd node): a
device-independent count of what the GPU launches or the host dispatches. ``--fused-stand-in``
counts it once more with each RMSNorm, SwiGLU activation product and rotary embedding computed out of
the counter's sight and counted as one launch forward and one backward: what ``model.fused_kernels``
(Liger's Triton kernels, which cannot run on a CPU) leaves to dispatch. Pin the threads
(``--threads``, default 1) so that the figure is per-operation cost, not parallel speed.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
import traceback
from typing import Any

import torch

VOCAB = 512
OWN_CODE = ("posttrain", "transformers", "/torch/optim", "torch/nn/utils")


def make_model() -> Any:
    """The 135M shape's structure at width 32 on a 512-token vocabulary, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=30,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def make_batch(seed: int, prompt_len: int = 44, completion_len: int = 16) -> Any:
    """4 prompts x 8 completions; completion lengths vary within the batch as sampled ones do."""
    from posttrain.policy.train_batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, VOCAB, (prompt_len,), generator=g).tolist() for _ in range(4)]
    completions = [torch.randint(5, VOCAB, (completion_len - i % 3,), generator=g).tolist() for i in range(32)]
    return TrainBatch(
        prompt_ids=[prompts[i // 8] for i in range(32)],
        completion_ids=completions,
        advantages_B=torch.randn(32, generator=g),
        in_loss_B=torch.ones(32, dtype=torch.bool),
        sampler_logprobs=[[-1.0] * len(c) for c in completions],
        group_size=8,
    )


def make_trainer(arm: str, compute: str) -> Any:
    from posttrain.config.schema import GRPOConfig
    from posttrain.models.structure import split_body_and_head
    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer

    model = make_model()
    cfg = GRPOConfig()
    cfg.rl.group_size, cfg.rl.batch_per_replica, cfg.rl.micro_batch_per_replica = 8, 32, 32
    cfg.model.share_prompt_prefix = False  # the path a GPU takes at this size
    cfg.model.compute_dtype = compute
    cfg.model.compile = arm == "layers"
    cfg.rollout.max_tokens = 16
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=0)
    if arm == "body":
        split_body_and_head(model)[0].compile(dynamic=True)
    elif arm not in ("eager", "layers"):
        raise SystemExit(f"unknown arm {arm!r}")
    return trainer


def time_arm(arm: str, compute: str) -> dict[str, Any]:
    trainer = make_trainer(arm, compute)
    start = time.perf_counter()
    for seed in range(3):
        trainer.train_on(make_batch(seed), step=seed + 1)
    warm = time.perf_counter() - start
    times = []
    for i in range(9):
        batch = make_batch(10 + i, prompt_len=44 + i % 3, completion_len=16 - i % 2)
        start = time.perf_counter()
        trainer.train_on(batch, step=4 + i)
        times.append(time.perf_counter() - start)
    row = {"arm": arm, "warmup_3_updates_s": warm, "median_s": statistics.median(times), "min_s": min(times)}
    print(
        f"{arm:6s} update median {1e3 * row['median_s']:7.1f} ms  min {1e3 * row['min_s']:7.1f} ms  "
        f"(first three updates, compile included: {warm:.1f} s)",
        flush=True,
    )
    return row


class _OneKernel(torch.autograd.Function):
    """A block computed out of the counter's sight, counted as one launch forward and one backward:
    what a fused kernel (Liger's RMSNorm, SwiGLU, RoPE; ``model.fused_kernels``) dispatches."""

    launches = 0

    @staticmethod
    def forward(ctx: Any, fn: Any, *xs: torch.Tensor) -> Any:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), torch.enable_grad():
            leaves = [x.detach().requires_grad_(x.requires_grad) for x in xs]
            outs = fn(*leaves)
            outs_t = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
            detached = tuple(o.detach() for o in outs_t)
        ctx.leaves, ctx.outs = leaves, outs_t
        _OneKernel.launches += 1
        return detached[0] if isinstance(outs, torch.Tensor) else detached

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            wanted = [x for x in ctx.leaves if x.requires_grad]
            found = iter(torch.autograd.grad(ctx.outs, wanted, grads, allow_unused=True))
            out = [next(found) if x.requires_grad else None for x in ctx.leaves]
        _OneKernel.launches += 1
        return (None, *out)


def fused_stand_ins() -> None:
    """Route the Llama RMSNorm, the MLP's activation product and the rotary embedding through
    ``_OneKernel`` (module-wide; for the count only)."""
    from transformers.models.llama import modeling_llama as llama

    rope = llama.apply_rotary_pos_emb

    def norm(self: Any, x: torch.Tensor) -> Any:
        def rms(x_: torch.Tensor, w_: torch.Tensor) -> torch.Tensor:  # LlamaRMSNorm's arithmetic, on w_
            h = x_.to(torch.float32)
            return w_ * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x_.dtype)

        return _OneKernel.apply(rms, x, self.weight)

    def mlp(self: Any, x: torch.Tensor) -> Any:
        gate_up = _OneKernel.apply(lambda g, u: self.act_fn(g) * u, self.gate_proj(x), self.up_proj(x))
        return self.down_proj(gate_up)

    llama.LlamaRMSNorm.forward = norm  # type: ignore[method-assign]
    llama.LlamaMLP.forward = mlp  # type: ignore[method-assign]
    llama.apply_rotary_pos_emb = lambda q, k, cos, sin, *a, **kw: _OneKernel.apply(
        lambda *t: rope(*t, *a, **kw), q, k, cos, sin
    )


def count_ops(compute: str, fused: bool = False) -> dict[str, Any]:
    """The aten operations of one eager update, by the source that issued them; ``fused``: with the
    fused blocks' stand-ins, each counted as one launch forward and one backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.by_source: collections.Counter[str] = collections.Counter()
            self.by_op: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.by_op[str(func.overloadpacket)] += 1
            node = torch._C._current_autograd_node()
            if node is not None:
                self.by_source["backward: " + node.name()] += 1
            else:
                where = "other"
                for frame in reversed(traceback.extract_stack(limit=40)[:-1]):
                    if any(part in frame.filename for part in OWN_CODE):
                        where = frame.filename.split("site-packages/")[-1].split("src/")[-1] + ":" + frame.name
                        break
                self.by_source[where] += 1
            return func(*args, **(kwargs or {}))

    if fused:
        fused_stand_ins()
    trainer = make_trainer("eager", compute)
    trainer.train_on(make_batch(0), step=1)
    counter = Count()
    _OneKernel.launches = 0
    with counter:
        trainer.train_on(make_batch(1), step=2)
    total = sum(counter.by_op.values()) + _OneKernel.launches
    print(
        f"aten operations in one eager update{' with fused blocks' if fused else ''}: {total}"
        + (f" ({_OneKernel.launches} of them the fused blocks' launches)" if fused else ""),
        flush=True,
    )
    for source, n in counter.by_source.most_common(20):
        print(f"  {n:6d}  {source}", flush=True)
    return {
        "total": total,
        "fused_launches": _OneKernel.launches,
        "by_source": dict(counter.by_source),
        "by_op": dict(counter.by_op),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", default="eager,layers,body")
    p.add_argument("--compute", default="float32", help="model.compute_dtype (bfloat16: the GPU's mixed path)")
    p.add_argument("--count", action="store_true", help="count one eager update's aten operations by source")
    p.add_argument("--fused-stand-in", action="store_true", help="--count with the fused blocks as one launch each")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"torch": torch.__version__, "compute": args.compute, "arms": []}
    if args.count:
        result["ops"] = count_ops(args.compute)
    if args.fused_stand_in:  # last: the stand-ins are module-wide
        result["ops_fused"] = count_ops(args.compute, fused=True)
    for arm in args.arms.split(","):
        result["arms"].append(time_arm(arm, args.compute))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
