"""Capture and restore every global random-number generator a run draws from.

Python's ``random``, NumPy's legacy global generator, torch's CPU generator and, when CUDA is
available, every CUDA device's generator. The captured state is plain JSON (byte states as base64)
so that it lives in ``training_state.json`` next to the counters it belongs with. The rollout
engine's sampling stream is not here: it is seeded per call from its own call counter, which the
engine's ``state_dict`` carries.
"""

from __future__ import annotations

import base64
import logging
import random
from typing import Any

import numpy as np
import torch

_log = logging.getLogger("posttrain.checkpoint")

RNG_FORMAT = 1


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng() -> dict[str, Any]:
    """The state of every global generator, as JSON-serialisable values."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": kind,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": _b64(torch.get_rng_state()),
        "torch_cuda": None,
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put every generator back to ``state`` (from ``capture_rng``).

    CUDA states restore device by device; a checkpoint written with CUDA and resumed without it
    (or with fewer devices) restores what it can and warns, because draws on the missing devices
    can then no longer match the uninterrupted run.
    """
    if state.get("format") != RNG_FORMAT:
        raise ValueError(f"unknown RNG state format {state.get('format')!r} (expected {RNG_FORMAT})")
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npy = state["numpy"]
    keys = np.asarray(npy["keys"], dtype=np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    cuda = state.get("torch_cuda")
    if not cuda:
        return
    if not torch.cuda.is_available():
        _log.warning("the checkpoint holds CUDA RNG states but no CUDA device is visible: not restored")
        return
    n = min(len(cuda), torch.cuda.device_count())
    if n < len(cuda) or n < torch.cuda.device_count():
        _log.warning(
            "the checkpoint holds CUDA RNG states for %d device(s), this process sees %d: restored the first %d only",
            len(cuda),
            torch.cuda.device_count(),
            n,
        )
    for device in range(n):
        torch.cuda.set_rng_state(_unb64(cuda[device]), device)
