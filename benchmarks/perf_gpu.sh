#!/usr/bin/env bash
# Issue 9's step-time variants on the device (after the profile of benchmarks/profile_update.py):
# vLLM engine on the 402M workload with the update settings the profile favours, then vLLM async
# scheduling, one-step off-policy sampling and compiled decoder layers. Stages follow the transfers
# (docs/vllm.md): `prep` with the first pack part (code snapshot .devsrc, random models in the
# background), `stage` for parts 1-4, `run` with the last part. Results: $OUT/perf.tgz.
set -uo pipefail
R=/tmp/res
mkdir -p "$R"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn

step() {  # NAME [grpo_step.py options]
  local name=$1; shift
  timeout "${STEP_TIMEOUT:-150}" python3 /tmp/devsrc/benchmarks/grpo_step.py --model /tmp/m05 --engine vllm \
    --steps "${STEP_STEPS:-4}" --micro-batch 64 --out "$R/$name.json" "$@" >"$R/$name.log" 2>&1
  echo "$name rc=$?"
  grep -E "^step|SUMMARY|Error" "$R/$name.log" | tail -6 | cut -c1-400
}

case ${1:-} in
  prep)
    mkdir -p /tmp/vparts && cp .vx/part* /tmp/vparts/ && rm -rf /tmp/devsrc && cp -r .devsrc /tmp/devsrc || exit 1
    setsid nohup python3 /tmp/devsrc/peers/make_random_models.py /tmp/devsrc/peers/tok >/tmp/models.log 2>&1 </dev/null &
    ls /tmp/vparts ;;
  stage)
    mkdir -p /tmp/vparts && cp .vx/part* /tmp/vparts/ && ls /tmp/vparts; tail -2 /tmp/models.log ;;
  run)
    export PYTHONPATH=/tmp/devsrc/src
    source .vx/vllm-install || exit 1
    [ -d /tmp/devsrc ] || cp -r .devsrc /tmp/devsrc
    [ -e /tmp/m05/config.json ] || python3 /tmp/devsrc/peers/make_random_models.py /tmp/devsrc/peers/tok 2>&1 | tail -2
    step v1_plain_micro64
    step v2_async --async-scheduling
    if [ -s "$R/v2_async.json" ]; then A=--async-scheduling; else A=; fi
    step v3_offpolicy --off-policy $A
    step v4_offpolicy_compile --off-policy --compile $A
    tar czf "$OUT/perf.tgz" -C /tmp res; ls -l "$OUT" ;;
  *) sed -n 2,6p "$0"; exit 2 ;;
esac
