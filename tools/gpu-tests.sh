#!/usr/bin/env bash
# GPU tier, on the GPU host, from the checkout root, with .gpu-bundle/ staged from a cp312 build:
#   bash tools/gpu-tests.sh [OUT_DIR] [pytest args...]
# Runs every test marked `gpu` and writes OUT_DIR/gpu-summary.json (counts, per-test outcome,
# seconds and recorded metrics) and OUT_DIR/gpu-tests.log.
set -uo pipefail
out=${1:-${OUT:-build/gpu}}; shift || true
mkdir -p "$out"
python3 -c "import sglang" 2>/dev/null && [ -n "${PYTHONPATH:-}" ] || source .gpu-bundle/env.sh
# Wheels the bundle lacks (tools/stage-extra-wheels.sh): flashinfer.comm imports cuda.tile.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu-site .whl/*.whl 2>&1 | grep -v WARNING
fi
# FA3, when its parts were shipped to this host (tools/specpatch/fa3_stage.py).
if [ -f /tmp/fa3/manifest.json ]; then
  PYTHONPATH=tools:$PYTHONPATH python3 -m specpatch.fa3_stage install /tmp/fa3 || exit 1
fi
export SPECPATCH_MODEL_CACHE=${SPECPATCH_MODEL_CACHE:-/tmp/specpatch-models}
python3 -m pytest test/registered -m gpu -p no:cacheprovider --summary-json "$out/gpu-summary.json" "$@" 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}
python3 - "$out/gpu-summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print("gpu summary:", s["counts"])
PY
exit $status
