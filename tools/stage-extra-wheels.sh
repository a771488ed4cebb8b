#!/usr/bin/env bash
# Download the cp312 wheels the GPU bundle (../shared/gpu/stage.sh) lacks into .whl/ (git-ignored);
# carry .whl with .gpu-bundle, and tools/gpu-tests.sh installs them. cuda-tile: flashinfer.comm
# imports it. py-spy: samples a running scheduler's Python stacks (its binary lands in
# /tmp/gpu-site/bin), where a profile of ops cannot say which frames a slower engine adds.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "cuda-tile==1.7.0" "py-spy==0.4.3"
ls .whl
