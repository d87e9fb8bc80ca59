"""The vLLM teacher scorer: prompt logprobs of the forced sequence, one generated token discarded.

vLLM scores a token sequence by prefilling it with ``prompt_logprobs=K``: for every position it
returns the realized token's logprob plus the top-K entries (each with its 1-based rank), from the
raw logits at temperature 1. The request asks for one new token (``max_tokens=1``), which is
ignored, for no detokenization, and for flat logprobs (vLLM's ``FlatLogprobs``: each position's
run is the realized token, then the top K in rank order), which spare vLLM a dict and K + 1
objects per scored token and make reading them list slicing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from posttrain.teacher.base import ScoreRequest, SequenceScores, TeacherError, check_requests


def _flat_scores(flat: Any, req: ScoreRequest, top_k: int, n: int) -> SequenceScores:
    """Request ``n``'s scores from its flat prompt logprobs: position ``i``'s run starts at
    ``start_indices[i]`` with the realized token, followed by the top ``top_k`` best first."""
    if not hasattr(flat, "start_indices"):  # vLLM's FlatLogprobs, by its fields
        raise TeacherError(f"teacher request {n}: vLLM returned {type(flat).__name__} prompt logprobs, not flat ones")
    ids, values = flat.token_ids, flat.logprobs
    span = range(req.score_from, len(req.token_ids))
    starts = [flat.start_indices[i] for i in span]
    if any(flat.end_indices[i] - flat.start_indices[i] != top_k + 1 for i in span):
        raise TeacherError(f"teacher request {n}: vLLM returned other than {top_k + 1} prompt logprobs at a position")
    if [ids[s] for s in starts] != [req.token_ids[i] for i in span]:
        raise TeacherError(f"teacher request {n}: vLLM's prompt logprobs name other tokens than the request's")
    return SequenceScores(
        logprobs=[values[s] for s in starts],
        topk_ids=[ids[s + 1 : s + 1 + top_k] for s in starts] if top_k else None,
        topk_logprobs=[values[s + 1 : s + 1 + top_k] for s in starts] if top_k else None,
    )


class VLLMTeacher:
    """Scores forced sequences with a vLLM ``LLM`` (its own, or one passed in)."""

    def __init__(
        self,
        model_dir: str | None = None,
        *,
        llm: Any = None,
        tokenizer: Any = None,
        gpu_memory_utilization: float = 0.2,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        dtype: str = "auto",
        moe_backend: str = "auto",
        engine_args: Mapping[str, Any] | None = None,
    ) -> None:
        from posttrain.rollout.vllm_moe import moe_backend_args
        from posttrain.rollout.vllm_runtime import (
            build_llm,
            choose_engine_core_process,
            cuda_attention_backend,
            import_vllm,
        )

        vllm = import_vllm()
        self.engine_threads = torch.get_num_threads()
        self._owns_llm = llm is None
        if llm is None:
            if model_dir is None:
                raise TeacherError("VLLMTeacher needs a model directory or an LLM")
            choose_engine_core_process(separate=False)
            llm, self.engine_threads = build_llm(
                vllm,
                model=model_dir,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
                max_model_len=max_model_len,
                dtype=dtype,
                enable_prefix_caching=False,
                # the rollout engine's choice on CUDA (FLASH_ATTN for bf16/fp16; vLLM's own for fp32)
                **(cuda_attention_backend("auto", dtype) if torch.cuda.is_available() else {}),
                **moe_backend_args(moe_backend),  # rl.teacher.moe_backend: nothing for auto
                **(engine_args or {}),  # a tensor-parallel teacher lane's launcher (teacher/pool.py)
            )
        self.llm = llm
        self.vllm = vllm
        self.tokenizer = tokenizer if tokenizer is not None else llm.get_tokenizer()
        self.vocab_size = int(llm.llm_engine.model_config.get_vocab_size())
        self.max_model_len = max_model_len

    def score(self, requests: list[ScoreRequest], top_k: int) -> list[SequenceScores]:
        """Teacher scores of every request (see ``teacher.base``)."""
        check_requests(requests, self.vocab_size, self.max_model_len)
        params = self.vllm.SamplingParams(
            max_tokens=1, temperature=1.0, prompt_logprobs=top_k, flat_logprobs=True, detokenize=False
        )
        prompts = [{"prompt_token_ids": r.token_ids} for r in requests]
        from posttrain.rollout.vllm_runtime import engine_thread_count

        with engine_thread_count(self.engine_threads):
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        scores = []
        for n, (req, out) in enumerate(zip(requests, outputs, strict=True)):
            entries = out.prompt_logprobs
            if entries is None or len(entries) != len(req.token_ids):
                got = None if entries is None else len(entries)
                raise TeacherError(f"teacher request {n}: vLLM returned {got} prompt logprobs for {len(req.token_ids)}")
            scores.append(_flat_scores(entries, req, top_k, n))
        return scores

    def close(self) -> None:
        """Shut the teacher's engine core down (an engine passed in is left to its owner)."""
        llm, self.llm = self.llm, None
        if llm is None or not self._owns_llm:
            return
        from posttrain.rollout.vllm_runtime import shutdown_llm

        shutdown_llm(llm)
