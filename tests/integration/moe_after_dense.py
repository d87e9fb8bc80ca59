"""Run as a script by test_moe_vllm.py (vLLM's CPU build) and tests/gpu/test_moe_gpu.py: a dense
vLLM engine, then an MoE one, in this fresh process (vLLM makes its process-wide parallel groups with
the first engine; ``vllm_runtime.complete_expert_group`` adds the expert group the MoE layers need).
Prints the MoE engine's sampler-logprob gaps to the trainer's as one JSON line.

    python tests/integration/moe_after_dense.py DENSE_DIR MOE_DIR DTYPE DEVICE [GPU_MEMORY_UTILIZATION]
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from posttrain.policy.batching import build_policy_batch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.vllm_engine import VLLMRolloutEngine


def main(dense_dir: str, moe_dir: str, dtype: str, device: str, memory: float = 0.15) -> None:
    args = dict(dtype=dtype, enforce_eager=True, max_model_len=256, seed=0, gpu_memory_utilization=memory)
    dense = VLLMRolloutEngine(dense_dir, **args)  # vLLM's parallel groups are made here, without experts
    moe = VLLMRolloutEngine(moe_dir, **args)
    out = moe.generate([[1, 5, 7, 9, 11], [42, 43]], 2, SamplingParams(max_tokens=6, seed=1))
    batch = build_policy_batch(
        [out.prompt_token_ids[c.prompt_index] for c in out.completions],
        [c.token_ids for c in out.completions],
        pad_id=0,
        device=device,
    )
    trainer = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=getattr(torch, dtype)).to(device).eval()
    with torch.no_grad():
        trainer_BT = completion_logprobs(trainer, batch)
    assert isinstance(trainer_BT, torch.Tensor)
    trainer_rows = [trainer_BT[i, : len(c.token_ids)].float().cpu() for i, c in enumerate(out.completions)]
    gaps = torch.cat([(torch.tensor(c.logprobs) - row).abs() for c, row in zip(out.completions, trainer_rows)])
    dense.generate([[1, 5, 7]], 1, SamplingParams(max_tokens=2, seed=1))  # the first engine still samples
    print(json.dumps({"gap_max": float(gaps.max()), "gap_mean": float(gaps.mean()), "tokens": gaps.numel()}))


if __name__ == "__main__":
    main(*sys.argv[1:5], *[float(x) for x in sys.argv[5:6]])
