"""Keep freed tensor memory in the process's heap when the policy trains on a CPU.

glibc's ``malloc`` serves every block above its mmap threshold (at most 32 MiB) with a fresh
``mmap`` and hands it back to the kernel on ``free``. On the CPU default job that is most of the
step's big tensors (the LM head's ``[tokens, vocabulary]`` logits and their gradient, a fresh set of
gradients every backward, the foreach AdamW's temporaries over all 135M parameters), so every
step page-faults about half a million fresh pages in again, zeroed by the kernel, before torch
writes them. Disabling mmap for ``malloc`` and raising the trim threshold keeps that memory in the
heap between steps: the same allocations, no faults. Nothing is computed differently (the bytes
written are the same), so runs stay bitwise identical; the resident memory stays near the step's
peak instead of dropping between steps.

Only for a policy on a CPU: a GPU run's big tensors live in CUDA's allocator, and its host memory
(checkpoint copies of large models) is better returned to the system. A no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory_in_heap"]

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 2**31 - 1  # the largest an int parameter takes: 2 GiB of free heap kept

_state = {"applied": False}


def keep_freed_memory_in_heap() -> bool:
    """Serve every ``malloc`` from the heap and keep up to 2 GiB freed there; returns whether it is
    in effect (False off Linux / glibc). Idempotent."""
    if _state["applied"]:
        return True
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # order: the trim threshold first, so no freed block is handed back between the two calls
    _state["applied"] = bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)) and bool(mallopt(_M_MMAP_MAX, 0))
    return _state["applied"]
