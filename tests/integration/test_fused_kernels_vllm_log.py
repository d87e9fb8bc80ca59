"""vLLM's JIT monitor (its CPU build here) stays quiet about the fused kernels' first compiles:
colocated vLLM hooks Triton process-wide and would report the update's first compile of each Liger
kernel, or of the logprob head's (``policy/logprob_kernels.py``), as an inference latency spike
(``models/fused_kernels.py``). Its warnings about any other kernel still reach the log."""

from __future__ import annotations

import logging

import pytest

from posttrain.models.fused_kernels import VLLM_JIT_LOGGERS, drop_vllm_compile_warnings

pytestmark = pytest.mark.vllm


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_vllms_compile_warnings_name_no_fused_kernel() -> None:
    from vllm.utils import jit_monitor

    assert jit_monitor.logger.name in VLLM_JIT_LOGGERS  # a logger the filter goes on
    collect = _Collect()
    jit_monitor.logger.addHandler(collect)
    try:
        drop_vllm_compile_warnings(frozenset({"_rms_norm_forward_kernel", "_triton_rope"}))
        drop_vllm_compile_warnings(frozenset({"logsumexp_rows"}))  # adds to the same filter
        names = ("_rms_norm_forward_kernel", "_topk_log_softmax_kernel", "_triton_rope", "logsumexp_rows", "_other")
        for name in names:
            jit_monitor._handle_jit_event(backend="Triton kernel", event="JIT compilation", fn_name=name)
    finally:
        jit_monitor.logger.removeHandler(collect)
    assert len(collect.messages) == 2, collect.messages
    assert "during inference: _topk_log_softmax_kernel." in collect.messages[0]
    assert "during inference: _other." in collect.messages[1]
