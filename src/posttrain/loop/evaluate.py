"""Evaluation during training (``rl.eval``): the same prompts at step 0, every N steps and at the end.

    eval prompts (own data source, drawn once) -> the run's rollout engine (k samples each, its own
            sampling seed, greedy by default) -> the run's reward (``score_parts``) -> eval/* metrics

The evaluation must not change the training run: with it on, every training metric and the final
weights are those of the same run without it. So it

* samples with the engine already loaded (no second model copy) and puts the engine's state
  (``state_dict``: the call counter that seeds each ``generate`` call) back afterwards, so training's
  next call draws exactly what it would have drawn;
* samples with its own ``SamplingParams`` seed (``rl.eval.seed``), apart from training's stream;
* captures and restores every global RNG around its work (a custom data source or reward may draw);
* draws its prompts from its own data source object, built once from ``rl.eval.data``.

Several policy ranks: every rank holds the whole evaluation set (the same source and seed) and
evaluates its slice ``prompts[rank::world]`` with its own engine (sampling seed + rank); the rewards
are then gathered (one collective per evaluation, called by every rank in the same order) and every
rank computes the same metrics. A rank with an empty slice samples nothing but still gathers.

Metrics (docs/metrics.md; the math is ``algorithm/pass_at_k.py``): ``eval/reward_mean``,
``eval/mean@k``, ``eval/pass@1``, ``eval/pass@k``, ``eval/reward/<key>_mean`` per configured reward,
``eval/response_len_mean`` and ``timer/eval_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import cast

import torch

from posttrain.algorithm.pass_at_k import eval_summary
from posttrain.checkpoint import capture_rng, restore_rng
from posttrain.config.schema import RunConfig
from posttrain.config.section import SEED_BOUND
from posttrain.data.base import PromptSample
from posttrain.data.build import build_data_source
from posttrain.distributed.world import gather_objects, rank_and_world
from posttrain.loop.collect import Roles, generate_and_score
from posttrain.metrics.sinks import MetricsLogger
from posttrain.rollout.base import ResumableEngine, SamplingParams


def eval_seed(cfg: RunConfig) -> int:
    """``rl.eval.seed``, or the run's data seed + 1 (so the eval stream is not the training one)."""
    seed = cfg.rl.eval.seed
    return seed if seed is not None else (cfg.data_seed + 1) % SEED_BOUND


def eval_due(step: int, every_steps: int, max_steps: int) -> bool:
    """Whether the evaluation runs after collected batch ``step`` (0: before the first update)."""
    return step in (0, max_steps) or (every_steps > 0 and step % every_steps == 0)


def eval_steps(every_steps: int, max_steps: int) -> list[int]:
    """Every step a fresh run of ``max_steps`` evaluates at, in order."""
    return [s for s in range(max_steps + 1) if eval_due(s, every_steps, max_steps)]


def eval_sampling_params(cfg: RunConfig, rank: int = 0) -> SamplingParams:
    """Plain sampling at ``rl.eval.temperature`` (0: greedy), without top-p, top-k, repetition
    penalty or sampler logprobs, seeded with the eval seed + ``rank``."""
    ev = cfg.rl.eval
    return SamplingParams(
        max_tokens=ev.max_tokens if ev.max_tokens is not None else cfg.rollout.max_tokens,
        temperature=ev.temperature,
        seed=(eval_seed(cfg) + rank) % SEED_BOUND,
        sampler_logprobs_every=0,
    )


@dataclass
class Evaluator:
    """The evaluation set and what sampling and scoring it needs."""

    cfg: RunConfig
    roles: Roles
    prompts: list[PromptSample]
    """The whole evaluation set (every rank holds all of it)."""

    def due(self, step: int) -> bool:
        return eval_due(step, self.cfg.rl.eval.every_steps, self.cfg.rl.max_steps)

    def at_step(self, step: int, log: MetricsLogger) -> dict[str, float]:
        """The eval metrics after collected batch ``step`` (0: the initial weights), with one info line."""
        metrics = self.evaluate()
        log.info(eval_log_line(step, metrics, len(self.prompts), self.cfg.rl.eval.samples_per_prompt))
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Sample and score this rank's slice, gather every rank's, return the eval metrics."""
        start = time.perf_counter()
        rank, world = rank_and_world()
        engine = cast(ResumableEngine, self.roles.engine)
        engine_state, rng = engine.state_dict(), capture_rng()
        try:
            own = self._sample_and_score(self.prompts[rank::world], rank)
        finally:
            engine.load_state_dict(engine_state)
            restore_rng(rng)
        parts = gather_objects(own)
        k = self.cfg.rl.eval.samples_per_prompt
        rewards_NK = torch.tensor([row for p in parts for row in p[0]], dtype=torch.float64).view(-1, k)
        summary = eval_summary(rewards_NK, self.cfg.rl.eval.pass_threshold)
        metrics = {f"eval/{name}": float(value) for name, value in summary.items()}
        for key in next((p[1] for p in parts if p[1]), {}):
            metrics[f"eval/reward/{key}_mean"] = float(torch.tensor([s for p in parts for s in p[1][key]]).mean())
        lengths = [n for p in parts for n in p[2]]
        metrics["eval/response_len_mean"] = sum(lengths) / max(1, len(lengths))
        metrics["timer/eval_s"] = time.perf_counter() - start
        return metrics

    def _sample_and_score(
        self, prompts: list[PromptSample], rank: int
    ) -> tuple[list[float], dict[str, list[float]], list[int]]:
        """Rewards (prompt-major, k per prompt), each reward's scores and completion lengths."""
        cfg, roles, k = self.cfg, self.roles, self.cfg.rl.eval.samples_per_prompt
        if not prompts:
            return [], {}, []
        rollout, scores, per_reward = generate_and_score(
            cfg, roles, prompts, k, eval_sampling_params(cfg, rank), uid_prefix="eval:"
        )
        return scores, per_reward, [len(c.token_ids) for c in rollout.completions]


def build_evaluator(cfg: RunConfig, roles: Roles) -> Evaluator | None:
    """The evaluator ``rl.eval`` asks for (None when off): its own data source, built and drawn once
    here with every global RNG put back afterwards."""
    ev = cfg.rl.eval
    if not ev.enabled:
        return None
    rng = capture_rng()
    try:
        # A source object of its own: drawing from the training source would move training's cursor.
        source = build_data_source(ev.data, eval_seed(cfg), images=roles.vision is not None)
        prompts = source.next_batch(ev.num_prompts)
    finally:
        restore_rng(rng)
    return Evaluator(cfg, roles, prompts)


def eval_log_line(step: int, metrics: dict[str, float], num_prompts: int, k: int) -> str:
    """The console line of one evaluation."""
    shown = ", ".join(f"{key.removeprefix('eval/')} {metrics[key]:.4g}" for key in _HEADLINE if key in metrics)
    return f"eval at step {step} ({num_prompts} prompts x {k} samples): {shown}"


_HEADLINE = ("eval/reward_mean", "eval/pass@1", "eval/mean@k", "eval/pass@k")
