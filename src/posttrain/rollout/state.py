"""The state every rollout engine keeps: its weight version, its call counter, and whether a failed
weight sync poisoned it.

* The **weight version** is the optimizer step whose weights the engine holds; it is stamped
  (``commit``) only once a whole transfer succeeded, and every ``RolloutBatch`` carries it.
* The **call counter** numbers ``generate`` calls (``next_call``): engines seed each call's sampling
  from ``(params.seed, call index)``, so the counter is the sampling stream's position. It is what
  ``state_dict`` saves in a checkpoint (``{"generate_calls": n}``, the key checkpoints store under
  ``engine_state``), so a resumed run draws the same samples.
* **Poisoned**: a transfer that failed midway leaves a mix of two versions in the engine. ``poison``
  records why; from then on ``check_usable`` refuses, with the engine's own message.

Whether the weights of a version come with the sampler's logprobs (``records_logprobs``) is keyed on
the weight version too, not on the call counter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain.errors import TrainingError
from posttrain.rollout.base import SamplingParams

RESUME_HINT = "Resume from the last checkpoint (rl.resume=auto)."
CALLS_KEY = "generate_calls"


class EngineState:
    """Version, call counter and poison of one engine (or replica, or proxy to one).

    ``refusal`` is what ``check_usable`` raises once poisoned: a template whose ``{reason}`` becomes
    the poisoning reason (each engine words it for what it is)."""

    def __init__(self, refusal: str = "the rollout engine cannot sample: {reason}. " + RESUME_HINT) -> None:
        self.refusal = refusal
        self.weight_version = 0
        self.calls = 0
        self.poisoned: str | None = None

    def check_usable(self) -> None:
        """Refuse (``TrainingError``) once a failed sync left mixed weights behind."""
        if self.poisoned is not None:
            raise TrainingError(self.refusal.format(reason=self.poisoned))

    def next_call(self) -> int:
        """The index of the ``generate`` call starting now (0 for the first); counts it."""
        index = self.calls
        self.calls += 1
        return index

    def commit(self, version: int) -> None:
        """Stamp ``version``: the whole transfer of its weights succeeded."""
        self.weight_version = version

    def poison(self, reason: str, hint: str = RESUME_HINT) -> TrainingError:
        """Mark the engine unusable because of ``reason``; returns the error to raise (``reason``
        followed by ``hint``), for ``raise state.poison(...) from err``."""
        self.poisoned = reason
        return TrainingError(f"{reason}. {hint}")

    def state_dict(self) -> dict[str, int]:
        """The sampling stream's position (saved in checkpoints so a resume draws the same samples)."""
        return {CALLS_KEY: self.calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.calls = int(state[CALLS_KEY])


class HoldsEngineState:
    """The ``RolloutEngine`` state methods of an engine whose ``state`` is its own ``EngineState``
    (the transformers engine, the vLLM engine, a fleet of vLLM engines)."""

    state: EngineState

    @property
    def weight_version(self) -> int:
        return self.state.weight_version

    def state_dict(self) -> dict[str, int]:
        """The sampling stream's position (saved in checkpoints so a resume draws the same samples)."""
        return self.state.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state.load_state_dict(state)


def records_logprobs(params: SamplingParams, weight_version: int) -> bool:
    """Whether sampling with the weights of optimizer step ``weight_version`` records the sampler's
    logprobs: always when a top-k head is asked for, else when the version is a multiple of
    ``sampler_logprobs_every`` (the initial weights, version 0, included); never when it is 0.

    Keyed on the weight version, not on a call counter, so every call of one training step, on
    every rank and every replica, makes the same choice: the trainer then sees a whole step with
    or without them, and ranks reduce the same metrics."""
    every = params.sampler_logprobs_every
    return params.logprobs_topk > 0 or (every > 0 and weight_version % every == 0)
