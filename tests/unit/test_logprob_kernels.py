"""``model.triton_logprob_head`` on a machine without a GPU (``policy/logprob_kernels.py``).

The two Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``: the same kernel code over
CPU tensors, in a process of its own, ``logprob_kernels_interpreted.py``; vLLM's CPU build brings
Triton, and ``scripts/test.sh`` makes sure of it), against float64 references: the log-sum-exp forward
and the gradient backward, with several ids per row, repeated ids, a temperature, and vocabularies
across the kernels' block size; and they compile for an sm_90 GPU here, without one. Then the knob:
the preflight refuses it off CUDA by name, the trainer marks the policy's and the reference's heads,
and a marked head's CPU chunks keep the fp32 ``log_softmax``. The compiled kernels run in
``tests/gpu/test_logprob_head_gpu.py``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.config.loading import build_config
from posttrain.models.structure import split_body_and_head
from posttrain.policy import logprob_kernels
from posttrain.policy.logprobs import chunked_head_logprobs
from posttrain.preflight import fused_kernels as preflight
from posttrain.preflight.findings import Findings
from posttrain.preflight.grpo import grpo_preflight

sys.path.insert(0, str(Path(__file__).parent))
from logprob_kernels_interpreted import CASES
from triton_interpreter import run_interpreted

ON = "model.triton_logprob_head=true"


def test_the_kernels_match_float64_in_tritons_interpreter() -> None:
    """Values within 1e-5 and bf16 gradients within half an ulp of float64, for every case of
    ``logprob_kernels_interpreted.CASES`` and a row whose maximum grows across blocks (that module, in a
    process of its own: the interpreter must be on before Triton is first imported)."""
    stdout = run_interpreted("logprob_kernels_interpreted.py")
    assert stdout.count("ok ") == len(CASES) + 1, stdout


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_the_kernels_compile_for_hopper(dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the interpreter cannot show: both kernels go through Triton's compiler to an sm_90 (H100/H200)
    binary here, without a GPU (Triton ships ptxas), for each logits dtype and for one and three ids per
    row, with the argument types and the alignment a launch gives them when the vocabulary is a multiple
    of 16 (151,936, 128,256, 49,152 ...): then the logits are read and the gradient written 16 bytes at a
    time, and a bf16 gradient is stored rounded to nearest."""
    triton = pytest.importorskip("triton", reason="Triton comes with vLLM's CPU build, which scripts/test.sh installs")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while it is unset
    kernels = logprob_kernels._kernels()
    assert kernels is not None
    target = GPUTarget("cuda", 90, 32)
    scalars = {"row_stride": "i32", "vocab": "i32", "temperature": "fp32"}
    pointers = {"logits_ptr": f"*{dtype}", "lse_ptr": "*fp32", "ids_ptr": "*i64", "grad_out_ptr": "*fp32"}
    pointers["grad_in_ptr"] = f"*{dtype}"

    def compile_for_hopper(kernel: Any, constexprs: dict[str, int]) -> dict[str, Any]:
        names = kernel.arg_names
        signature = {n: pointers.get(n) or scalars.get(n) or "constexpr" for n in names}
        # a launch marks 16-byte-aligned pointers and integers divisible by 16 the same way
        aligned = {
            (names.index(n),): [["tt.divisibility", 16]] for n in names if n in pointers or n in ("row_stride", "vocab")
        }
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
        asm: dict[str, Any] = triton.compile(source, target=target, options={"num_warps": logprob_kernels._WARPS}).asm
        assert asm["cubin"]
        return asm

    lse_kernel, grad_kernel = kernels
    lse_ptx = compile_for_hopper(lse_kernel, {"BLOCK": logprob_kernels._BLOCK})["ptx"]
    assert "ld.global.v4.b32" in lse_ptx  # 16-byte reads of the logits
    for columns in (1, 3):
        grad_ptx = compile_for_hopper(grad_kernel, {"J": columns, "BLOCK": logprob_kernels._BLOCK})["ptx"]
        assert "ld.global.v4.b32" in grad_ptx and "st.global.v4.b32" in grad_ptx
        if dtype == "bf16":
            assert "cvt.rn.bf16" in grad_ptx  # round to nearest: one rounding of the fp32 gradient


def test_no_chunk_on_the_cpu_takes_the_kernels(tiny_model_dir: str) -> None:
    """A marked head's CPU logits keep the fp32 log_softmax: the kernels are for CUDA tensors."""
    head = torch.nn.Linear(8, 50, bias=False)
    logprob_kernels.mark_head(head, True)
    assert not logprob_kernels.enabled_for(head, torch.zeros(2, 50))
    hidden = torch.randn(5, 8)
    ids = torch.randint(50, (5, 1))
    out = chunked_head_logprobs(hidden, ids, head, temperature=1.0, softcap=None, chunk_tokens=16)
    assert torch.equal(out, torch.log_softmax(head(hidden), dim=-1).gather(-1, ids))


def test_the_trainer_marks_the_policy_and_reference_heads(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer

    for on in (True, False):
        cfg = build_config(None, [f"model.triton_logprob_head={str(on).lower()}", "rl.kl_beta=0.1"])
        policy, reference = (AutoModelForCausalLM.from_pretrained(tiny_model_dir) for _ in range(2))
        PolicyTrainer(policy, cfg, objective=grpo_objective(cfg), pad_id=0, ref_model=reference)
        for model in (policy, reference):
            assert getattr(split_body_and_head(model)[1], logprob_kernels._MARK) is on


def test_auto_marks_the_heads_of_a_cuda_policy_with_triton_only(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    auto = build_config(None, []).model
    assert auto.triton_logprob_head == "auto"  # the default
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    head = split_body_and_head(policy)[1]

    def marked(device: str) -> tuple[bool, str]:
        note = logprob_kernels.use_triton_head(policy, None, model_cfg=auto, device=torch.device(device))
        return getattr(head, logprob_kernels._MARK), note

    assert marked("cpu") == (False, "model.triton_logprob_head=auto: off, the policy is on cpu, not CUDA")
    # the choice reads the device's type only, so a CPU model stands for a CUDA one here
    monkeypatch.setattr(logprob_kernels.importlib.util, "find_spec", lambda name: object())
    assert marked("cuda") == (True, "model.triton_logprob_head=auto: on (a CUDA policy, Triton installed)")
    monkeypatch.setattr(logprob_kernels.importlib.util, "find_spec", lambda name: None)
    assert marked("cuda") == (False, "model.triton_logprob_head=auto: off, Triton is not installed")


def _errors(*overrides: str, cuda_major: int | None) -> list[str]:
    findings = Findings()
    preflight.check_triton_logprob_head(build_config(None, list(overrides)), findings, cuda_major=cuda_major)
    return findings.errors


def test_the_preflight_refuses_it_off_cuda_and_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _errors("model.device=cpu", cuda_major=None) == []  # auto: off where it cannot run, no error
    assert _errors("model.triton_logprob_head=false", cuda_major=None) == []
    assert _errors(ON, "model.device=cpu", cuda_major=13) == [
        "model.triton_logprob_head=true runs Triton kernels on CUDA only, but model.device=cpu; "
        "set model.triton_logprob_head=false"
    ]
    (error,) = _errors(ON, cuda_major=None)
    assert "but model.device=auto means the CPU (torch is a CPU build)" in error
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name: None)
    assert _errors(ON, "model.device=cuda", cuda_major=13) == [
        "model.triton_logprob_head=true needs Triton, which is not installed (CUDA builds of torch ship it); "
        "set model.triton_logprob_head=false"
    ]


def test_the_run_preflight_reports_it_before_any_model_loads(model_dir: Path) -> None:
    errors = grpo_preflight(build_config(None, [ON, f"model.name_or_path={model_dir}", "model.device=cpu"])).errors
    assert any("model.triton_logprob_head=true runs Triton kernels on CUDA only" in e for e in errors), errors
