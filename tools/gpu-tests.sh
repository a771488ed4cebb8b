#!/usr/bin/env bash
# GPU tier, on the GPU host, from the checkout root, with the bundle staged from a cp312 build:
#   [GPU_TESTS_TIMEOUT_S=540] bash tools/gpu-tests.sh [OUT_DIR] [pytest args...]
# Runs every test marked `gpu` and writes OUT_DIR/gpu-junit.xml (pytest's junitxml: each test's
# outcome, seconds, failure text, and the metrics it recorded as <property> elements) and
# OUT_DIR/gpu-tests.log, then prints one line of counts, "gpu summary: {...}".
set -uo pipefail
out=${1:-${OUT:-build/gpu}}; shift || true
mkdir -p "$out"
source tools/gpu-env.sh || exit 1
source tools/gpu-timeouts.sh
# GPU_TESTS_TIMEOUT_S interrupts pytest as Ctrl-C would: it still writes the junit XML and the
# failures so far, which a device call's own time limit (a kill) leaves unwritten.
timeout -s INT -k 60 "${GPU_TESTS_TIMEOUT_S:-0}" \
  python3 -m pytest test/registered -m gpu -p no:cacheprovider --junitxml "$out/gpu-junit.xml" \
  $(per_test_timeout) "$@" 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}
stop_leftover_engines
if [ -f .flashinfer/manifest.json ]; then
  # What this call compiled comes back for the next calls: copy it into .flashinfer/.
  PYTHONPATH=tools:$PYTHONPATH python3 -m specpatch.gpu_host.flashinfer_stage collect "$out"
fi
# Triton's compiled kernels as well: copy triton-cache.tar.xz into .triton-cache/; and
# sglang's nvcc-built modules: copy tvm-ffi-cache.tar.xz into .jit-cache/.
PYTHONPATH=tools:$PYTHONPATH python3 -m specpatch.gpu_host.triton_cache collect "$out"
PYTHONPATH=tools:$PYTHONPATH python3 -m specpatch.gpu_host.jit_cache collect "$out"
python3 - "$out/gpu-junit.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

try:
    cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
except (OSError, ET.ParseError) as err:
    print("gpu summary: no junit report:", err)
    sys.exit(0)
counts = {}
for case in cases:
    tag = next((t for t in ("failure", "error", "skipped") if case.find(t) is not None), "")
    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(tag, "passed")
    counts[outcome] = counts.get(outcome, 0) + 1
print("gpu summary:", counts)
PY
exit $status
