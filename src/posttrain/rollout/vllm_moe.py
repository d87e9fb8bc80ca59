"""vLLM on sparse-MoE policies: the MoE kernel the engine is built with, the routed experts it returns
for routing replay, and the repair its CPU build needs after a weight reload.

vLLM's CPU build (0.32) prepacks each MoE layer's ``w13`` / ``w2`` expert stacks into the layout of
its grouped-GEMM kernel once, at load. An in-place reload (``reload_weights``, what every weight sync
runs) writes the new checkpoint-format weights into those same tensors but skips the prepack on
updates (vLLM only re-runs it when the kernel is first built), so the kernel then reads unpacked
weights as if they were packed: after a sync of even the unchanged weights, sampler logprobs
drift from the trainer's by a few hundredths of a nat on a tiny model (measured, vLLM 0.32 CPU).
``repack_cpu_moe`` redoes the prepack in place after each reload. vLLM's CUDA kernels read the
loaded layout directly, so on a GPU there is nothing to redo.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from posttrain.errors import PosttrainError

MOE_BACKEND_DEFAULT = "auto"


def moe_backend_args(moe_backend: str) -> dict[str, Any]:
    """The ``vllm.LLM`` argument selecting its MoE expert kernel (``KernelConfig.moe_backend``, an
    engine argument in vLLM 0.18 through 0.32): nothing for ``auto``, so an engine built with the
    default is built exactly as before the knob existed."""
    return {} if moe_backend == MOE_BACKEND_DEFAULT else {"moe_backend": moe_backend}


def repack_cpu_moe(model: Any) -> int:
    """Re-prepack, in place, the expert weights of every MoE layer that vLLM's CPU experts kernel
    runs (see the module docstring); returns how many layers were repacked (0 on other kernels).
    Runs inside the engine's worker (``LLM.apply_model``)."""
    from vllm import _custom_ops as ops

    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        isa = getattr(experts, "isa", None)
        if experts is None or isa is None or getattr(experts, "_use_zentorch", False):
            continue
        config = module.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise PosttrainError(
                f"vLLM's CPU MoE kernel pads the expert intermediate size {config.intermediate_size_per_partition} "
                "to its alignment, and a weight reload cannot be repacked then; use a moe_intermediate_size "
                f"that is a multiple of {experts._intermediate_alignment()} on vLLM's CPU build"
            )
        for name in ("w13_weight", "w2_weight"):
            param = getattr(module, name)
            param.data.copy_(ops.cpu_prepack_moe_weight(param.data, isa))
        repacked += 1
    return repacked


def routed_experts_args(enabled: bool, cuda: bool) -> dict[str, Any]:
    """The ``vllm.LLM`` argument that makes it return the experts every position was routed to
    (``rl.routing_replay=rollout``); nothing when off. vLLM 0.32's CPU build cannot: its routed-expert
    capture needs Model Runner V2, which needs Triton, which the CPU build lacks (checked: vLLM
    refuses the engine), so it is refused here with that reason instead."""
    if not enabled:
        return {}
    if not cuda:
        raise PosttrainError(
            "rl.routing_replay=rollout needs vLLM to return the experts it routed to "
            "(enable_return_routed_experts), which vLLM's CPU build cannot (its Model Runner V2 needs Triton); "
            "run routing replay on a GPU, or set rl.routing_replay=off"
        )
    return {"enable_return_routed_experts": True}


def attach_routed_experts(completions: list[Any], owners: list[int], outputs: Sequence[Any]) -> None:
    """Put each vLLM sample's ``routed_experts`` (``[prompt + completion - 1, layers, top_k]``) on its
    ``Completion`` as ``extra["routed_experts"]`` (an int16 tensor: expert ids < 32768), in
    ``call_completions``' order (requests in order, samples by index)."""
    import numpy as np
    import torch

    samples = [s for _, out in zip(owners, outputs) for s in sorted(out.outputs, key=lambda o: o.index)]
    if len(samples) != len(completions):
        raise PosttrainError(f"vLLM returned {len(samples)} samples for {len(completions)} completions")
    for completion, sample in zip(completions, samples):
        routed = getattr(sample, "routed_experts", None)
        if routed is None:
            raise PosttrainError(
                "rl.routing_replay=rollout: vLLM returned no routed_experts for a completion; the engine must "
                "be built with enable_return_routed_experts=True on a sparse-MoE model"
            )
        completion.extra["routed_experts"] = torch.from_numpy(np.asarray(routed).astype(np.int16))
