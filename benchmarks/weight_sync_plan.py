"""The in-place weight sync's cost: vLLM's weight loaders against the copy plan (one foreach copy).

Builds vLLM's own model class for each shape directly (no engine, as
tests/integration/vllm_copy_plan_checks.py does, so it also runs on vLLM's CPU build, whose engine
repacks its weights), in bf16 on ``--device``, and times writing the trainer's fp32 master tensors
into it, ``--repeats`` times after one warm-up:

- ``loaders``: what a sync did before the plan: each tensor cast to bf16, then the model's own
  ``load_weights`` (``rollout/vllm_weight_load.load_in_place``);
- ``plan``: ``CopyPlan.copy_`` on the fp32 tensors (``rollout/vllm_copy_plan.py``).

Each arm reports the median wall milliseconds and, on CUDA, the host milliseconds (until the last
kernel is queued, before the synchronization): on a GPU the copies themselves are short, so the host
time is what the small step pays. Prints a markdown table and writes ``--out`` JSON.

    python benchmarks/weight_sync_plan.py --shapes tiny30,135m --device cpu
    python3 benchmarks/weight_sync_plan.py --shapes tiny30,135m,0.5b --device cuda --out sync_plan.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from make_random_model import shape_config

from posttrain.rollout.vllm_copy_plan import CopyPlan, learn_copy_plan
from posttrain.rollout.vllm_engine import _as_engine_dtype

TOKENIZER = str(Path(__file__).parents[1] / "tests" / "fixtures" / "smollm2_tokenizer")


def build(shape: str, device: str, out: Path) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """vLLM's model of ``shape`` in bf16 on ``device`` and the matching fp32 tensors on ``device``."""
    from transformers import LlamaForCausalLM
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    torch.manual_seed(0)
    hf = LlamaForCausalLM(shape_config(TOKENIZER, shape))
    hf.save_pretrained(out)
    named = [(name, t.detach().to(device)) for name, t in hf.state_dict().items()]
    config = VllmConfig(
        model_config=ModelConfig(model=str(out), tokenizer=TOKENIZER, dtype="bfloat16", enforce_eager=True),
        device_config=DeviceConfig(device=device),
    )
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16), torch.device(device):
        model = initialize_model(vllm_config=config)
    return model, named


def timed(fn: Any, repeats: int, device: str) -> dict[str, float]:
    fn()
    walls, hosts = [], []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        queued = time.perf_counter()
        if device == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        hosts.append(queued - start)
    return {"wall_ms": 1e3 * statistics.median(walls), "host_ms": 1e3 * statistics.median(hosts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny30,135m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # vLLM's per-load progress lines
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, "tcp://127.0.0.1:0", 0, backend="nccl" if args.device == "cuda" else "gloo")
        ensure_model_parallel_initialized(1, 1)
    results: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "shapes": {}}
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model, named = build(shape, args.device, Path(tmp))
            model.load_weights(iter([(n, _as_engine_dtype(t, torch.bfloat16)) for n, t in named]))
            learn_s = time.perf_counter()
            plan = learn_copy_plan(model, named)
            learn_s = time.perf_counter() - learn_s
            assert isinstance(plan, CopyPlan), plan

            def loaders(model: Any = model, named: list[tuple[str, torch.Tensor]] = named) -> None:
                with torch.no_grad():
                    model.load_weights(iter([(n, _as_engine_dtype(t, torch.bfloat16)) for n, t in named]))

            row = {
                "tensors": len(named),
                "parameters": sum(t.numel() for n, t in named if n != "lm_head.weight"),
                "learn_s": learn_s,
                "loaders": timed(loaders, args.repeats, args.device),
                "plan": timed(lambda plan=plan, named=named: plan.copy_(named), args.repeats, args.device),
            }
            results["shapes"][shape] = row
            del model, named
    print("| shape | tensors | loaders: wall / host ms | plan: wall / host ms | plan learned in |")
    print("| --- | --- | --- | --- | --- |")
    for shape, r in results["shapes"].items():
        lo, pl = r["loaders"], r["plan"]
        print(
            f"| {shape} | {r['tensors']} | {lo['wall_ms']:.2f} / {lo['host_ms']:.2f} | "
            f"{pl['wall_ms']:.2f} / {pl['host_ms']:.2f} | {r['learn_s']:.2f} s |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
