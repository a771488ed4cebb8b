# Sourced by gpu-tests.sh and gpu-lanes.sh: a limit per GPU test, so one engine that hangs fails
# its test with the stacks of where it waits (pytest-timeout, which the GPU host has) instead of
# using up the device call. PER_TEST_TIMEOUT_S (default 420; 0: none) bounds each test; a fresh
# host's first flashinfer test JIT-compiles for minutes unless prebuilt modules travel.
per_test_timeout() {
  local limit=${PER_TEST_TIMEOUT_S:-420}
  if [ "$limit" != 0 ] && python3 -c "import pytest_timeout" 2>/dev/null; then
    echo "--timeout=$limit"
  fi
}
