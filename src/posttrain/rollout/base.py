"""The rollout engine protocol shared by the transformers engine, the vLLM engine and the proxy to a
remote (Ray) replica, and the types they exchange."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from posttrain.distributed.fsdp import PolicyWeights

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling controls; ``top_k <= 0`` disables top-k, ``top_p == 1`` disables nucleus."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    seed: int | None = None
    sampler_logprobs_every: int = 1
    """Engines whose logprobs cost extra (vLLM) record ``Completion.logprobs`` only when their weights
    come from an optimizer step that is a multiple of N (the initial weights included); 0: never.
    ``logprobs_topk > 0`` records them always."""
    sampler_logprobs_samples: int | None = None
    """When recording, only the first N samples of each prompt record them (``None``: all); engines
    whose logprobs are free may record every one. ``logprobs_topk > 0`` records every sample."""
    logprobs_topk: int = 0
    """When > 0 the engine also returns, per generated token, the top-k ids and logprobs of the
    distribution it sampled from (``Completion.extra["head_ids"]`` / ``["head_logprobs"]``: one list of
    k entries per token), the head score centering needs. 0: nothing extra is computed."""


@dataclass
class Completion:
    """One sampled completion.

    ``token_ids`` are the generated ids (ending with EOS when ``finish_reason == "stop"``);
    ``logprobs`` holds the sampler's log-probability of each generated token under the
    distribution it sampled from (raw model logits divided by temperature, before top-p/top-k),
    one float per token, or None when this call did not record them
    (``SamplingParams.sampler_logprobs_every``). ``extra`` holds optional per-token additions, such as the top-k head
    requested with ``SamplingParams.logprobs_topk``.
    """

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutBatch:
    """What ``generate`` returns: ``n`` completions per prompt, grouped by prompt in order, plus the
    tokenized prompts (``prompt_token_ids[i]`` belongs to prompt ``i``)."""

    prompt_token_ids: list[list[int]]
    completions: list[Completion]
    weight_version: int = 0
    stats: dict[str, float] = field(default_factory=dict)


def generation_stats(generated_tokens: int, gen_s: float) -> dict[str, float]:
    """The ``rollout/*`` metrics every engine reports for one ``generate`` call."""
    return {
        "rollout/gen_s": gen_s,
        "rollout/tokens_per_s": generated_tokens / gen_s if gen_s > 0 else 0.0,
        "rollout/generated_tokens": float(generated_tokens),
    }


def check_generate_inputs(prompt_token_ids: list[list[int]], n: int, params: SamplingParams) -> None:
    """What every engine refuses before sampling: no samples, no new tokens, or an empty prompt."""
    if n < 1:
        raise ValueError(f"rl.group_size (n) must be >= 1, got {n}")
    if params.max_tokens < 1:
        raise ValueError(f"rollout.max_tokens must be >= 1, got {params.max_tokens}")
    empty = [i for i, p in enumerate(prompt_token_ids) if len(p) == 0]
    if empty:
        raise ValueError(f"prompt(s) {empty[:5]} have no tokens; every prompt needs at least one token")


class RolloutEngine(Protocol):
    """Samples completions. Engines receive policy weights through ``receive_weights``."""

    @property
    def weight_version(self) -> int:
        """The optimizer step whose weights the engine samples with (0: the initial weights)."""
        ...

    def generate(self, prompt_token_ids: list[list[int]], n: int, params: SamplingParams) -> RolloutBatch: ...

    def receive_weights(self, weights: PolicyWeights, version: int) -> None:
        """Take the policy's current weights and stamp ``version`` only after the whole transfer
        succeeded. Every policy rank's engine calls it in step (``weights.full_state_dict()`` is a
        collective when the policy is sharded); an engine that samples with the policy module itself
        (``weights.shares(module)``) has nothing to copy."""
        ...

    def close(self) -> None: ...


class ResumableEngine(RolloutEngine, Protocol):
    """An engine whose sampling stream can be checkpointed (the call counter that seeds it)."""

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: Any) -> None: ...
