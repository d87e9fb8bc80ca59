"""The model-free checks of ``rl.eval`` (evaluation during training), run with the shared checks.

When the evaluation is on: its data source is readable (the same checks as ``rl.data``: the first
row, then every row of a local file), the run's reward finds every input it needs in the eval
source, and a vLLM engine can sample at ``rl.eval.temperature``. Problems name ``rl.eval.*`` fields.
A cadence longer than the run only warns (the evaluation then runs at step 0 and at the end).
"""

from __future__ import annotations

from posttrain.config.schema import RunConfig
from posttrain.preflight.findings import Findings

# What every RewardInput carries whatever the data source (preflight/common.py ALWAYS_PROVIDED).
_ALWAYS_PROVIDED = frozenset({"prompt", "completion", "finish_reason", "metadata"})


def _as_eval(problem: str) -> str:
    """A data-check message about ``rl.data`` reworded to name ``rl.eval.data``."""
    return problem.replace("rl.data", "rl.eval.data")


def _eval_data_problems(cfg: RunConfig) -> list[str]:
    from posttrain.data.build import check_data_config
    from posttrain.data.rows import check_rows
    from posttrain.preflight.vision import check_vision_data, vision_policy_type

    # The row passes read rl.data: hand them a copy of the config whose prompt source is the eval one.
    as_train = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"data": cfg.rl.eval.data})})
    if vision_policy_type(cfg) is not None:  # a vision-language policy: the image row rules (every row)
        found = [_as_eval(p) for p in check_vision_data(as_train)]
        return [p if p.startswith("rl.eval") else f"rl.eval.data: {p}" for p in found]
    problems = [_as_eval(p) for p in check_data_config(cfg.rl.eval.data)]
    if problems:
        return problems
    rows = [_as_eval(p) for p in check_rows(as_train)]
    return [p if p.startswith("rl.eval") else f"rl.eval.data: {p}" for p in rows]


def _reward_input_problems(cfg: RunConfig) -> list[str]:
    from posttrain.data.build import provided_fields
    from posttrain.rewards.registry import reward_requires

    try:
        required = reward_requires(cfg.rl.reward)
    except Exception:  # an unresolvable reward is reported by the shared reward check, once
        return []
    provided = provided_fields(cfg.rl.eval.data) | _ALWAYS_PROVIDED
    return [
        f"rl.reward={cfg.rl.reward} needs the input {missing!r}, which the rl.eval.data source "
        f"({cfg.rl.eval.data.kind}) does not carry (set rl.eval.data.response_column, or evaluate on a "
        "source with reference answers)"
        for missing in sorted(required - provided)
    ]


def check_eval(cfg: RunConfig, out: Findings) -> None:
    """Every problem of ``rl.eval`` when it is enabled (nothing when it is off)."""
    ev = cfg.rl.eval
    if not ev.enabled:
        return
    out.errors.extend(_eval_data_problems(cfg))
    out.errors.extend(_reward_input_problems(cfg))
    ro = cfg.rollout
    if ro.backend == "vllm" and ro.temperature == 1.0 and ev.temperature not in (0.0, 1.0):
        out.errors.append(
            f"rl.eval.temperature={ev.temperature}: the vLLM engine of a run at rollout.temperature=1 reports raw "
            "logprobs and samples only at temperature 1 or greedily; set rl.eval.temperature to 0 or 1"
        )
    if ev.every_steps > cfg.rl.max_steps:
        out.warnings.append(
            f"rl.eval.every_steps={ev.every_steps} exceeds rl.max_steps={cfg.rl.max_steps}: the evaluation runs "
            "at step 0 and at the last step only"
        )
