"""One collected batch: prompts -> rollout -> rewards -> group advantages -> the trainer's batch.

    prompts (data source) -> rollout engine (``group_size`` samples each) -> reward per completion
            -> group advantages (whole groups, before any masking) -> [dynamic sampling] -> TrainBatch

With several policy ranks each rank draws the step's prompts (the same ones: same data source,
same seed) and samples and scores only its data cell's whole groups; the cell is one slice of
every mini-batch (``distributed.cells``). In one process the cell is the whole batch. Rollout
metrics are always those of the whole batch (gathered over the ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from posttrain.algorithm.advantages import group_advantages, group_reward_spread, informative_groups
from posttrain.config.schema import GRPOConfig, RunConfig
from posttrain.data.base import DataSource, PromptSample
from posttrain.data.prompt_length import PromptBudget
from posttrain.distributed.cells import Cells, cell_group_indices
from posttrain.distributed.world import gather_objects, is_rank_zero, merge_rank_metrics
from posttrain.errors import DataError
from posttrain.loop.dynamic_sampling import DrawFn, ScoredGroup, collect_dynamic_for
from posttrain.metrics.completions import CompletionsLog
from posttrain.models.chat import render_prompt_ids
from posttrain.models.vision import VisionPrompt
from posttrain.policy.images import ImageInputs
from posttrain.policy.train_batch import RoutingTrace, SamplerHead, TrainBatch
from posttrain.rewards.base import Reward, RewardInput
from posttrain.rewards.combined import score_parts
from posttrain.rollout.base import Completion, RolloutBatch, RolloutEngine, SamplingParams
from posttrain.rollout.vl_sampling import ImagePromptSampler


@dataclass
class Collected:
    """One collected batch: prompts, their rollouts, rewards and advantages."""

    prompts: list[PromptSample]
    rollout: RolloutBatch
    rewards_NG: torch.Tensor
    advantages_NG: torch.Tensor
    reward_parts_NG: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each reward's own scores by metric key, in float64 (exactly as returned); ``rewards_NG`` is
    their weighted sum (float32)."""
    vision: list[VisionPrompt] | None = None
    """A vision-language policy: each prompt as rendered (token ids, pixel values, image grids)."""


@dataclass
class Roles:
    """What collecting a batch needs: the prompt source, the rollout engine, the reward, the tokenizer."""

    data: DataSource
    engine: RolloutEngine
    reward: Reward
    tokenizer: Any
    vision: ImagePromptSampler | None = None
    """A vision-language policy's renderer and sampler (None: a text policy)."""
    prompt_budget: PromptBudget | None = None
    """The tokens a rendered prompt may take (the context less ``rollout.max_tokens``); None: unchecked."""


def sampling_params(cfg: RunConfig, cell: int = 0) -> SamplingParams:
    """The rollout section as engine sampling controls; score centering asks for the sampler's
    top-k head per generated token. Data cell ``c`` samples with ``rollout.seed + c``, so the cells'
    engines draw independent streams (cell 0, and a single process, use the seed itself)."""
    ro, sc = cfg.rollout, cfg.rl.score_centering
    return SamplingParams(
        max_tokens=ro.max_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        repetition_penalty=ro.repetition_penalty,
        seed=None if ro.seed is None else ro.seed + cell,
        sampler_logprobs_every=ro.sampler_logprobs_every,
        sampler_logprobs_samples=cfg.sampler_logprobs_samples,
        logprobs_topk=sc.top_k if sc.enabled else 0,
    )


def render_and_generate(
    cfg: RunConfig, roles: Roles, prompts: list[PromptSample], n: int, params: SamplingParams
) -> tuple[RolloutBatch, list[VisionPrompt] | None]:
    """Render ``prompts`` and sample ``n`` completions each; with a vision-language policy the
    prompts are rendered with their images (``roles.vision``), which are returned too."""
    if roles.vision is not None:
        vision = roles.vision
        rendered = [vision.render(p.prompt, where=f"sample {p.uid}") for p in prompts]
        check_prompt_lengths(roles.prompt_budget, prompts, [r.input_ids for r in rendered])
        return vision.generate(roles.engine, rendered, n, params), rendered
    prompt_ids = [
        render_prompt_ids(
            roles.tokenizer,
            p.prompt,
            use_chat_template=cfg.model.use_chat_template,
            chat_template_kwargs=cfg.model.chat_template_kwargs,
        )
        for p in prompts
    ]
    check_prompt_lengths(roles.prompt_budget, prompts, prompt_ids)
    return roles.engine.generate(prompt_ids, n, params), None


def check_prompt_lengths(budget: PromptBudget | None, prompts: list[PromptSample], ids: list[list[int]]) -> None:
    """Refuse, by sample, a rendered prompt that leaves no room for ``rollout.max_tokens`` in the
    context: engines either refuse it in their own words (vLLM) or sample past the positions the
    model was trained on without a word (transformers)."""
    if budget is None:
        return
    for sample, prompt_ids in zip(prompts, ids, strict=True):
        if len(prompt_ids) > budget.limit:
            raise DataError(f"sample {sample.uid}: {budget.describe(len(prompt_ids))}")


def generate_and_score(
    cfg: RunConfig, roles: Roles, prompts: list[PromptSample], n: int, params: SamplingParams, *, uid_prefix: str = ""
) -> tuple[RolloutBatch, list[float], dict[str, list[float]]]:
    """Render ``prompts``, sample ``n`` completions each and score them: the rollout, the weighted
    reward of each completion (prompt-major) and each reward's own scores. Training and evaluation
    both sample through here; completion ``j`` of a prompt is scored as sample ``<uid>#j``."""
    rollout, _ = render_and_generate(cfg, roles, prompts, n, params)
    scores, per_reward = score_rollout(roles, prompts, rollout, n, uid_prefix=uid_prefix)
    return rollout, scores, per_reward


def score_rollout(
    roles: Roles, prompts: list[PromptSample], rollout: RolloutBatch, n: int, *, uid_prefix: str = ""
) -> tuple[list[float], dict[str, list[float]]]:
    """The weighted reward of each completion of ``rollout`` (prompt-major) and each reward's own scores."""
    inputs = [
        RewardInput(
            prompt=prompts[c.prompt_index].prompt,
            completion=c.text,
            ground_truth=prompts[c.prompt_index].ground_truth,
            finish_reason=c.finish_reason,
            metadata=prompts[c.prompt_index].metadata,
        )
        for c in rollout.completions
    ]
    uids = [f"{uid_prefix}{prompts[c.prompt_index].uid}#{k % n}" for k, c in enumerate(rollout.completions)]
    return score_parts(roles.reward, inputs, uids)


def sample_and_score(cfg: RunConfig, roles: Roles, prompts: list[PromptSample], cell: int = 0) -> Collected:
    """Sample ``group_size`` completions for each of ``prompts``, score them, compute advantages."""
    rl = cfg.rl
    rollout, vision = render_and_generate(cfg, roles, prompts, rl.group_size, sampling_params(cfg, cell))
    scores, per_reward = score_rollout(roles, prompts, rollout, rl.group_size)
    rewards_NG = torch.tensor(scores, dtype=torch.float32).view(len(prompts), rl.group_size)
    # Advantages are computed on the whole group here, before any completion is masked out of the loss.
    advantages_NG = group_advantages(rewards_NG, unbiased=rl.unbiased_advantage, eps=rl.advantage_eps)
    parts_NG = {
        k: torch.tensor(v, dtype=torch.float64).view(len(prompts), rl.group_size) for k, v in per_reward.items()
    }
    return Collected(prompts, rollout, rewards_NG, advantages_NG, parts_NG, vision)


@dataclass
class GroupPayload:
    """One prompt's complete group, as dynamic sampling keeps or drops it."""

    prompt: PromptSample
    prompt_ids: list[int]
    completions: list[Completion]
    rewards_G: torch.Tensor
    advantages_G: torch.Tensor
    stats: dict[str, float]
    reward_parts_G: dict[str, torch.Tensor] = field(default_factory=dict)
    vision: VisionPrompt | None = None


def split_groups(collected: Collected, group_size: int) -> list[ScoredGroup]:
    """A drawn batch as groups stamped with their reward spread (the informative test reads only that)."""
    spread_N = group_reward_spread(collected.rewards_NG).tolist()
    comps = collected.rollout.completions
    return [
        ScoredGroup(
            spread=spread_N[i],
            payload=GroupPayload(
                prompt=collected.prompts[i],
                prompt_ids=collected.rollout.prompt_token_ids[i],
                completions=comps[i * group_size : (i + 1) * group_size],
                rewards_G=collected.rewards_NG[i],
                advantages_G=collected.advantages_NG[i],
                stats=collected.rollout.stats,
                reward_parts_G={k: v[i] for k, v in collected.reward_parts_NG.items()},
                vision=collected.vision[i] if collected.vision is not None else None,
            ),
        )
        for i in range(len(collected.prompts))
    ]


def join_groups(groups: list[GroupPayload]) -> Collected:
    """The trained groups as one collected batch, completions renumbered by their new prompt index."""
    completions = [replace(c, prompt_index=i) for i, g in enumerate(groups) for c in g.completions]
    stats: dict[str, float] = {}
    for g in groups:  # the last dispatch's engine stats stand for the step
        stats = g.stats
    rollout = RolloutBatch(prompt_token_ids=[g.prompt_ids for g in groups], completions=completions, stats=stats)
    return Collected(
        prompts=[g.prompt for g in groups],
        rollout=rollout,
        rewards_NG=torch.stack([g.rewards_G for g in groups]),
        advantages_NG=torch.stack([g.advantages_G for g in groups]),
        reward_parts_NG={k: torch.stack([g.reward_parts_G[k] for g in groups]) for k in groups[0].reward_parts_G},
        vision=[g.vision for g in groups if g.vision is not None] if groups[0].vision is not None else None,
    )


def draw_cell(cfg: RunConfig, roles: Roles, cells: Cells) -> Collected:
    """One collected batch without dynamic sampling: the step's prompts, this cell's groups of them
    sampled and scored."""
    rl = cfg.rl
    prompts = roles.data.next_batch(rl.groups_per_step)
    mine = cell_group_indices(rl.batch_per_replica, group_size=rl.group_size, mini_batch=rl.mini_batch, cells=cells)
    return sample_and_score(cfg, roles, [prompts[i] for i in mine], cells.index)


def dynamic_draw(cfg: GRPOConfig, roles: Roles, cells: Cells) -> DrawFn:
    """The dynamic-sampling draw function of this rank.

    Each rank draws the whole dispatch's prompts (cell 0's, then cell 1's, ...; the cursors stay
    equal), samples and scores its own cell's, and learns the other cells' reward spreads by an
    all-gather: the driver then makes the same refill and selection decisions on every rank, and
    each rank keeps the payloads of its own cell only.
    """
    g = cfg.rl.group_size

    def draw(counts: list[int]) -> list[list[ScoredGroup]]:
        total = sum(counts)
        prompts = roles.data.next_batch(total) if total else []
        start = sum(counts[: cells.index])
        mine = prompts[start : start + counts[cells.index]]
        own = split_groups(sample_and_score(cfg, roles, mine, cells.index), g) if mine else []
        spreads = gather_objects([group.spread for group in own])
        return [
            own if c == cells.index else [ScoredGroup(spread=s, payload=None) for s in spreads[c]]
            for c in range(cells.count)
        ]

    return draw


def collect(cfg: GRPOConfig, roles: Roles, cells: Cells) -> tuple[Collected, dict[str, float]]:
    """One collected batch (this rank's cell of it); with a dynamic-sampling quota, keep drawing until
    it holds enough informative groups (DAPO), train on those first and drop the rest."""
    rl = cfg.rl
    if rl.effective_min_informative_groups == 0:
        return draw_cell(cfg, roles, cells), {}
    result = collect_dynamic_for(rl, dynamic_draw(cfg, roles, cells), num_cells=cells.count)
    # Train in draw order: selection order would put every informative group in the first mini-batch.
    mine = [g for g in result.groups if g.cell == cells.index]
    chosen = sorted(mine, key=lambda g: (g.draw_round, g.order))
    return join_groups([g.payload for g in chosen]), result.metrics


def to_train_batch(cfg: RunConfig, collected: Collected) -> TrainBatch:
    """The trainer's view; truncated completions leave the loss here when masking is on."""
    completions = collected.rollout.completions
    truncated = torch.tensor([c.finish_reason == "length" for c in completions])
    in_loss = ~truncated if cfg.rl.mask_truncated_completions else torch.ones_like(truncated)
    head = None
    if cfg.rl.score_centering.enabled:
        head = SamplerHead(
            ids=[c.extra["head_ids"] for c in completions], logprobs=[c.extra["head_logprobs"] for c in completions]
        )
    routing = None
    if cfg.rl.routing_replay == "rollout":  # the vLLM engine put each completion's experts there
        routing = RoutingTrace([c.extra["routed_experts"] for c in completions])
    images = None
    if collected.vision is not None:  # each completion carries its prompt's (shared, not copied) tensors
        pixels = [collected.vision[c.prompt_index].pixel_values_P for c in completions]
        images = ImageInputs(pixels, [collected.vision[c.prompt_index].image_grid_thw_I3 for c in completions])
    return TrainBatch(
        prompt_ids=[collected.rollout.prompt_token_ids[c.prompt_index] for c in completions],
        completion_ids=[c.token_ids for c in completions],
        advantages_B=collected.advantages_NG.reshape(-1),
        in_loss_B=in_loss,
        sampler_logprobs=[c.logprobs for c in completions],
        group_size=cfg.rl.group_size,
        sampler_head=head,
        routing=routing,
        images=images,
    )


def rollout_metrics(collected: Collected, *, mask_truncated: bool = False) -> dict[str, float]:
    """Reward and response statistics of the whole collected batch (before any update): every
    rank's rewards and lengths are gathered first (a collective; one rank's own in one process).
    With ``mask_truncated`` (``rl.mask_truncated_completions``) also how many completions the loss
    leaves out for being truncated."""
    lengths = torch.tensor([len(c.token_ids) for c in collected.rollout.completions], dtype=torch.float32)
    truncated = [c.finish_reason == "length" for c in collected.rollout.completions]
    stats = {k: float(v) for k, v in collected.rollout.stats.items()}
    own = (collected.rewards_NG, lengths, truncated, stats, collected.advantages_NG, collected.reward_parts_NG)
    parts = gather_objects(own)
    rewards = torch.cat([p[0] for p in parts])
    lengths = torch.cat([p[1] for p in parts])
    truncated = [t for p in parts for t in p[2]]
    advantages = torch.cat([p[4].reshape(-1) for p in parts])
    metrics = {
        "train/reward_mean": float(rewards.mean()),
        "train/reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "train/grpo_informative_group_count": float(informative_groups(rewards).sum()),
        "train/rollout_truncated_frac": sum(truncated) / max(1, len(truncated)),
        "train/response_len_mean": float(lengths.mean()),
        "train/response_len_max": float(lengths.max()),
    }
    if mask_truncated:
        metrics["train/masked_truncated_count"] = float(sum(truncated))
    metrics.update(merge_rank_metrics([p[3] for p in parts]))
    metrics.update(distribution_metrics(rewards, lengths, advantages))
    for key in parts[0][5]:
        metrics[f"train/reward/{key}_mean"] = float(torch.cat([p[5][key].reshape(-1) for p in parts]).mean())
    return metrics


def completions_log(
    cfg: RunConfig, run_dir: Path, trainer: Any, sink: Callable[[int, list[dict[str, Any]]], None] | None
) -> CompletionsLog:
    """``job.log_completions_every``'s log of this rank. The first batch it sees is the step after
    the ones the trainer has done (after a resume, its counters are the checkpoint's: every
    collected batch takes ``rl.n_mini`` optimizer steps, applied or skipped)."""
    n_mini = cfg.rl.n_mini
    return CompletionsLog(
        run_dir / "completions.jsonl",
        cfg.job.log_completions_every,
        first_step=lambda: (trainer.optimizer_step + trainer.zero_grad_skips_total) // n_mini + 1,
        gather=gather_objects,
        writes=is_rank_zero(),
        sink=sink,
    )


def completion_rows(collected: Collected) -> list[dict[str, Any]]:
    """One record per sample of this cell's batch, for ``completions.jsonl`` (``metrics/completions.py``)."""
    rewards_B = collected.rewards_NG.reshape(-1).tolist()
    advantages_B = collected.advantages_NG.reshape(-1).tolist()
    parts_B = {k: v.reshape(-1).tolist() for k, v in collected.reward_parts_NG.items()}
    group = collected.rewards_NG.shape[1] if collected.rewards_NG.dim() == 2 else 1
    rows = []
    for b, c in enumerate(collected.rollout.completions):
        prompt = collected.prompts[c.prompt_index]
        rows.append(
            {
                "uid": f"{prompt.uid}#{b % group}",
                "prompt": prompt.prompt if collected.vision is None else _logged_prompt(prompt.prompt),
                "completion": c.text,
                "completion_tokens": len(c.token_ids),
                "rewards": {k: v[b] for k, v in parts_B.items()},
                "reward": rewards_B[b],
                "advantage": advantages_B[b],
                "finish_reason": c.finish_reason,
            }
        )
    return rows


def _logged_prompt(prompt: Any) -> Any:
    """A multimodal prompt with each image's bytes replaced by their size (the log stays small)."""
    if not isinstance(prompt, list):
        return prompt
    return [
        {
            **msg,
            "content": [
                {"type": "image", "image": f"<{len(part['image'])} bytes>"} if part.get("type") == "image" else part
                for part in msg["content"]
            ]
            if isinstance(msg.get("content"), list)
            else msg.get("content"),
        }
        for msg in prompt
    ]


def distribution_metrics(
    rewards: torch.Tensor, lengths_B: torch.Tensor, advantages_B: torch.Tensor
) -> dict[str, float]:
    """Reward extremes, completion lengths, and the sequence advantages broadcast to every generated
    token (weighted by length: a sequence of n tokens counts n times; population std)."""
    lengths, adv = lengths_B.double(), advantages_B.double()
    tokens = lengths.sum()
    adv_mean = (adv * lengths).sum() / tokens.clamp(min=1)
    adv_var = ((adv - adv_mean) ** 2 * lengths).sum() / tokens.clamp(min=1)
    has_tokens = lengths > 0
    seen = adv[has_tokens] if bool(has_tokens.any()) else torch.zeros(1, dtype=torch.float64)
    return {
        "train/reward_min": float(rewards.min()),
        "train/reward_max": float(rewards.max()),
        "rollout/completion_length_mean": float(lengths.mean()),
        "rollout/completion_length_min": float(lengths.min()),
        "rollout/completion_length_max": float(lengths.max()),
        "rollout/advantage_mean": float(adv_mean),
        "rollout/advantage_std": float(adv_var.sqrt()),
        "rollout/advantage_min": float(seen.min()),
        "rollout/advantage_max": float(seen.max()),
    }
