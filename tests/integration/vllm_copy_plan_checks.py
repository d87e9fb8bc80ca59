"""Run as a script by test_vllm_copy_plan.py: builds vLLM's own model classes on the CPU from tiny
random checkpoints, without an engine, and prints what the copy plan (rollout/vllm_copy_plan.py)
does on each as one JSON line.

Without an engine because vLLM's CPU build repacks every linear weight after loading and empties the
parameter (``dispatch_cpu_unquantized_gemm``), so an engine's model has nothing to write in place;
built directly, the model keeps the parameters a CUDA build keeps, with the same weight loaders. In a
process of its own because it initialises vLLM's distributed state, which the engine tests beside it
would then inherit.

    python tests/integration/vllm_copy_plan_checks.py OUT_DIR TOKENIZER_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def tiny_checkpoints(out: Path, tokenizer_dir: str) -> dict[str, str]:
    """A Llama with a tied head, one without, and a Qwen2 (biased q/k/v), fp32, random."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from posttrain.models.tiny import make_tiny_model

    dirs = {
        "llama_tied": make_tiny_model(str(out / "llama_tied"), tokenizer_dir, num_heads=2, num_kv_heads=1, seed=1),
        "llama_untied": make_tiny_model(
            str(out / "llama_untied"), tokenizer_dir, num_heads=2, num_kv_heads=1, seed=2, tie_word_embeddings=False
        ),
    }
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(3)
    qwen = Qwen2ForCausalLM(config)
    qwen.save_pretrained(out / "qwen2")
    tokenizer.save_pretrained(out / "qwen2")
    dirs["qwen2"] = str(out / "qwen2")
    return dirs


def check(model_dir: str) -> dict[str, object]:
    """Learn the plan on transfer A after the loaders wrote A (as the engine does), then write transfer
    B once by the plan and once by the loaders: every parameter must come out the same."""
    from transformers import AutoModelForCausalLM
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from posttrain.rollout.vllm_copy_plan import CopyPlan, learn_copy_plan

    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="bfloat16", max_model_len=256, enforce_eager=True),
        device_config=DeviceConfig(device="cpu"),
    )
    with set_current_vllm_config(config):
        with set_default_torch_dtype(torch.bfloat16):  # as vLLM's loader builds it
            model = initialize_model(vllm_config=config)
        first = list(AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items())  # fp32 masters
        second = [(name, t + 0.01 * torch.randn_like(t)) for name, t in first]
        model.load_weights(iter(first))
        plan = learn_copy_plan(model, first)
        if isinstance(plan, str):
            return {"plan": False, "reason": plan}
        assert isinstance(plan, CopyPlan)
        mismatched = plan.mismatches(first)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        plan.copy_(second)
        by_plan = {name: p.detach().clone() for name, p in model.named_parameters()}
        model.load_weights(iter(second))
        differing = [name for name, p in model.named_parameters() if not torch.equal(p, by_plan[name])]
        unmoved = [name for name, value in by_plan.items() if torch.equal(value, before[name])]
        view_sync = check_view_sync(model, first)
    return {
        "plan": True,
        "tensors": len(plan.names),
        "transfer": len(first),
        "nowhere": sorted(plan.nowhere),
        "mismatched_after_loaders": mismatched,
        "differing_from_loaders": differing,
        "bfloat16": all(p.dtype == torch.bfloat16 for p in model.parameters()),
        "not_moved_by_plan": unmoved,
        "view_sync": view_sync,
    }


def check_view_sync(model: torch.nn.Module, first: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    """The engine process's side of ``rollout.separate_engine_process`` (``ViewSync``) on views of one
    flat buffer, as the trainer fills it (cast to the engine's bf16): two syncs, then the loaders write
    the same transfer; every parameter must come out as the second sync left it."""
    from posttrain.rollout.vllm_shared_weights import ViewSync, buffer_views, plan_layout

    transfers = [[(n, (t + 0.02 * k * torch.randn_like(t)).to(torch.bfloat16)) for n, t in first] for k in (1, 2)]
    layout, size = plan_layout(transfers[0])
    views = buffer_views(torch.empty(size, dtype=torch.uint8), layout)
    sync = ViewSync(views, in_place=True)
    paths = []
    for pairs in transfers:
        torch._foreach_copy_([v for _, v in views], [t for _, t in pairs])
        paths.append(sync.sync(model, lambda: paths.append("reload"))[0])
    by_views = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.load_weights(iter(transfers[1]))
    return {
        "paths": paths,
        "differing_from_loaders": [n for n, p in model.named_parameters() if not torch.equal(p, by_views[n])],
    }


def main(out: str, tokenizer_dir: str) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    dirs = tiny_checkpoints(Path(out), tokenizer_dir)
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method="tcp://127.0.0.1:0", backend="gloo"
        )
        ensure_model_parallel_initialized(1, 1)
    print(json.dumps({name: check(d) for name, d in dirs.items()}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
