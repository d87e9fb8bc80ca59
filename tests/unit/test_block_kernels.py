"""``models/block_kernels.py`` on a machine without a GPU: the RMSNorm kernels in Triton's interpreter
(``block_kernels_interpreted.py``, a process of its own with ``TRITON_INTERPRET=1``) against float64 and
the eager module, and the rebinding of Liger-patched RMSNorm modules. The compiled kernels, and a real
Liger patch, run in ``tests/gpu/test_block_kernels_gpu.py``."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
from torch import nn

from posttrain.models import block_kernels

sys.path.insert(0, str(Path(__file__).parent))
from block_kernels_interpreted import CASES
from triton_interpreter import run_interpreted


def test_the_kernels_match_float64_and_the_eager_module_in_tritons_interpreter() -> None:
    """Output, input gradient and weight gradient within fp32 rounding of float64 for fp32 inputs, and
    for bf16 inputs as close as the eager module's own bf16 arithmetic, for every case (several tiles,
    partial tiles, a hidden size that is not a power of two, more tiles than backward programs)."""
    stdout = run_interpreted("block_kernels_interpreted.py")
    assert stdout.count("ok ") == 2 * len(CASES), stdout


class LigerPatchedNorm(nn.Module):
    """What Liger's ``_patch_rms_norm_module`` leaves on an RMSNorm instance (its casting mode, offset
    and epsilon as attributes, its forward bound in the instance's ``__dict__``): a stand-in, because
    liger-kernel is installed on GPU machines only. The real patch runs in the GPU test."""

    def __init__(self, hidden: int, offset: float = 0.0, casting_mode: str = "llama"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon, self.offset, self.casting_mode = 1e-6, offset, casting_mode
        self.calls = 0

        def liger_forward(module: LigerPatchedNorm, x: torch.Tensor) -> torch.Tensor:
            module.calls += 1
            return x * 2

        self.__dict__["forward"] = types.MethodType(liger_forward, self)


def test_liger_llama_norms_are_rebound_and_cpu_calls_keep_ligers_forward() -> None:
    model = nn.Sequential(
        LigerPatchedNorm(8), LigerPatchedNorm(8, offset=1.0), LigerPatchedNorm(8, casting_mode="gemma")
    )
    plain = nn.LayerNorm(8)
    model.append(plain)
    assert block_kernels.use_rows_rms_norm(model) == 1  # Gemma's offset and casting mode are not this function
    assert block_kernels.use_rows_rms_norm(model) == 1  # again: counted, not wrapped twice
    rebound, offset, gemma = model[0], model[1], model[2]
    assert vars(rebound)["forward"].__func__ is block_kernels._rows_forward
    assert vars(offset)["forward"].__func__ is not block_kernels._rows_forward
    assert "forward" not in vars(plain)
    x = torch.randn(3, 8)
    torch.testing.assert_close(rebound(x), x * 2)  # a CPU tensor: Liger's forward
    assert rebound.calls == 1
    rebound.__dict__["forward"] = types.MethodType(lambda m, x: x, rebound)  # Liger patched it again
    assert block_kernels.use_rows_rms_norm(model) == 1
    assert vars(rebound)["forward"].__func__ is block_kernels._rows_forward
    block_kernels.use_liger_rms_norm(model)  # the benchmarks' before arm
    torch.testing.assert_close(rebound(x), x)
    assert gemma.calls == offset.calls == 0


def test_the_norm_tiles_cover_the_hidden_size() -> None:
    for hidden in (64, 96, 896, 1536, 3584, 5000, 8192):
        rows, cols, warps = block_kernels._tiling(hidden)
        assert cols >= hidden and cols & (cols - 1) == 0 and cols < 2 * hidden
        assert rows * cols == max(block_kernels._TILE, cols)
        assert warps in (4, 8)
