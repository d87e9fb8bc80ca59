"""Counting the calls of a kernel's entry point in a GPU test (``test_fused_kernels_gpu.py``,
``test_block_kernels_gpu.py``): which kernels a patched model actually ran."""

from __future__ import annotations

from typing import Any

import pytest


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, calls: dict[str, int], key: str) -> None:
    """Count the calls of ``owner.name`` (a kernel's entry point) in ``calls[key]``, until the test ends."""
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[key] = calls.get(key, 0) + 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, staticmethod(counted) if isinstance(owner, type) else counted)
