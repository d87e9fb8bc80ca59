#!/usr/bin/env bash
# Sets up ./.venv (scripts/setup.sh), then runs the checks CI runs: ruff (lint, complexity, format),
# mypy, and the test suite (GPU-marked tests are deselected; they run on the device machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
echo "== mypy"
.venv/bin/mypy
echo "== pytest"
.venv/bin/pytest -q "$@"
