#!/usr/bin/env bash
# GPU tier, on the GPU host, from the checkout root, with the bundle staged from a cp312 build:
#   bash tools/gpu-tests.sh [OUT_DIR] [pytest args...]
# Runs every test marked `gpu` and writes OUT_DIR/gpu-summary.json (counts, per-test outcome,
# seconds and recorded metrics) and OUT_DIR/gpu-tests.log.
set -uo pipefail
out=${1:-${OUT:-build/gpu}}; shift || true
mkdir -p "$out"
source tools/gpu-env.sh || exit 1
python3 -m pytest test/registered -m gpu -p no:cacheprovider --summary-json "$out/gpu-summary.json" "$@" 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}
if [ -f .flashinfer/manifest.json ]; then
  # What this call compiled comes back for the next calls: copy it into .flashinfer/.
  PYTHONPATH=tools:$PYTHONPATH python3 -m specpatch.gpu_host.flashinfer_stage collect "$out"
fi
python3 - "$out/gpu-summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print("gpu summary:", s["counts"])
PY
exit $status
