#!/usr/bin/env bash
# GPU tier in parallel lanes on the host's GPUs (several lanes per GPU), from the checkout root:
#   bash tools/gpu-lanes.sh OUT_DIR "SELECTION 1" "SELECTION 2" ...
# Each SELECTION is a pytest -k expression run by its own pytest process, writing
# OUT_DIR/laneN/{selection,gpu-junit.xml,gpu-tests.log}, packed into OUT_DIR/lanes.tar.gz at the end. The synthetic test engines cap their KV
# pool (specpatch.testing.engine.engine_kwargs), so several fit on one GPU at once; device time
# is the scarce resource, so independent groups share it. Each lane generates its synthetic
# models into its own cache, so no lane reads a checkpoint another is still writing. Keep
# engines that bind fixed ports (the mission-command server test) in one lane. LANE_TIMEOUT_S
# interrupts a lane that runs past it as Ctrl-C would: pytest stops its engines and still writes
# its junit XML and the failures so far (a plain kill left neither).
set -uo pipefail
out=${1:?usage: gpu-lanes.sh OUT_DIR SELECTION...}
shift
mkdir -p "$out"
# Once, before the lanes: unpacking the bundle and installing staged modules are not concurrent-safe.
source tools/gpu-env.sh || exit 1
source tools/gpu-timeouts.sh
model_cache=${SPECPATCH_MODEL_CACHE:-/tmp/specpatch-models}
# Lanes go round-robin over the host's GPUs (lane N on GPU N mod count); GPU_LANES=0 keeps every
# lane on what CUDA_VISIBLE_DEVICES already allows. A selection that starts with "@all " sees every
# GPU (multi-GPU tests: --tp 2, DP attention) and shares them with the other lanes.
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "${GPU_LANES:-1}" = 0 ] && gpus=0
pids=()
lane=0
for selection in "$@"; do
  dir="$out/lane$lane"
  mkdir -p "$dir"
  echo "$selection" >"$dir/selection"
  lane_env=(SPECPATCH_MODEL_CACHE="$model_cache/lane$lane")
  if [ "${selection#@all }" != "$selection" ]; then
    selection=${selection#@all }
  elif [ "$gpus" -gt 1 ]; then
    lane_env+=(CUDA_VISIBLE_DEVICES=$((lane % gpus)))
  fi
  env "${lane_env[@]}" timeout -s INT -k 60 "${LANE_TIMEOUT_S:-0}" python3 -m pytest test/registered -m gpu \
    -p no:cacheprovider -v --junitxml "$dir/gpu-junit.xml" $(per_test_timeout) -k "$selection" \
    >"$dir/gpu-tests.log" 2>&1 &
  pids+=($!)
  lane=$((lane + 1))
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
stop_leftover_engines
if [ -f .flashinfer/manifest.json ]; then
  PYTHONPATH=tools:$PYTHONPATH python3 -m specpatch.gpu_host.flashinfer_stage collect "$out"
fi
PYTHONPATH=tools:$PYTHONPATH python3 -m specpatch.gpu_host.triton_cache collect "$out"
PYTHONPATH=tools:$PYTHONPATH python3 -m specpatch.gpu_host.jit_cache collect "$out"
for dir in "$out"/lane*; do
  echo "== $(cat "$dir/selection"): $(tail -n 1 "$dir/gpu-tests.log")"
  grep -E "^(FAILED|ERROR) " "$dir/gpu-tests.log" | head -n 20
done
# One archive: the device tool brings back only a few files per call.
tar -czf "$out/lanes.tar.gz" -C "$out" $(cd "$out" && ls -d lane*/) && rm -rf "$out"/lane*/
exit $status
