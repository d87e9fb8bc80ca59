"""How the loop gets its next batch: on-policy (sample, then train) or one step off-policy.

On-policy, batch k is sampled with the weights of update k-1 and trained by update k, one after the
other. With ``rl.max_off_policy_steps=1`` the rollout of batch k+1 runs in a background thread
while the policy trains on batch k, so a step costs about ``max(rollout, update) + weight sync``
instead of their sum. The price: batch k+1 is sampled with the weights of update k-1 and trained by
update k+1, one update late. The objective therefore takes its ratio against the sampler's own
logprobs (``rl.use_rollout_logprobs_for_loss=true``, which the preflight requires), so the clipped
surrogate corrects for the staleness exactly as PPO does for its old policy.

The engine's weights must not change while it samples: the next weight sync waits until the
rollout in flight has finished (``settle``). Only an engine with its own copy of the weights (vLLM)
can sample while the policy trains; the transformers engine samples with the training module
itself, so the preflight refuses the mode there. With vLLM's engine core in the trainer's process
the two threads still take turns on the GIL wherever both are host-bound (a GPU); with
``rollout.separate_engine_process`` the background thread only waits on the engine's process.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from posttrain.metrics.timers import StepTimer

BatchAndMetrics = tuple[Any, dict[str, float]]
MakeBatch = Callable[[StepTimer], BatchAndMetrics]


class OnPolicy:
    """Sample, then train: ``next`` runs the rollout in the caller's thread."""

    def __init__(self, make_batch: MakeBatch) -> None:
        self.make_batch = make_batch

    def next(self, timer: StepTimer) -> BatchAndMetrics:
        return self.make_batch(timer)

    def settle(self) -> None:
        """Nothing is in flight."""

    def close(self) -> None:
        """Nothing to stop."""


class OneStepOffPolicy:
    """Sample batch k+1 in a background thread while batch k trains."""

    def __init__(self, make_batch: MakeBatch) -> None:
        self.make_batch = make_batch
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-rollout")
        self.pending: Future[tuple[BatchAndMetrics, dict[str, float]]] | None = None

    def _collect(self) -> tuple[BatchAndMetrics, dict[str, float]]:
        # The background rollout has its own timer: its phases overlap the main thread's.
        timer = StepTimer()
        result = self.make_batch(timer)
        return result, {f"{k.removesuffix('_s')}_overlapped_s": v for k, v in timer.frame().items()}

    def next(self, timer: StepTimer) -> BatchAndMetrics:
        """Batch k (sampled during the previous step, or now for the first one), with the rollout of
        batch k+1 started before returning."""
        with timer.phase("rollout_wait"):
            if self.pending is None:
                self.pending = self.pool.submit(self._collect)
            (batch, metrics), times = self.pending.result()
        self.pending = self.pool.submit(self._collect)
        return batch, {**metrics, **times, "train/off_policy_steps": 1.0}

    def settle(self) -> None:
        """Wait for the rollout in flight: the engine's weights may change only after it."""
        if self.pending is not None:
            self.pending.exception()  # waits; an error surfaces at the next ``next``

    def close(self) -> None:
        """Drop the batch in flight (its prompts were drawn; a resume does not replay them)."""
        if self.pending is not None and not self.pending.cancel():
            self.pending.exception()  # already running: let it finish before the engine goes away
        self.pool.shutdown(wait=True)


def batch_source(max_off_policy_steps: int, make_batch: MakeBatch) -> OnPolicy | OneStepOffPolicy:
    """The rollout schedule ``rl.max_off_policy_steps`` names."""
    return OneStepOffPolicy(make_batch) if max_off_policy_steps == 1 else OnPolicy(make_batch)
