"""The policy update of on-policy distillation's direct mode: teacher divergence, no ratio.

``DistillationTrainer`` is the GRPO ``PolicyTrainer`` with the objective swapped. Per completion
token it takes the teacher's top-k ids and logprobs, evaluates the student's full-vocabulary
logprobs at the same ids (one forward, the chunked LM head gathering K + 1 columns), forms the
(K+1)-way categorical of both (support plus residual mass) and minimises the generalized JSD
(``algorithm/distillation.py``), reduced with ``rl.loss_type`` over the step's global token and
sequence counts like every GRPO objective. The trajectory is fixed, so there is no importance
ratio and no pi_old pass. Advantage mode needs no subclass: it is the GRPO surrogate with per-token
advantages (``TrainBatch.token_advantages``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.algorithm.distillation import direct_opd_loss
from posttrain.algorithm.objectives import LossInputs, LossNormalizer, LossStats, reduce_loss
from posttrain.errors import TrainingError
from posttrain.policy.batching import PolicyBatch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.policy.shared_prefix import GroupedBatch
from posttrain.policy.trainer import PolicyTrainer, TrainBatch, sampler_logprobs_rows

# Teacher logprob written at padding positions: finite, so nothing non-finite exists even where masked.
PAD_LOGPROB = -30.0


@dataclass
class DistillationInputs(LossInputs):
    """One micro-batch of direct OPD: the GRPO inputs plus both top-k views."""

    teacher_topk_logprobs_BTK: Tensor | None = None
    """The teacher's logprobs of its top-k ids (constants)."""
    student_topk_logprobs_BTK: Tensor | None = None
    """The student's logprobs of the same ids (carries gradient)."""


def teacher_topk_tensors(batch: TrainBatch, rows: list[int], width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The teacher's top-k of ``rows`` padded to ``width`` tokens: ids (0 on padding) and logprobs."""
    if batch.teacher_topk_ids is None or batch.teacher_topk_logprobs is None:
        raise TrainingError("rl.distillation_mode=direct but the batch carries no teacher top-k")
    k = max((len(tok) for i in rows for tok in batch.teacher_topk_ids[i]), default=1)
    ids_BTK = torch.zeros((len(rows), width, k), dtype=torch.long)
    logprobs_BTK = torch.full((len(rows), width, k), PAD_LOGPROB, dtype=torch.float32)
    for j, i in enumerate(rows):
        n = len(batch.teacher_topk_ids[i])
        if n != len(batch.completion_ids[i]):
            raise TrainingError(f"completion {i} has {len(batch.completion_ids[i])} tokens but a teacher top-k for {n}")
        if n:
            ids_BTK[j, :n] = torch.tensor(batch.teacher_topk_ids[i], dtype=torch.long)
            logprobs_BTK[j, :n] = torch.tensor(batch.teacher_topk_logprobs[i], dtype=torch.float32)
    return ids_BTK.to(device), logprobs_BTK.to(device)


class DistillationTrainer(PolicyTrainer):
    """``PolicyTrainer`` minimising the top-k + residual generalized JSD to the teacher."""

    def _decide_sharing(self, batch: TrainBatch) -> bool:
        # The student's logprobs at the teacher's ids come from the plain (unshared) path.
        self._share = False
        return False

    @torch.no_grad()
    def _old_logprobs(self, batch: TrainBatch) -> list[torch.Tensor] | None:
        return None  # a fixed-trajectory divergence forms no ratio, so pi_old is never needed

    def _loss_inputs(
        self, batch: TrainBatch, rows: list[int], pb: PolicyBatch | GroupedBatch, old: list[torch.Tensor] | None
    ) -> LossInputs:
        if not isinstance(pb, PolicyBatch):
            raise TypeError("direct distillation needs the plain PolicyBatch (see _decide_sharing)")
        width = pb.completion_ids_BT.shape[1]
        teacher_ids_BTK, teacher_lp_BTK = teacher_topk_tensors(batch, rows, width, self.device)
        out = completion_logprobs(
            self.model,
            pb,
            temperature=self.cfg.rl.temperature,
            chunk_tokens=self.cfg.model.logprob_chunk_tokens,
            head_ids_BTK=teacher_ids_BTK,
        )
        if not isinstance(out, tuple):
            raise TypeError("completion_logprobs returned no logprobs at the teacher's ids")
        logprobs_BT, student_BTK = out
        mask_BT = pb.completion_mask_BT.float() * batch.in_loss_B[rows].to(self.device).float()[:, None]
        mask_BT[:, : self.cfg.rl.n_ignore_prefix_tokens] = 0.0  # type: ignore[attr-defined]
        return DistillationInputs(
            logprobs_BT=logprobs_BT,
            old_logprobs_BT=logprobs_BT.detach(),
            advantages_B=torch.zeros(len(rows), device=self.device),
            mask_BT=mask_BT,
            sampler_logprobs_BT=sampler_logprobs_rows(batch, rows, width, self.device),
            teacher_topk_logprobs_BTK=teacher_lp_BTK,
            student_topk_logprobs_BTK=student_BTK,
        )

    def _loss(self, inputs: LossInputs, norm: LossNormalizer) -> tuple[Tensor, LossStats]:
        if not isinstance(inputs, DistillationInputs):
            raise TypeError("DistillationTrainer builds DistillationInputs")
        teacher_BTK, student_BTK = inputs.teacher_topk_logprobs_BTK, inputs.student_topk_logprobs_BTK
        if teacher_BTK is None or student_BTK is None:
            raise TypeError("direct distillation needs both top-k views")
        beta = self.cfg.rl.jsd_beta  # type: ignore[attr-defined]
        mask_BT = inputs.mask_BT > 0
        # Padding on either side never reaches a value or a gradient (direct_opd_loss replaces it).
        div_BT = direct_opd_loss(student_BTK, teacher_BTK, mask_BT, float(beta))
        loss = reduce_loss(div_BT, mask_BT.float(), self.spec.loss_type, norm, max_tokens=self.spec.max_tokens)
        dtype = div_BT.dtype
        div_masked_BT = torch.where(mask_BT, div_BT.detach(), torch.zeros_like(div_BT))
        gap: dict[str, torch.Tensor] = {}
        if inputs.sampler_logprobs_BT is not None:  # unrecorded on this step: no gap to report
            gap_BT = (inputs.logprobs_BT.detach() - inputs.sampler_logprobs_BT).abs()
            gap_BT = torch.where(mask_BT, gap_BT, torch.zeros_like(gap_BT))
            gap = {
                "logprob_gap_abs_sum": gap_BT.sum(),
                "logprob_gap_max": gap_BT.amax() if gap_BT.numel() else gap_BT.new_zeros(()),
                "gap_tokens": mask_BT.to(dtype).sum(),
            }
        stats = LossStats(
            loss_sum=loss.detach(),
            loss_tokens=mask_BT.to(dtype).sum(),
            clipped_tokens=torch.zeros((), dtype=dtype, device=div_BT.device),
            seqs=mask_BT.any(dim=1).to(dtype).sum(),
            opd_divergence_sum=div_masked_BT.sum(),
            **gap,
        )
        return loss, stats
