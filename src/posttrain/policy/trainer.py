"""The policy update: pi_old and reference passes, the objective over micro-batches, the optimizer step.

One call of ``PolicyTrainer.train_on`` consumes one collected batch. It splits the batch into ``n_mini``
mini-batches (one optimizer step each) and every mini-batch into micro-batches (a memory-only split: each
micro-batch's loss is divided by the mini-batch's global token and sequence counts, so the summed gradient equals
the unsplit one). Which loss runs, and which passes and tensors it needs, is the ``Objective`` the run was
assembled with (``policy/objective.py``: GRPO, or on-policy distillation's direct or advantage mode); this file has
no ``if loss_type == ...`` and reads no algorithm's own knobs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from posttrain.algorithm.loss_types import LossInputs, LossNormalizer, LossStats
from posttrain.config.schema import RunConfig
from posttrain.distributed.cells import cell_config
from posttrain.distributed.fsdp import DataParallel, first_nonfinite, largest_entry, mixed_forward
from posttrain.errors import TrainingError
from posttrain.models.cpu_decode_layout import packed_update_choice, packed_update_linears, weights_written
from posttrain.models.cuda_graphs import graphed_body_for
from posttrain.models.fused_kernels import apply_fused_kernels, fusable, fused_kernels_choice
from posttrain.models.precision import compute_weights, dtype_name, resolve_precision
from posttrain.models.structure import compile_layers, split_body_and_head
from posttrain.policy.batching import PolicyBatch, build_policy_batch, pad_lists
from posttrain.policy.free_rows import free_groups_first, free_rows, packed_free_first
from posttrain.policy.images import (
    SHARED_PROMPT_REFUSAL,
    ImageInputs,
    image_layout,
    row_images,
    vl_completion_logprobs,
    vl_completion_logprobs_at,
)
from posttrain.policy.logprob_kernels import use_triton_head
from posttrain.policy.logprobs import BodyForward, check_packing_isolates, completion_logprobs
from posttrain.policy.objective import Objective, objective_spec
from posttrain.policy.optim import build_optimizer, build_scheduler
from posttrain.policy.reference import build_reference
from posttrain.policy.routing import RoutingReplay
from posttrain.policy.shared_prefix import GroupedBatch, build_grouped_batch, grouped_completion_logprobs, sharing_pays
from posttrain.policy.train_batch import (
    TrainBatch,
    gather_rows,
    sampler_head_tensors,
    sampler_logprobs_rows,
    teacher_topk_tensors,
    token_advantage_rows,
)
from posttrain.policy.transfer import to_device

# objective_spec, TrainBatch and build_reference are re-exported: loop/resume.py, loop/grpo.py and
# loop/run.py import them from here.
__all__ = ["PROBE_TOLERANCE", "PolicyTrainer", "TrainBatch", "build_reference", "objective_spec"]

# How far pi_old may sit from the first mini-batch's own logprobs before the run stops: the pass uses the same
# micro-batches, so a deterministic backend's gap is zero; the bound leaves room for nondeterministic kernels only.
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


class PolicyTrainer:
    """Owns the optimizer and performs the updates of one collected batch."""

    def __init__(
        self,
        model: nn.Module,
        cfg: RunConfig,
        *,
        objective: Objective,
        pad_id: int,
        ref_model: nn.Module | None = None,
    ):
        # An FSDP2-sharded policy (distributed.fsdp.shard_policy): this rank trains one data cell (the cell's batch
        # sizes) and reduces counts, norms and metrics over all ranks; a plain model's SingleProcess reduces nothing.
        self.dp = DataParallel.of(model)
        cfg = cell_config(cfg, self.dp.size)
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        self.ref_model = ref_model
        self.objective = objective
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # From the parameters as loaded, so a model built outside load_model_and_tokenizer resolves like one loaded
        # from the config (model.compute_dtype=auto: bf16 over fp32 on CUDA only).
        self.precision = resolve_precision(dtype_name(self.dtype), cfg.model.compute_dtype, self.device)
        self.optimizer = build_optimizer(model, cfg.rl.optimizer, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.rl.optimizer, total_steps=cfg.rl.max_steps * cfg.rl.n_mini)
        self.optimizer_step = self.zero_grad_skips_total = 0
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        self._share = False  # whether the current batch's prompts run once per group (_decide_sharing)
        self._free_B: torch.Tensor | None = None  # the current batch's rows that learn nothing (_free_rows)
        # rl.routing_replay: each micro-batch's forwards pinned to the sampler's experts (policy/routing.py)
        self.routing = RoutingReplay(cfg.rl.routing_replay == "rollout", model, self.device)
        if cfg.model.compile:
            compile_layers(model)
        # Liger's RMSNorm, SwiGLU, RoPE (models/fused_kernels.py); the note says why on or off, for the log
        self.fused_kernels, self.fused_kernels_note = fused_kernels_choice(
            cfg.model, getattr(model.config, "model_type", None), self.device.type
        )
        if self.fused_kernels:
            apply_fused_kernels(model)
            if ref_model is not None and fusable(ref_model):  # the same kernels: equal logprobs at step 0
                apply_fused_kernels(ref_model)
        self.triton_head_note = use_triton_head(model, ref_model, model_cfg=cfg.model, device=self.device)
        if cfg.model.sequence_packing:
            check_packing_isolates(model)
        ref = ref_model is not None and objective.reference_logprobs  # model.cuda_graphs: models/cuda_graphs.py
        self.graphs, self.cuda_graphs_note = graphed_body_for(model, cfg, self.precision, self.dp.size, reference=ref)
        self.packed_update, self.packed_update_note = packed_update_choice(model, cfg.model, self.precision.mixed)

    # -- partitioning -------------------------------------------------------------------------
    def _mini_batches(self, n: int) -> list[list[int]]:
        size = self.cfg.rl.mini_batch
        return [list(range(i, min(n, i + size))) for i in range(0, n, size)]

    def _decide_sharing(self, batch: TrainBatch) -> bool:
        """Decide once per collected batch whether its prompts run once per group, and remember it.

        ``model.share_prompt_prefix``, except when the objective reads the policy's logprobs at extra
        ids (the sampler's head, the teacher's top-k): those come from the plain path only.
        ``auto``: ``shared_prefix.sharing_pays`` on the batch's mean lengths (on a CPU when the mean
        prompt is at least as long as the mean completion; on a GPU only for long prompts well over
        the completions' length, where the saved prompt tokens outweigh the second pass), and never
        under ``model.compile``: the shared path hands each compiled layer the KV cache, whose
        per-layer state makes dynamo recompile per layer until it gives up at its recompile limit (8)
        and runs the remaining layers eager. With several policy ranks the lengths of ALL cells
        decide, so every rank takes the same forward path (the shared-prefix path runs other FSDP
        collectives; a rank-local decision could desynchronise them)."""
        share = self.cfg.model.share_prompt_prefix
        if batch.images is not None and share is True:
            raise TrainingError(f"model.share_prompt_prefix=true: {SHARED_PROMPT_REFUSAL}")
        # model.cuda_graphs=true: the graphs take padded rows only (auto graphs the batches it does not share)
        plain_only = self.objective.plain_path_only or self.cfg.model.cuda_graphs is True
        if plain_only or share is False or batch.images is not None:
            self._share = False
        elif share is True:
            self._share = True
        elif self.cfg.model.compile:
            self._share = False
        else:
            lengths = torch.tensor(
                [
                    sum(len(p) for p in batch.prompt_ids),
                    sum(len(c) for c in batch.completion_ids),
                    len(batch.completion_ids),
                ],
                dtype=torch.float64,
            )
            prompt_tokens, completion_tokens, rows = self.dp.sum(lengths).tolist()
            rows = max(rows, 1.0)
            self._share = sharing_pays(
                prompt_tokens / rows, completion_tokens / rows, on_gpu=self.device.type == "cuda"
            )
        return self._share

    def _shares_prefix(self, batch: TrainBatch, size: int, mini: list[int]) -> bool:
        """Whole groups per micro-batch, so each prompt can run once (``model.share_prompt_prefix``)."""
        g = batch.group_size
        return self._share and g > 1 and size % g == 0 and mini[0] % g == 0 and len(mini) % g == 0

    def _micro_batches(self, batch: TrainBatch, mini: list[int], size: int, shared: bool) -> list[list[int]]:
        """Micro-batches of ``size`` rows of a mini-batch: whole groups when the prompt pass is ``shared``,
        else rows sorted by length so that little padding is computed (with ``model.sequence_packing``,
        the split that packs into the fewest cells; as many micro-batches either way). Free rows
        (``_free_B``) come first, so that whole micro-batches of them skip the backward, on every rank alike."""
        free = None if self._free_B is None else self._free_B.tolist()
        if shared:
            order = mini if free is None else free_groups_first(mini, free, batch.group_size)
            return [order[i : i + size] for i in range(0, len(order), size)]
        lengths = [len(batch.prompt_ids[i]) + len(batch.completion_ids[i]) for i in mini]
        if self.cfg.model.sequence_packing:  # with no free rows: packing's own split
            return packed_free_first(mini, lengths, free or [False] * len(batch.completion_ids), size)
        by_len = sorted(range(len(mini)), key=lambda j: (free is None or not free[mini[j]], lengths[j]))
        return [[mini[j] for j in by_len[i : i + size]] for i in range(0, len(by_len), size)]

    def _free_rows(self, batch: TrainBatch) -> torch.Tensor | None:
        """The rows that learn nothing (``policy/free_rows.py``), or None: the objective has a term that
        moves them, or every new batch shape would record CUDA graphs or recompile the layers."""
        if not self.objective.zero_advantage_rows_learn_nothing or self.graphs is not None or self.cfg.model.compile:
            return None
        return free_rows(batch.advantages_B, batch.token_advantages, batch.group_size)

    def _passes(self, batch: TrainBatch, mini: list[int]) -> list[tuple[list[int], bool]]:
        """A mini-batch's passes, ``(rows, learns)``: its micro-batches, each split into the rows that
        learn and the free rows (no autograd) where every policy rank can (``dp.passes``; a rank
        whose micro-batch is wholly free splits it by a whole group where the prompt pass is shared)."""
        size = self.cfg.rl.micro_batch_per_replica or len(mini)
        shared = self._shares_prefix(batch, size, mini)
        unit = batch.group_size if shared else 1
        return self.dp.passes(self._micro_batches(batch, mini, size, shared), self._free_B, unit)

    def _model_batch(self, batch: TrainBatch, rows: list[int]) -> PolicyBatch | GroupedBatch:
        g = batch.group_size
        starts = rows[::g]  # whole groups, in any order (a micro-batch's free groups need not be adjacent)
        whole_groups = g > 1 and len(rows) % g == 0 and rows == [s + j for s in starts for j in range(g)]
        if self._share and whole_groups and all(s % g == 0 for s in starts):
            return build_grouped_batch(
                [batch.prompt_ids[i] for i in rows[::g]],
                [batch.completion_ids[i] for i in rows],
                group_size=g,
                pad_id=self.pad_id,
                device=self.device,
            )
        return build_policy_batch(
            [batch.prompt_ids[i] for i in rows],
            [batch.completion_ids[i] for i in rows],
            pad_id=self.pad_id,
            device=self.device,
            pack_capacity=0 if self.cfg.model.sequence_packing else None,
        )

    def _compute(self, model: nn.Module) -> AbstractContextManager[None]:
        """The compute dtype for a forward of ``model`` (policy, pi_old or reference pass): its weights read as
        compute-dtype copies (``compute_weights``) when the run is mixed and ``model`` is a plain module. An
        FSDP2-sharded policy computes in bf16 through its MixedPrecisionPolicy already (``shard_policy``), so it gets
        nothing here; nor does a run whose compute dtype is its parameter dtype (the CPU default; there, under
        ``model.cpu_packed_update``, the linears multiply over oneDNN-packed copies). A graphed body
        (``model.cuda_graphs``) casts its weights inside its graphs, so only the LM head is cast here."""
        if not self.precision.mixed:
            return packed_update_linears(model) if self.packed_update else nullcontext()
        if self._body_forward(model) is not None:
            return compute_weights(split_body_and_head(model)[1], self.precision)
        return mixed_forward(model, compute_weights(model, self.precision))

    def _body_forward(self, model: nn.Module) -> BodyForward | None:
        """The policy body's CUDA graphs for the policy's forwards in an unshared batch, else None."""
        if self.graphs is None or self._share or model is not self.model:
            return None
        return self.graphs.hidden_states

    def _logprobs(
        self, model: nn.Module, mb: PolicyBatch | GroupedBatch, images: ImageInputs | None = None
    ) -> torch.Tensor:
        temperature, chunk = self.cfg.rl.temperature, self.cfg.model.logprob_chunk_tokens
        with self._compute(model), self.routing.pinned(model):
            if images is not None and isinstance(mb, PolicyBatch):  # vision-language rows: policy/images.py
                pad, merge = image_layout(model)
                return vl_completion_logprobs(
                    model, mb, images, image_pad_id=pad, merge_size=merge, temperature=temperature, chunk_tokens=chunk
                )
            if isinstance(mb, GroupedBatch):
                return grouped_completion_logprobs(model, mb, temperature=temperature, chunk_tokens=chunk)
            out = completion_logprobs(
                model, mb, temperature=temperature, chunk_tokens=chunk, body_forward=self._body_forward(model)
            )
        return out if isinstance(out, torch.Tensor) else out[0]

    # -- passes --------------------------------------------------------------------------------
    @torch.no_grad()
    def _old_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """pi_old ``[B, T]`` (zeros past each completion, T its longest): the sampler's logprobs (on the
        host), a frozen pass ahead (n_mini > 1), or None (n_mini == 1: pi_old is the current policy
        itself, so the ratio is exactly one; or an objective that forms no ratio). One tensor, so each
        micro-batch takes its rows with one gather, not a copy per row."""
        rl = self.cfg.rl
        if not self.objective.uses_old_logprobs:
            return None
        width = max([1, *(len(c) for c in batch.completion_ids)])
        if rl.use_rollout_logprobs_for_loss:
            if any(lp is None for lp in batch.sampler_logprobs):  # the config check makes this unreachable
                raise TrainingError("rl.use_rollout_logprobs_for_loss: the rollout recorded no sampler logprobs")
            return pad_lists(batch.sampler_logprobs, width)
        if rl.n_mini == 1 or not self.objective.old_logprobs_pass:
            return None
        old_BT = torch.zeros(len(batch.completion_ids), width, device=self.device)
        was_training = self.model.training
        self.model.train()  # same mode as the update pass, so the probe compares like with like
        for mini in self._mini_batches(len(batch.completion_ids)):
            for rows, _ in self._passes(batch, mini):  # the update's own passes: the same shapes
                mb = self._model_batch(batch, rows)
                self.routing.prepare(batch, rows, mb)
                logprobs_BT = self._logprobs(self.model, mb, row_images(batch.images, rows))  # 0 past each row's end
                old_BT[to_device(torch.tensor(rows), self.device), : logprobs_BT.shape[1]] = logprobs_BT.float()
        self.model.train(was_training)
        return old_BT

    def _logprobs_at(
        self, pb: PolicyBatch | GroupedBatch, ids_BTK: torch.Tensor, images: ImageInputs | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The current logprobs and the current policy's logprobs at ``ids_BTK`` (both with gradient),
        from one forward on the plain path (the chunked LM head gathers K + 1 columns)."""
        if not isinstance(pb, PolicyBatch):
            raise TypeError("logprobs at extra ids need the plain PolicyBatch (see _decide_sharing)")
        with self._compute(self.model), self.routing.pinned(self.model):
            if images is not None:  # a vision-language student (multimodal OPD): policy/images.py
                pad, merge = image_layout(self.model)
                return vl_completion_logprobs_at(
                    self.model,
                    pb,
                    images,
                    ids_BTK,
                    image_pad_id=pad,
                    merge_size=merge,
                    temperature=self.cfg.rl.temperature,
                    chunk_tokens=self.cfg.model.logprob_chunk_tokens,
                )
            out = completion_logprobs(
                self.model,
                pb,
                temperature=self.cfg.rl.temperature,
                chunk_tokens=self.cfg.model.logprob_chunk_tokens,
                head_ids_BTK=ids_BTK,
                body_forward=self._body_forward(self.model),
            )
        if not isinstance(out, tuple):
            raise TypeError("completion_logprobs returned no logprobs at the extra ids")
        return out

    def _current_logprobs(
        self, batch: TrainBatch, rows: list[int], pb: PolicyBatch | GroupedBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The current logprobs of ``rows``, plus the top-k views the objective reads: the sampler's
        head and the policy's logprobs there (score centering), or the teacher's top-k logprobs and
        the student's at the same ids (direct distillation)."""
        width = pb.completion_ids_BT.shape[1]
        if batch.images is not None and self.objective.sampler_head:
            raise TrainingError("score centering does not take image prompts yet")
        if self.objective.sampler_head:
            ids_BTK, sampler_BTK = sampler_head_tensors(batch, rows, width, self.device)
            # padding ids gather id 0; they stay invalid through ids_BTK
            logprobs_BT, policy_BTK = self._logprobs_at(pb, ids_BTK.clamp(min=0))
            heads = {
                "head_ids_BTK": ids_BTK,
                "head_sampler_logprobs_BTK": sampler_BTK,
                "head_policy_logprobs_BTK": policy_BTK,
            }
            return logprobs_BT, heads
        if self.objective.teacher_topk:
            teacher_ids_BTK, teacher_BTK = teacher_topk_tensors(batch, rows, width, self.device)
            logprobs_BT, student_BTK = self._logprobs_at(pb, teacher_ids_BTK, row_images(batch.images, rows))
            return logprobs_BT, {"teacher_topk_logprobs_BTK": teacher_BTK, "student_topk_logprobs_BTK": student_BTK}
        return self._logprobs(self.model, pb, row_images(batch.images, rows)), {}

    def _loss_inputs(
        self, batch: TrainBatch, rows: list[int], pb: PolicyBatch | GroupedBatch, old: torch.Tensor | None
    ) -> LossInputs:
        logprobs_BT, topk = self._current_logprobs(batch, rows, pb)
        width = logprobs_BT.shape[1]
        mask_BT = pb.completion_mask_BT.float() * to_device(batch.in_loss_B[rows], self.device).float()[:, None]
        if self.objective.ignore_prefix_tokens:
            mask_BT[:, : self.objective.ignore_prefix_tokens] = 0.0
        old_BT = logprobs_BT.detach() if old is None else gather_rows(old, rows, width, self.device)
        ref_BT = None
        if self.ref_model is not None and self.objective.reference_logprobs:
            with torch.no_grad():
                ref_BT = self._logprobs(self.ref_model, pb, row_images(batch.images, rows))
            self.dp.reshard(self.ref_model)  # a sharded reference keeps no gathered unit between passes
        sampler_BT, sampler_recorded_B = sampler_logprobs_rows(batch, rows, width, self.device)
        token_adv_BT = None
        if batch.token_advantages is not None:
            token_adv_BT = token_advantage_rows(batch.token_advantages, rows, width, self.device)
        return LossInputs(
            token_advantages_BT=token_adv_BT,
            logprobs_BT=logprobs_BT,
            old_logprobs_BT=old_BT,
            advantages_B=to_device(batch.advantages_B[rows], self.device).float(),
            mask_BT=mask_BT,
            ref_logprobs_BT=ref_BT,
            sampler_logprobs_BT=sampler_BT,
            sampler_recorded_B=sampler_recorded_B,
            **topk,
        )

    def _probe(self, inputs: LossInputs, step: int) -> None:
        """pi_old must equal the first mini-batch's current logprobs: the policy has not moved yet."""
        gap = ((inputs.logprobs_BT.detach() - inputs.old_logprobs_BT).abs() * inputs.mask_BT).max()
        tol = PROBE_TOLERANCE.get(self.precision.compute_dtype, 1e-4)
        if float(gap) > tol:
            raise TrainingError(
                f"step {step}: determinism probe failed: pi_old differs from the first mini-batch's logprobs by "
                f"{float(gap):.3g} nats (> {tol}); the forward pass is not reproducible (dropout left on, "
                "nondeterministic kernels, or a MoE router); fix that before training with n_mini > 1"
            )

    # -- the update ----------------------------------------------------------------------------
    def train_on(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """All optimizer steps of one collected batch; returns the batch's training metrics."""
        self.dp.check_cells(len(batch.completion_ids))  # unequal cells would desync the collectives
        self._decide_sharing(batch)
        self._free_B = self._free_rows(batch)
        old = self._old_logprobs(batch)
        probe = old is not None and not self.cfg.rl.use_rollout_logprobs_for_loss
        self.model.train()
        totals: LossStats | None = None
        losses, grad_norms = [], []
        counts = []  # per mini-batch: (sequences, tokens) in the loss, over all ranks
        skips_before = self.zero_grad_skips_total
        pinned = 0  # positions the training forwards ran pinned to the sampler's routing
        for mini in self._mini_batches(len(batch.completion_ids)):
            in_loss = to_device(batch.in_loss_B[mini], self.device).float()
            lengths = to_device(
                torch.tensor([len(batch.completion_ids[i]) for i in mini], dtype=torch.float32), self.device
            )
            norm = LossNormalizer(num_tokens=(lengths * in_loss).sum(), num_seqs=in_loss.sum())
            norm = self.dp.global_normalizer(norm)  # counts of the whole step, all ranks
            counts.append(torch.stack([torch.as_tensor(norm.num_seqs), torch.as_tensor(norm.num_tokens)]).double())
            loss_sum, free_sum = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
            passes = self._passes(batch, mini)
            # one entry over the mini-batch's forwards and backwards: its weights cast once (not once per
            # micro-batch), and a checkpointed layer recomputes from the same copies
            with self._compute(self.model):
                for rows, learns in passes:
                    pb = self._model_batch(batch, rows)
                    pinned += self.routing.prepare(batch, rows, pb)
                    with torch.set_grad_enabled(learns):
                        inputs = self._loss_inputs(batch, rows, pb, old)
                        if probe:
                            self._probe(inputs, step)
                            probe = False
                        loss, stats = self.objective.loss(inputs, norm)
                        if learns:
                            loss.backward()
                    loss_sum += loss.detach()
                    free_sum += 0.0 if learns else loss.detach()
                    totals = stats if totals is None else totals.merge(stats)
            # every rank ran the same passes (dp.passes), so every rank takes this branch, and the flag agrees
            if not all(learns for _, learns in passes) and not self.dp.all_finite([free_sum]):
                raise TrainingError(  # their backward, which would have turned the gradient non-finite, did not run
                    f"step {step}: non-finite loss in rows whose advantages are all zero (this rank's: "
                    f"{float(free_sum)}); "
                    "the update was not applied. Lower rl.optimizer.lr, set rl.kl_coeff_clamp, or check the data"
                )
            grad_norms.append(self._optimizer_step(step))
            losses.append(loss_sum)
        self.model.eval()
        if totals is not None:
            totals = self.dp.merge_stats(totals)
            losses = list(self.dp.sum(torch.stack(losses)))  # each rank's loss is its share of the step's
        metrics = {k: float(v) for k, v in (totals.to_metrics() if totals else {}).items()}
        metrics["train/loss_avg"] = float(torch.stack(losses).mean())
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["optim/zero_grad_skips_total"] = float(self.zero_grad_skips_total)
        metrics["optim/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics["optim/step"] = float(self.optimizer_step)
        valid = torch.stack(counts).sum(0).tolist()
        metrics["train/valid_sequence_count"], metrics["train/valid_token_count"] = valid[0], valid[1]
        # 1: every optimizer step of the batch applied; 0: all skipped on an exactly-zero gradient
        metrics["optim/update_outcome"] = 1.0 - (self.zero_grad_skips_total - skips_before) / len(grad_norms)
        if self.routing.enabled:
            total = self.dp.sum(torch.tensor([pinned], dtype=torch.float64))  # fp64: exact past 2**24 tokens
            metrics["train/routing_replay_pinned_tokens"] = float(total[0])
        return metrics

    def _optimizer_step(self, step: int) -> float:
        """Clip, check, step. A non-finite gradient or update is fatal; an exactly-zero one is skipped."""
        # no gathered copy may outlive the shards it was gathered from: a pass without autograd (pi_old, free
        # rows) leaves FSDP's root unit gathered, and its parameters would then be the gathered tensors
        self.dp.reshard(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.cfg.rl.optimizer.grad_clip_norm or float("inf")
        # the global norm, the same float on every rank: the skip and abort below agree everywhere
        grad_norm = self.dp.clip_grad_norm(params, max_norm)
        if not torch.isfinite(torch.tensor(grad_norm)):
            named = [(self._param_names[id(p)], p.grad) for p in params]
            bad = first_nonfinite(named)
            where = (
                f"first seen in parameter {bad}"
                if bad != "?"
                else f"every entry on this rank is finite, their norm overflowed (largest in {largest_entry(named)})"
            )
            raise TrainingError(
                f"step {step}: non-finite gradient (grad_norm={grad_norm}), {where}; the update was not applied. "
                "Lower rl.optimizer.lr, set rl.kl_coeff_clamp, or check the data"
            )
        if grad_norm == 0.0:
            # every group tied (all advantages zero): nothing to learn, and Adam would still move
            self.zero_grad_skips_total += 1
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm
        try:
            self.optimizer.step()
            weights_written(params)  # fused AdamW leaves the version counters the packed copies' cache reads
        except RuntimeError as exc:  # e.g. an lr whose step size overflows fp32 inside the fused update
            opt = self.cfg.rl.optimizer
            raise TrainingError(
                f"step {step}: the {opt.name} step failed at rl.optimizer.lr={opt.lr:g} ({exc}); the update was not "
                "applied. Lower rl.optimizer.lr"
            ) from None
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.optimizer_step += 1
        weights = list[torch.Tensor](params)
        finite = self.dp.all_finite(weights)  # one verdict for all ranks, or some would step on
        if not finite:
            named = [(self._param_names[id(p)], p) for p in params]
            bad = first_nonfinite(named)
            what = (
                f"non-finite weights in parameter {bad}"
                if bad != "?"
                else f"weights so large that their norm overflows (largest in {largest_entry(named)})"
            )
            raise TrainingError(
                f"step {step}: the optimizer step produced {what} (optimizer {self.cfg.rl.optimizer.name}, "
                f"rl.optimizer.lr={self.cfg.rl.optimizer.lr:g}); resume from the last checkpoint with a lower lr"
            )
        return grad_norm
