"""The float32 vLLM engine against a CPU fp32 forward, on one GPU, after each kind of weight update
that tests/gpu/test_tp_lanes_gpu.py sends (TP 1 here: what the tensor-parallel lanes add is measured
against this).

A tiny random Llama (two heads of 32) starts the engine; its sampler logprobs are compared with a
CPU fp32 forward of the same weights (largest |gap| over every sampled token), then again after
loading (a) a fresh random model of another seed (the same scale) and (b) the start weights plus
0.5 x N(0, 1) noise (logits tens of times larger). Then a float32 vLLM teacher is built on the GPU
(vLLM refused FLASH_ATTN for it before 2026-12-04) and its prompt logprobs compared likewise.

    python benchmarks/vllm_fp32_gap.py --out gaps.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from posttrain.models.tiny import make_tiny_model
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.vllm_engine import VLLMRolloutEngine

TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "smollm2_tokenizer"
PROMPTS = [[1780, 314, 216, 34, 1232, 216, 35, 47, 657, 314], [9825, 42, 582, 827, 1296, 1876], [504, 6376, 314]]


def gap(model: torch.nn.Module, batch: object) -> float:
    worst = 0.0
    with torch.no_grad():
        for c in batch.completions:  # type: ignore[attr-defined]
            prompt = PROMPTS[c.prompt_index]
            logits = model(input_ids=torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
            want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            worst = max(worst, (torch.tensor(c.logprobs) - want).abs().max().item())
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    start_dir = make_tiny_model(str(tmp / "a"), str(TOKENIZER), num_heads=2, num_kv_heads=1)
    other_dir = make_tiny_model(str(tmp / "b"), str(TOKENIZER), num_heads=2, num_kv_heads=1, seed=1)
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    start, other, noisy = load(start_dir), load(other_dir), load(start_dir)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for q in noisy.parameters():
            q.add_(0.5 * torch.randn(q.shape, generator=gen))
    engine = VLLMRolloutEngine(
        start_dir, dtype="float32", max_model_len=256, gpu_memory_utilization=0.3, enforce_eager=True
    )
    params = SamplingParams(max_tokens=12, seed=1)
    report: dict[str, float] = {"start": gap(start, engine.generate(PROMPTS, 4, params))}
    for version, (name, model) in enumerate((("fresh_seed", other), ("noisy", noisy)), start=1):
        engine.load_weights(dict(model.state_dict()), version=version)
        batch = engine.generate(PROMPTS, 4, params)
        report[name] = gap(model, batch)
        report[f"{name}_vs_start"] = gap(start, batch)
        with torch.no_grad():
            report[f"{name}_max_abs_logit"] = model(input_ids=torch.tensor([PROMPTS[0]])).logits.abs().max().item()
    engine.close()
    print(json.dumps(report, indent=1), flush=True)

    from posttrain.teacher.base import ScoreRequest
    from posttrain.teacher.vllm_teacher import VLLMTeacher

    teacher = VLLMTeacher(start_dir, dtype="float32", max_model_len=128, gpu_memory_utilization=0.2)
    scores = teacher.score([ScoreRequest(ids, 2) for ids in PROMPTS], 4)
    worst = 0.0
    with torch.no_grad():
        for ids, s in zip(PROMPTS, scores, strict=True):
            lp = torch.log_softmax(start(input_ids=torch.tensor([ids])).logits[0].float(), -1)
            want = lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0][-len(s.logprobs) :]
            worst = max(worst, (torch.tensor(s.logprobs) - want).abs().max().item())
    report["teacher_fp32_cuda"] = worst
    print(json.dumps(report, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
