#!/usr/bin/env bash
# Set up a CPU development/CI environment from scratch: .venv with the pinned stack and the
# patched sglang wheel built from this checkout. Idempotent; safe to re-run after edits.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v quilt >/dev/null; then
  echo "setup: installing quilt"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq quilt >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq quilt >/dev/null; fi
fi

python=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q "uv==0.13.9"
uv() { .venv/bin/uv "$@"; }

# Tooling first: the build needs it, and it has no dependencies of its own.
uv pip install -q --python .venv/bin/python -e .
.venv/bin/specpatch build --python-tag cp311
wheel=$(ls -t dist/sglang-0.5.12.post1+spec.*-cp311-*.whl | head -n 1)
# black and isort at upstream sglang's pre-commit versions: test_format checks our code with them.
uv pip install -q --python .venv/bin/python -c constraints.txt --reinstall-package sglang "$wheel" pytest \
  black==24.10.0 isort==5.13.2
.venv/bin/python -m specpatch.testing.cudastub build >/dev/null
.venv/bin/specpatch status
