"""The ``rl.eval`` section: evaluation of the policy during training on a fixed set of prompts.

The evaluation (``posttrain.loop.evaluate``) samples ``samples_per_prompt`` completions for each of
``num_prompts`` prompts drawn once from its own data source, with the rollout engine the run already
holds, scores them with the run's reward and logs ``eval/*`` at step 0, every ``every_steps`` steps
and at the last step. What the metrics mean: docs/metrics.md. Cross-field rules (a readable data
source, the reward's inputs, vLLM's temperature) are checked by ``preflight/eval.py``.

``data`` reuses ``rl.data``'s section class (``config/data.py``).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from posttrain.config.data import DataConfig
from posttrain.config.section import SEED_BOUND, Section

MIN_SAMPLING_TEMPERATURE = 1e-2
"""Smallest temperature above 0 (as ``rollout.temperature``): logits divided by less overflow."""


class EvalConfig(Section):
    """Evaluation during training: the same prompts at step 0, every N steps and at the end."""

    enabled: bool = False
    """Evaluate during training (``eval/*`` metrics)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The evaluation prompts: the same kinds of source as ``rl.data`` (a file, a dataset, a factory,
    the arithmetic generator), built as a separate source. Give a held-out split here; the default is
    the arithmetic generator (seeded with ``rl.eval.seed``, so its problems are not the training ones)."""
    every_steps: int = Field(10, ge=0)
    """Evaluate after every N-th collected batch (besides step 0 and the last step); 0: only at step 0
    and at the last step."""
    num_prompts: int = Field(32, ge=1)
    """Prompts in the evaluation set: the first N the source yields, drawn once and reused at every
    evaluation (a source with fewer rows wraps around and repeats some)."""
    samples_per_prompt: int = Field(1, ge=1)
    """Completions sampled per prompt (k of ``eval/mean@k`` and ``eval/pass@k``)."""
    temperature: float = Field(0.0, ge=0.0, le=1e2)
    """Sampling temperature of the evaluation; 0 decodes greedily (then every sample of a prompt is
    the same). Otherwise in [0.01, 100], like ``rollout.temperature``. No top-p, top-k or repetition
    penalty is applied."""
    max_tokens: int | None = Field(None, ge=1)
    """Most tokens per evaluation completion; ``null``: ``rollout.max_tokens``."""
    pass_threshold: float = 1.0
    """A sample passes (``eval/pass@1``, ``eval/pass@k``) when its reward is at least this: 1.0 means
    "correct" for 0/1 rewards; set it for a real-valued reward."""
    seed: int | None = Field(None, ge=0, lt=SEED_BOUND)
    """Seeds the evaluation's prompt order (and arithmetic problems) and its sampling (when the
    temperature is above 0), apart from training's streams; ``null``: the run's data seed + 1."""

    @field_validator("temperature")
    @classmethod
    def _greedy_or_sampling(cls, v: float) -> float:
        if 0.0 < v < MIN_SAMPLING_TEMPERATURE:
            raise ValueError(
                f"temperature {v} is below {MIN_SAMPLING_TEMPERATURE}: logits divided by it overflow; "
                "use 0 for greedy decoding or at least 0.01"
            )
        return v
