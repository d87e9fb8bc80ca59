#!/usr/bin/env bash
# The default recipe with vLLM's CPU build, 12 steps each: on-policy, one-step off-policy with the
# engine core in the trainer's process, and with it in a process of its own
# (rollout.separate_engine_process). Prints the medians of steps 3-12 and writes them as JSON.
#
#   bash benchmarks/offpolicy_cpu.sh [OUT_JSON]    (run from the repository root, after scripts/test.sh)
set -euo pipefail
out_json=${1:-benchmarks/results/offpolicy_cpu.json}
root=$(mktemp -d)
off="rl.max_off_policy_steps=1 rl.use_rollout_logprobs_for_loss=true"
for variant in "onpolicy:" "off_inprocess:$off" "off_separate:$off rollout.separate_engine_process=true"; do
  name=${variant%%:*}
  # shellcheck disable=SC2086  # the overrides are words
  POSTTRAIN_OUTPUT_ROOT=$root .venv/bin/posttrain grpo -- rollout.backend=vllm rl.max_steps=12 job.name="$name" \
    ${variant#*:} > "$root/$name.log" 2>&1
done
.venv/bin/python - "$root" "$out_json" <<'PY'
import glob, json, statistics, sys

root, out = sys.argv[1], sys.argv[2]
keys = ["timer/e2e_step_s", "timer/rollout_s", "timer/rollout_overlapped_s", "timer/train_s", "timer/weight_sync_s"]
result = {}
for name in ["onpolicy", "off_inprocess", "off_separate"]:
    (path,) = glob.glob(f"{root}/posttrain/grpo/{name}/*/metrics.jsonl")
    rows = [r for r in map(json.loads, open(path)) if r["step"] >= 3]
    result[name] = {k: round(statistics.median(r[k] for r in rows), 3) for k in keys if k in rows[0]}
    print(name, result[name])
json.dump(result, open(out, "w"), indent=1)
PY
