"""The ``model.cuda_graphs=true`` rules (the policy body's forward and backward replayed as CUDA
graphs; ``models/cuda_graphs.py``), checked before any model loads (``auto``, the default, is never
refused: ``cuda_graphs_choice`` turns it off where one of these fails). The graphs are recorded for
the body of one plain, unsharded policy over right-padded rows, so refused are:

* a policy off CUDA (``model.device=cpu``, or ``auto`` where torch is a CPU build);
* several policy ranks (``grid``): FSDP2 gathers and frees the weights around every forward, so
  the addresses a graph recorded would not hold them;
* ``model.compile`` (two ways of removing the same launches), LoRA (peft's wrapped projections
  have not been recorded here) and ``model.gradient_checkpointing`` (a recompute inside the
  backward graph has not run here);
* ``model.sequence_packing`` and ``model.share_prompt_prefix=true``: the graphs take padded rows
  only (with ``share_prompt_prefix=auto``, ``true`` runs every prompt with its completion, and
  ``model.cuda_graphs=auto`` graphs only the batches that do not share their prompt);
* a sparse-MoE policy (its routing sorts tokens to experts by data-dependent sizes, which a graph
  cannot replay) and a vision-language one (image inputs vary per batch).

``rollout.cuda_graphs=true`` (the hf engine's decode replayed as CUDA graphs; ``rollout/graphed_decode.py``)
is refused with vLLM (which records its own), off CUDA, and for a model type the graphed decode does not run
(``check_rollout_cuda_graphs``); the rest of its rules need the loaded model and are the engine's.

Nothing here imports torch.
"""

from __future__ import annotations

from posttrain.config.rollout import GRAPHED_DECODE_MODEL_TYPES
from posttrain.config.schema import RunConfig
from posttrain.models.loading import local_model_config
from posttrain.preflight.findings import Findings
from posttrain.preflight.fused_kernels import policy_off_cuda
from posttrain.preflight.moe import model_is_sparse_moe

OFF = "set model.cuda_graphs=false"


def check_cuda_graphs(cfg: RunConfig, out: Findings, cuda_major: int | None) -> None:
    """``cuda_major``: the CUDA major version torch is built for, None for a CPU build."""
    model = cfg.model
    if model.cuda_graphs is not True:  # auto turns itself off where these would refuse it
        return
    head = "model.cuda_graphs=true"
    if (where := policy_off_cuda(model, cuda_major)) is not None:
        out.errors.append(f"{head} records CUDA graphs, but {where}; {OFF}")
    if cfg.grid.policy_ranks > 1:
        out.errors.append(
            f"{head} runs on one policy rank only, and the grid has {cfg.grid.policy_ranks} (FSDP2 moves the "
            f"weights the graphs would read); {OFF} or train on one rank"
        )
    conflicts = [
        (model.compile, "model.compile=true", "model.compile=false"),
        (model.lora.enabled, "LoRA (model.lora.rank > 0)", "no LoRA"),
        (model.gradient_checkpointing, "model.gradient_checkpointing=true", "model.gradient_checkpointing=false"),
        (model.sequence_packing, "model.sequence_packing=true", "model.sequence_packing=false"),
        (model.share_prompt_prefix is True, "model.share_prompt_prefix=true", "model.share_prompt_prefix=auto"),
    ]
    for hit, what, instead in conflicts:
        if hit:
            out.errors.append(
                f"{head} cannot be combined with {what}: the graphs take padded rows of a plain "
                f"policy body; {OFF} or set {instead}"
            )
    found = local_model_config(model.name_or_path, model.revision)  # None: check_model_path names the problem
    if found is None:
        return
    config = found[1]
    if model_is_sparse_moe(config):
        out.errors.append(f"{head}: {found[0]} is a sparse-MoE model, whose routing a graph cannot replay; {OFF}")
    if "vision_config" in config:
        out.errors.append(f"{head}: {found[0]} is a vision-language model, whose image inputs vary per batch; {OFF}")


ROLLOUT_OFF = "set rollout.cuda_graphs=auto"


def check_rollout_cuda_graphs(cfg: RunConfig, out: Findings, cuda_major: int | None) -> None:
    """``rollout.cuda_graphs=true``: the hf engine on CUDA, over a model type its graphed decode runs."""
    if cfg.rollout.cuda_graphs is not True:
        return
    head = "rollout.cuda_graphs=true"
    if cfg.rollout.backend != "hf":
        out.errors.append(
            f"{head} graphs the hf engine's decode; rollout.backend={cfg.rollout.backend} records its own; "
            f"{ROLLOUT_OFF}"
        )
        return
    if (where := policy_off_cuda(cfg.model, cuda_major)) is not None:
        out.errors.append(f"{head} records CUDA graphs, but {where}; {ROLLOUT_OFF}")
    found = local_model_config(cfg.model.name_or_path, cfg.model.revision)
    if found is None:
        return
    model_type, sparse = found[1].get("model_type"), model_is_sparse_moe(found[1])
    if model_type not in GRAPHED_DECODE_MODEL_TYPES or sparse:
        out.errors.append(
            f"{head}: {found[0]} is a {model_type!r} model{' (sparse MoE)' if sparse else ''}; "
            f"the graphed decode runs dense {', '.join(GRAPHED_DECODE_MODEL_TYPES)} models; {ROLLOUT_OFF}"
        )
