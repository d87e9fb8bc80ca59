"""The trainer's input: one collected batch of trajectories, and its per-feature payloads as tensors.

``TrainBatch`` holds what every objective reads (token ids, one advantage per completion, which
completions count in the loss, the sampler's logprobs when recorded) plus one optional typed
payload per feature that needs more: the sampler's top-k head (score centering), the teacher's
top-k (direct on-policy distillation), per-token advantages (OPD advantage mode). A payload is a
dataclass of per-completion lists, so ``distributed.cells.take_rows`` slices it with the batch.

The helpers below pad a micro-batch's rows of a payload into ``[B, T]`` / ``[B, T, K]`` tensors
(``B`` rows, ``T`` the micro-batch's completion width, ``K`` top-k entries).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.errors import TrainingError
from posttrain.policy.batching import pad_lists
from posttrain.policy.images import ImageInputs
from posttrain.policy.transfer import to_device

# Teacher logprob written at padding positions: finite, so nothing non-finite exists even where masked.
PAD_LOGPROB = -30.0


@dataclass(frozen=True)
class SamplerHead:
    """Score centering: per completion, per generated token, the sampler's top-k ids and their
    sampler logprobs (``Completion.extra["head_ids"]`` / ``["head_logprobs"]``)."""

    ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]


@dataclass(frozen=True)
class TeacherTopK:
    """Direct on-policy distillation: per completion, per generated token, the teacher's top-k ids and
    their teacher (full-vocabulary) logprobs."""

    ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]


@dataclass(frozen=True)
class TokenAdvantages:
    """Per completion, one advantage per generated token (OPD advantage mode); they replace
    ``TrainBatch.advantages_B`` in the loss."""

    values: list[list[float]]


@dataclass(frozen=True)
class RoutingTrace:
    """MoE routing replay (``rl.routing_replay=rollout``): per completion, the experts the sampler
    routed each position to, ``[prompt + completion - 1, MoE layers, top_k]`` integers (vLLM's
    ``routed_experts``: the last sampled token never ran through the model). Laid out onto the
    trainer's batch layouts by ``policy/routing.py``."""

    experts: list[torch.Tensor]


@dataclass
class TrainBatch:
    """The trajectories of one collected batch, as the trainer needs them.

    ``in_loss_B`` is False for completions removed from the loss (truncated ones under
    ``rl.mask_truncated_completions``); their advantages were still computed with the whole group.
    Each optional payload is filled only when its feature is on.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    advantages_B: torch.Tensor
    in_loss_B: torch.Tensor
    sampler_logprobs: list[list[float] | None]
    group_size: int = 1
    sampler_head: SamplerHead | None = None
    """Score centering (``rl.score_centering.enabled``)."""
    teacher_topk: TeacherTopK | None = None
    """OPD direct mode."""
    token_advantages: TokenAdvantages | None = None
    """OPD advantage mode."""
    routing: RoutingTrace | None = None
    """MoE routing replay (``rl.routing_replay=rollout``)."""
    images: ImageInputs | None = None
    """Vision-language prompts (``policy/images.py``): per completion, its prompt's pixel values and
    image grids for the training forward."""
    # Room for the next features, each one more optional payload of the same form (a frozen
    # dataclass of per-completion lists or tensors, which take_rows slices), never loose fields.


def gather_rows(padded_BT: torch.Tensor, rows: list[int], width: int, device: torch.device) -> torch.Tensor:
    """``rows`` of a padded ``[B, T]`` tensor (host or device), their first ``width`` columns, on ``device``:
    one gather, its row indices moved like any input (``to_device``: no host wait)."""
    return to_device(padded_BT[to_device(torch.tensor(rows), padded_BT.device), :width], device)


def sampler_logprobs_rows(
    batch: TrainBatch, rows: list[int], width: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The sampler's logprobs of ``rows`` padded to ``width`` (fp32) and which rows hold them:
    ``(None, None)`` when the rollout recorded none this step (``rollout.sampler_logprobs_every``);
    ``(logprobs_BT, None)`` when every row has them; ``(logprobs_BT, recorded_B)`` when it recorded
    some samples only (``rollout.sampler_logprobs_samples``), the others zeros. Whether the step
    recorded is read from the whole batch, so every micro-batch (even one without a recorded row)
    reports the gap's fields alike and ranks reduce the same ones."""
    if all(lp is None for lp in batch.sampler_logprobs):
        return None, None
    chosen = [batch.sampler_logprobs[i] for i in rows]
    logprobs_BT = to_device(pad_lists(chosen, width), device)
    if all(lp is not None for lp in chosen):
        return logprobs_BT, None
    return logprobs_BT, to_device(torch.tensor([lp is not None for lp in chosen], dtype=torch.bool), device)


def token_advantage_rows(
    advantages: TokenAdvantages, rows: list[int], width: int, device: torch.device
) -> torch.Tensor:
    """The per-token advantages of ``rows`` padded with zeros to ``width`` (fp32)."""
    return to_device(pad_lists([advantages.values[i] for i in rows], width), device)


def sampler_head_tensors(
    batch: TrainBatch, rows: list[int], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's top-k head of ``rows`` padded to ``width`` tokens: ids ``[B, T, K]`` (-1 on
    padding) and their sampler logprobs (-inf on padding, which marks the entry invalid)."""
    head = batch.sampler_head
    if head is None:
        raise TrainingError(
            "rl.score_centering.enabled=true but the rollout returned no top-k head per token "
            "(the engine must honour SamplingParams.logprobs_topk)"
        )
    k = max((len(tok) for i in rows for tok in head.ids[i]), default=1)
    ids_BTK = torch.full((len(rows), width, k), -1, dtype=torch.long)
    logprobs_BTK = torch.full((len(rows), width, k), float("-inf"), dtype=torch.float32)
    for j, i in enumerate(rows):
        n = len(batch.completion_ids[i])
        if len(head.ids[i]) != n or len(head.logprobs[i]) != n:
            raise TrainingError(
                f"completion {i} has {n} tokens but a sampler head for {len(head.ids[i])}; "
                "the rollout engine must return one top-k head per generated token"
            )
        if n:
            ids_tk = torch.tensor(head.ids[i], dtype=torch.long)
            ids_BTK[j, :n, : ids_tk.shape[1]] = ids_tk
            logprobs_BTK[j, :n, : ids_tk.shape[1]] = torch.tensor(head.logprobs[i], dtype=torch.float32)
    return to_device(ids_BTK, device), to_device(logprobs_BTK, device)


def teacher_topk_tensors(
    batch: TrainBatch, rows: list[int], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k of ``rows`` padded to ``width`` tokens: ids (0 on padding) and logprobs
    (``PAD_LOGPROB`` on padding)."""
    topk = batch.teacher_topk
    if topk is None:
        raise TrainingError("rl.distillation_mode=direct but the batch carries no teacher top-k")
    k = max((len(tok) for i in rows for tok in topk.ids[i]), default=1)
    ids_BTK = torch.zeros((len(rows), width, k), dtype=torch.long)
    logprobs_BTK = torch.full((len(rows), width, k), PAD_LOGPROB, dtype=torch.float32)
    for j, i in enumerate(rows):
        n = len(topk.ids[i])
        if n != len(batch.completion_ids[i]):
            raise TrainingError(f"completion {i} has {len(batch.completion_ids[i])} tokens but a teacher top-k for {n}")
        if n:
            ids_BTK[j, :n] = torch.tensor(topk.ids[i], dtype=torch.long)
            logprobs_BTK[j, :n] = torch.tensor(topk.logprobs[i], dtype=torch.float32)
    return to_device(ids_BTK, device), to_device(logprobs_BTK, device)
