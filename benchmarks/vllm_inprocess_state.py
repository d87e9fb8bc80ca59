"""What an in-process vLLM engine leaves behind in the trainer's process once it has generated.

    PYTHONPATH=src python benchmarks/vllm_inprocess_state.py [--apart] [--out state.json]

On one slow H100 host W's update took a third longer beside an in-process engine than beside engines
in processes of their own (docs/benchmarks.md, thirty-first session). One explanation the CPU can
test: the engine changes something process-wide that a host-bound update pays for (a thread that keeps
taking the GIL, a profiler or trace hook, torch's thread count or matmul flags, the collector). This
builds posttrain's ``VLLMRolloutEngine`` on a tiny random Llama (vLLM's CPU build), generates once,
then reports:

- each OS thread's CPU time over three seconds after it, while the main thread spins a pure-Python
  loop (a thread that kept taking the GIL would show; the loop's own pace is left out, the 2-core
  machine's noise moved it 18-35 M increments/s within one phase);
- every entry of a snapshot of interpreter and torch state that differs after the engine (switch
  interval, collector, hooks, torch threads, grad/inference modes, matmul and SDPA flags, dispatch
  and function modes, warnings filters), and the environment variables it set.

``--apart`` puts the engine core in a process of its own (``rollout.separate_engine_process``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

import torch

TOKENIZER = "tests/fixtures/smollm2_tokenizer"


def loop_pace(seconds: float = 3.0) -> float:
    """Increments per second of a pure-Python loop (the GIL's share this thread gets)."""
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for _ in range(1000):
            count += 1
    return count / seconds


def thread_cpu_s() -> dict[str, tuple[str, float]]:
    """Each OS thread of this process: its name and its CPU time so far (user + system)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return out


def state() -> dict[str, Any]:
    """Interpreter and torch settings a host-bound update could feel."""
    cuda = torch.backends.cuda
    return {
        "switch_interval": sys.getswitchinterval(),
        "gc_enabled": gc.isenabled(),
        "gc_threshold": gc.get_threshold(),
        "gc_frozen": gc.get_freeze_count(),
        "profile_hook": repr(sys.getprofile()),
        "trace_hook": repr(sys.gettrace()),
        "threading_profile_hook": repr(threading.getprofile()),
        "threading_trace_hook": repr(threading.gettrace()),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "anomaly_mode": torch.is_anomaly_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "matmul_tf32": cuda.matmul.allow_tf32,
        "matmul_bf16_reduced": cuda.matmul.allow_bf16_reduced_precision_reduction,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "sdpa_flash": cuda.flash_sdp_enabled(),
        "sdpa_mem_efficient": cuda.mem_efficient_sdp_enabled(),
        "sdpa_math": cuda.math_sdp_enabled(),
        "torch_function_modes": len(torch.overrides._get_current_function_mode_stack()),
        "torch_dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "recursion_limit": sys.getrecursionlimit(),
        "warnings_filters": len(__import__("warnings").filters),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--apart", action="store_true", help="the engine core in a process of its own")
    p.add_argument("--out", default=None, help="write the findings here as JSON")
    args = p.parse_args()
    from posttrain.models.tiny import make_tiny_model
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    torch.set_num_threads(1)
    before, env_before = state(), dict(os.environ)
    model_dir = make_tiny_model(tempfile.mkdtemp(), TOKENIZER, num_heads=2, num_kv_heads=1, seed=3)
    engine = VLLMRolloutEngine(
        model_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, separate_process=args.apart
    )
    engine.generate([[1, 5, 6, 7]] * 4, 4, SamplingParams(max_tokens=16, temperature=1.0))
    time.sleep(1.0)
    cpu_before = thread_cpu_s()
    loop_pace()
    cpu_after = thread_cpu_s()
    after = state()
    busy = {
        f"{tid} {name}": round(cpu - cpu_before.get(tid, (name, 0.0))[1], 3)
        for tid, (name, cpu) in cpu_after.items()
        if cpu - cpu_before.get(tid, (name, 0.0))[1] > 0.05
    }
    changed = {k: [before[k], after[k]] for k in before if before[k] != after[k]}
    env = {
        k: os.environ.get(k)
        for k in sorted(set(env_before) | set(os.environ))
        if env_before.get(k) != os.environ.get(k)
    }
    engine.close()
    findings = {
        "engine_core": "apart" if args.apart else "in-process",
        "threads_after": [t.name for t in threading.enumerate()],
        "threads_busy_over_0.05s_in_3s": busy,
        "state_changed": changed,
        "env_set": env,
    }
    print(json.dumps(findings, indent=1, default=str))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(findings, f, indent=1, default=str)


if __name__ == "__main__":
    main()
