"""The ``model.lora`` rules that tie it to the rest of the config, checked before any model loads.

* Adapter dropout makes the training forward random. It is refused wherever two forwards of the
  same weights must agree: the pi_old ahead pass and its determinism probe (several optimizer steps
  per batch), score centering (the policy's head against the sampler's), and every mode that takes
  the ratio against the dropout-free sampler's logprobs (``rl.use_rollout_logprobs_for_loss``, OPD's
  advantage mode).
* Muon is refused: it orthogonalises the update of each hidden weight matrix, and LoRA's factors
  ``A`` (r x in) and ``B`` (out x r) are not such matrices: orthogonalising each factor's update does
  not orthogonalise the update of ``B @ A``, and ``B`` starts at zero, so Muon's first step would be
  a full-norm update of a rank-deficient factor. Nothing shows it helps; AdamW is what LoRA is tuned with.
* The vLLM engine serves the adapter as a LoRA request: ranks vLLM supports, no ``modules_to_save``
  (a LoRA request carries adapter matrices only).
* Disaggregated rollout replicas (Ray) receive the adapter alone (``rollout/replica_lora.py``) over
  any ``rl.weight_sync_transport``: nothing to refuse there.
* Adapter checkpoints are consolidated (``rl.checkpoint_format=dcp`` is refused: a few MB need no
  sharded writer).

Nothing here imports torch.
"""

from __future__ import annotations

from posttrain.config.lora import VLLM_LORA_RANKS, LoraConfig
from posttrain.config.schema import RunConfig
from posttrain.preflight.findings import Findings


def _dropout_problems(cfg: RunConfig) -> list[str]:
    """Where a random training forward would break a rule that needs repeatable forwards."""
    lora, rl = cfg.model.lora, cfg.rl
    if lora.dropout == 0:
        return []
    head = f"model.lora.dropout={lora.dropout} makes every training forward random"
    fix = "set model.lora.dropout=0"
    problems = []
    if rl.n_mini > 1 and not rl.use_rollout_logprobs_for_loss:
        problems.append(
            f"{head}, but rl.mini_batch_per_replica={rl.mini_batch_per_replica} gives {rl.n_mini} optimizer steps "
            "per batch: the pi_old ahead pass would not repeat and its determinism probe stops the run; "
            f"{fix} (or one optimizer step per batch)"
        )
    if rl.score_centering.enabled:
        problems.append(
            f"{head}, but rl.score_centering compares the policy's head with the dropout-free sampler's "
            f"token by token: the dropout noise would be centred as if it were train/inference mismatch; {fix}"
        )
    if rl.use_rollout_logprobs_for_loss:
        problems.append(
            f"{head}, but rl.use_rollout_logprobs_for_loss=true takes the ratio against the dropout-free "
            f"sampler's logprobs: the ratio would measure the dropout, not the update; {fix}"
        )
    if getattr(rl, "distillation_mode", None) == "advantage":
        problems.append(
            f"{head}, but rl.distillation_mode=advantage takes the clipped ratio against the student's "
            f"dropout-free rollout logprobs: the ratio would measure the dropout, not the update; {fix}"
        )
    return problems


def _engine_problems(cfg: RunConfig, lora: LoraConfig) -> list[str]:
    """What the rollout engine and the weight sync can carry."""
    problems = []
    if cfg.rollout.backend == "vllm":
        if lora.rank > VLLM_LORA_RANKS[-1]:
            problems.append(
                f"model.lora.rank={lora.rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; lower "
                "model.lora.rank or use rollout.backend=hf"
            )
        if lora.modules_to_save:
            problems.append(
                f"model.lora.modules_to_save={lora.modules_to_save} with rollout.backend=vllm: a vLLM LoRA request "
                "carries adapter matrices only, so the rollout would sample without the fully trained modules; "
                "set model.lora.modules_to_save=[] or use rollout.backend=hf"
            )
    return problems


def _module_problems(lora: LoraConfig) -> list[str]:
    """Target and fully trained modules must be told apart."""
    if not isinstance(lora.target_modules, list):
        return []
    both = sorted(set(lora.target_modules) & set(lora.modules_to_save))
    if not both:
        return []
    return [
        f"model.lora: {both} appear in both target_modules and modules_to_save; a module either gets an adapter "
        "or trains whole: remove it from one of the two lists"
    ]


def check_lora(cfg: RunConfig, out: Findings) -> None:
    """Every ``model.lora`` rule, appended to ``out`` (nothing when LoRA is off, except a warning
    for adapter settings that a zero rank ignores)."""
    lora = cfg.model.lora
    if not lora.enabled:
        defaults = LoraConfig()
        changed = [name for name in LoraConfig.model_fields if getattr(lora, name) != getattr(defaults, name)]
        if changed:
            out.warnings.append(
                f"model.lora.{changed[0]} is set but model.lora.rank=0 turns LoRA off: set model.lora.rank > 0 "
                "to train adapters"
            )
        return
    out.errors.extend(_dropout_problems(cfg))
    if cfg.rl.optimizer.name == "muon":
        out.errors.append(
            "rl.optimizer.name=muon with model.lora: Muon orthogonalises the update of whole hidden weight matrices, "
            "and a LoRA factor is not one (orthogonalising A's and B's updates does not orthogonalise B @ A's, and "
            "B starts at zero); use rl.optimizer.name=adamw"
        )
    out.errors.extend(_engine_problems(cfg, lora))
    if cfg.rollout.backend == "vllm" and cfg.rollout.separate_engine_process:
        out.warnings.append(
            "model.lora with rollout.separate_engine_process=true is untested (adapter sync is tested with the "
            "engine core in the trainer's process)"
        )
    out.errors.extend(_module_problems(lora))
    if cfg.rl.checkpoint_format == "dcp":
        out.errors.append(
            "rl.checkpoint_format=dcp with model.lora: adapter checkpoints are consolidated (the adapter and its "
            "optimizer state are a few MB); set rl.checkpoint_format=consolidated"
        )
