"""What the vLLM rollout engine sends to vLLM and how it reads the answers back: the logprob mode a
temperature needs, the sampling controls that mode can report, one request per prompt (seeded per
prompt, or unseeded when the engine seeds per call: ``rollout/vllm_seeding.py``), and
``Completion``s (token ids, sampler logprobs, top-k head) from vLLM's outputs.

Recorded logprobs come back flat (vLLM's ``FlatLogprobs``: one list each of ids, logprobs and
ranks for the whole completion) instead of a dict of ``Logprob`` objects per token: at workload W
that is 65k dicts and 65k objects fewer per call for vLLM to build and the garbage collector to
walk, and reading the sampled token's logprobs becomes a list copy (docs/benchmarks.md, "Issue 18,
seventeenth session").

Which logprobs vLLM returns is an engine-wide setting (``logprobs_mode``), not a per-request one:

- ``raw_logprobs`` (vLLM's default): ``log_softmax(raw logits)`` before penalties, temperature and
  top-k / top-p. That is the contract's ``log_softmax(logits / temperature)`` exactly when the
  temperature is 1 (or sampling is greedy, whose logprobs are reported at temperature 1), whatever
  the warping: the mode the spec's rollout-logprob features require.
- ``processed_logprobs``: the logprobs of the distribution actually sampled from, after penalties,
  temperature and top-k / top-p. Without penalty and warping that is ``log_softmax(logits / T)``,
  the contract at any temperature.

The engine is built with ``raw_logprobs`` when ``temperature == 1`` and ``processed_logprobs``
otherwise, and refuses sampling controls whose logprobs the chosen mode cannot report exactly
(``check_params_for_mode``), instead of returning a different quantity under the same name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from posttrain.errors import PosttrainError, TrainingError
from posttrain.rollout.base import Completion, FinishReason, SamplingParams


def logprobs_mode_for(temperature: float) -> str:
    """vLLM's ``logprobs_mode`` that reports ``log_softmax(logits / temperature)`` (see the module doc)."""
    return "raw_logprobs" if temperature == 1.0 else "processed_logprobs"


def check_params_for_mode(mode: str, params: SamplingParams) -> None:
    """Refuse sampling controls whose contract logprobs ``mode`` cannot report."""
    greedy = params.temperature <= 0
    if mode == "raw_logprobs" and not greedy and params.temperature != 1.0:
        raise PosttrainError(
            f"the vLLM engine was built for temperature 1 (raw logprobs) but generate got temperature="
            f"{params.temperature}; build it with temperature={params.temperature}"
        )
    if mode == "processed_logprobs":
        warped = [
            f"{knob}={value}"
            for knob, value, off in (
                ("rollout.top_p", params.top_p, params.top_p >= 1.0),
                ("rollout.top_k", params.top_k, params.top_k <= 0),
                ("rollout.repetition_penalty", params.repetition_penalty, params.repetition_penalty == 1.0),
            )
            if not off
        ]
        if warped:
            raise PosttrainError(
                f"vLLM reports temperature-{params.temperature} logprobs only without warping, but "
                f"{', '.join(warped)}: set rollout.temperature=1 (raw logprobs, any warping) or turn "
                "the warping off"
            )


def prompt_seed(seed: int, call_index: int, prompt_index: int) -> int:
    """A 62-bit vLLM request seed per (seed, call, prompt): prompts of one call draw independent
    streams; vLLM gives the ``n`` samples of a prompt ``seed + i``, so 62 bits leave headroom."""
    digest = hashlib.sha256(f"posttrain-vllm-rollout:{seed}:{call_index}:{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)


def call_requests(
    prompt_token_ids: list[list[int]],
    n: int,
    params: SamplingParams,
    *,
    call_index: int,
    eos_ids: list[int],
    record: bool,
    seed_prompts: bool = True,
    first_prompt: int = 0,
) -> tuple[list[int], list[Any], list[Any], list[bool]]:
    """The requests of one ``generate`` call: ``(owners, prompts, requests, recorded)``, where
    ``owners[i]`` is the prompt index of request ``i`` and ``recorded[i]`` whether it asks for the
    sampler's logprobs. One request of ``n`` samples per prompt, except greedy, where vLLM refuses
    n > 1: the ``n`` identical copies go as ``n`` requests. ``seed_prompts=False``: the requests go
    unseeded (the engine seeded its generators for the call, ``rollout/vllm_seeding.py``).

    With ``params.sampler_logprobs_samples = k < n`` a recording call splits each prompt's request
    in two: its first ``k`` samples, which record, and the other ``n - k``, which do not. vLLM seeds
    sample ``i`` of a request seeded ``s`` with ``s + i``, so the second request, seeded ``s + k``,
    draws exactly what samples ``k..n-1`` of the unsplit request would have drawn.

    ``first_prompt``: the call's index of prompt 0 here, when a call's prompts are split over several
    engines (``rollout/vllm_fleet.py``): each prompt is seeded by its index in the whole call, so it
    draws what it would in one engine."""
    from vllm.inputs import TokensPrompt

    k = recorded_samples(params, n, record)
    # (seed offset, samples, records) of each request a prompt gets
    if params.temperature <= 0:  # greedy: n single copies under the prompt's seed; the first k record
        parts = [(0, 1, i < k) for i in range(n)]
    elif 0 < k < n:
        parts = [(0, k, True), (k, n - k, False)]
    else:
        parts = [(0, n, k == n)]
    owners, requests, recorded = [], [], []
    for p in range(len(prompt_token_ids)):
        for offset, count, rec in parts:
            owners.append(p)
            recorded.append(rec)
            requests.append(
                sampling_request(
                    params, count, call_index, first_prompt + p, eos_ids=eos_ids, record=rec, seeded=seed_prompts,
                    seed_offset=offset,
                )
            )  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=list(prompt_token_ids[p])) for p in owners]
    return owners, prompts, requests, recorded


def recorded_samples(params: SamplingParams, n: int, record: bool) -> int:
    """How many of a prompt's ``n`` samples record the sampler's logprobs in a call that records
    (``record``): all of them unless ``sampler_logprobs_samples`` says fewer; a top-k head is
    recorded for every sample (score centering reads every one)."""
    if not record:
        return 0
    if params.logprobs_topk > 0 or params.sampler_logprobs_samples is None:
        return n
    return min(n, params.sampler_logprobs_samples)


def sampling_request(
    params: SamplingParams,
    n: int,
    call_index: int,
    prompt_index: int,
    *,
    eos_ids: list[int],
    record: bool,
    seeded: bool = True,
    seed_offset: int = 0,
) -> Any:
    """vLLM sampling params for one prompt: its own seed (unless not ``seeded``), our EOS ids, no detokenization (the
    tokenizer decodes the whole batch at once afterwards), the sampled token's logprob (+ top-k)
    only when ``record``: vLLM builds a logprob entry per token on the host otherwise."""
    from vllm import SamplingParams as VLLMSamplingParams

    return VLLMSamplingParams(
        n=n,
        max_tokens=params.max_tokens,
        temperature=max(params.temperature, 0.0),
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        repetition_penalty=params.repetition_penalty,
        seed=None
        if params.seed is None or not seeded
        else prompt_seed(params.seed, call_index, prompt_index) + seed_offset,
        stop_token_ids=eos_ids,
        logprobs=max(params.logprobs_topk, 0) if record else None,
        flat_logprobs=True,
        detokenize=False,
    )


def call_completions(
    owners: list[int], outputs: Sequence[Any], k: int, record: bool | Sequence[bool]
) -> list[Completion]:
    """The ``Completion``s of one call's vLLM outputs, grouped by prompt, samples in vLLM's index
    order (texts left empty: the caller decodes the whole batch at once). ``record``: whether the
    requests recorded the sampler's logprobs, for all of them or per request."""
    recorded = [record] * len(owners) if isinstance(record, bool) else list(record)
    completions = []
    for prompt_index, request_output, rec in zip(owners, outputs, recorded):
        for sample in sorted(request_output.outputs, key=lambda o: o.index):
            completions.append(completion_of(prompt_index, sample, k, rec))
    return completions


def completion_of(prompt_index: int, sample: Any, k: int, record: bool) -> Completion:
    """One vLLM sample as a ``Completion``: its sampler logprobs (and top-``k`` head) when ``record``."""
    token_ids = [int(t) for t in sample.token_ids]
    if sample.finish_reason not in ("stop", "length"):
        raise TrainingError(f"vLLM finished a completion with reason {sample.finish_reason!r} ({sample.stop_reason})")
    reason: FinishReason = "stop" if sample.finish_reason == "stop" else "length"
    if not record:
        return Completion(prompt_index, token_ids, None, reason, "", {})
    if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
        raise TrainingError("vLLM returned no logprob for some generated token; the engine needs logprobs=0 or more")
    logprobs, extra = _read_flat(sample.logprobs, token_ids, k)
    return Completion(prompt_index, token_ids, logprobs, reason, "", extra)


def _read_flat(flat: Any, token_ids: list[int], k: int) -> tuple[list[float], dict[str, Any]]:
    """The sampled tokens' logprobs (and the top-``k`` heads) of one completion's ``FlatLogprobs``.

    vLLM stores each position's entries as the sampled token first, then the top ``k`` in rank
    order, so position ``i``'s run starts with the sampled token at ``start_indices[i]``. With
    ``k = 0`` every run is that one entry and the lists are the answer as they stand."""
    if not hasattr(flat, "start_indices"):  # vLLM's FlatLogprobs, by its fields: unit tests run without vLLM
        raise TrainingError(f"vLLM returned {type(flat).__name__} logprobs, not the flat ones the requests ask for")
    starts, ids, values = flat.start_indices, flat.token_ids, flat.logprobs
    if k == 0 and len(ids) == len(token_ids):
        sampled_ids, logprobs = list(ids), list(values)
    else:
        sampled_ids, logprobs = [ids[s] for s in starts], [values[s] for s in starts]
    if sampled_ids != token_ids:
        raise TrainingError("vLLM's logprobs name other tokens than the ones it sampled; the completion cannot be read")
    extra: dict[str, Any] = {}
    if k > 0:
        ends = flat.end_indices
        if any(end - start != k + 1 for start, end in zip(starts, ends)):
            raise TrainingError(f"vLLM returned a logprob head of other than {k} tokens for some position")
        extra["head_ids"] = [ids[s + 1 : s + 1 + k] for s in starts]
        extra["head_logprobs"] = [values[s + 1 : s + 1 + k] for s in starts]
    return logprobs, extra
