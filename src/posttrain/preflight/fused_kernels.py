"""The ``model.fused_kernels=true`` rules (Liger-Kernel's Triton RMSNorm, SwiGLU and RoPE;
``models/fused_kernels.py``), checked before any model loads (``auto``, the default, is never refused:
``fused_kernels_choice`` turns it off where one of these fails):

* a CUDA policy: ``model.device=cpu``, or ``auto`` where torch is a CPU build, is refused (Triton
  kernels run on CUDA only);
* Liger-Kernel installed;
* a model type posttrain patches (``FUSED_MODEL_TYPES``: llama, qwen2, qwen3), read from the model
  directory's ``config.json`` when it is on disk (the patch refuses others again after loading);
* not with ``model.compile``: both fuse the same elementwise work, and dynamo tracing through
  Liger's autograd functions has not run here;
* not with LoRA: peft's wrapped projections under Liger's SwiGLU have not run here.

And the ``model.triton_logprob_head=true`` rules (``policy/logprob_kernels.py``): a CUDA policy, and
Triton installed (CUDA builds of torch ship it; found without importing it).

Nothing here imports torch.
"""

from __future__ import annotations

import importlib.util

from posttrain.config.schema import ModelConfig, RunConfig
from posttrain.models.fused_kernels import FUSED_MODEL_TYPES, INSTALL_HINT, liger_installed
from posttrain.models.loading import local_model_config
from posttrain.preflight.findings import Findings

OFF = "set model.fused_kernels=false"


def policy_off_cuda(model: ModelConfig, cuda_major: int | None) -> str | None:
    """Why the policy will not be on CUDA (``model.device=cpu``, or ``auto`` with a CPU build of torch,
    ``cuda_major`` None), else None: the rule of the knobs that run on CUDA only."""
    if model.device == "cpu":
        return "model.device=cpu"
    if model.device == "auto" and cuda_major is None:
        return "model.device=auto means the CPU (torch is a CPU build)"
    return None


def check_fused_kernels(cfg: RunConfig, out: Findings, cuda_major: int | None) -> None:
    """``cuda_major``: the CUDA major version torch is built for, None for a CPU build."""
    model = cfg.model
    if model.fused_kernels is not True:  # auto turns itself off where these would refuse it
        return
    head = "model.fused_kernels=true"
    if (where := policy_off_cuda(model, cuda_major)) is not None:
        out.errors.append(f"{head} runs Triton kernels on CUDA only, but {where}; {OFF}")
    if not liger_installed():
        out.errors.append(f"{head} needs Liger-Kernel, which is not installed: {INSTALL_HINT}; or {OFF}")
    if model.compile:
        out.errors.append(
            f"{head} and model.compile=true both fuse the update's elementwise operations, and compiling "
            f"through Liger's kernels has not run here; choose one ({OFF} or model.compile=false)"
        )
    if model.lora.enabled:
        out.errors.append(f"{head} with LoRA (model.lora.rank > 0) has not run here; {OFF}")
    found = local_model_config(model.name_or_path, model.revision)  # None: check_model_path names the problem
    if found is not None and (model_type := found[1].get("model_type")) not in FUSED_MODEL_TYPES:
        out.errors.append(
            f"{head}: {found[0]} has model_type {model_type!r}; posttrain patches "
            f"{', '.join(FUSED_MODEL_TYPES)} only; {OFF}"
        )


def check_triton_logprob_head(cfg: RunConfig, out: Findings, cuda_major: int | None) -> None:
    """``cuda_major``: the CUDA major version torch is built for, None for a CPU build."""
    if cfg.model.triton_logprob_head is not True:  # auto turns itself off where it cannot run
        return
    head, off = "model.triton_logprob_head=true", "set model.triton_logprob_head=false"
    if (where := policy_off_cuda(cfg.model, cuda_major)) is not None:
        out.errors.append(f"{head} runs Triton kernels on CUDA only, but {where}; {off}")
    elif importlib.util.find_spec("triton") is None:
        out.errors.append(f"{head} needs Triton, which is not installed (CUDA builds of torch ship it); {off}")
