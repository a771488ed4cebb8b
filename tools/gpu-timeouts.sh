# Sourced by gpu-tests.sh and gpu-lanes.sh: what bounds a GPU test run. A limit per GPU test,
# so one engine that hangs fails its test with the stacks of where it waits (pytest-timeout,
# which the GPU host has) instead of using up the device call. PER_TEST_TIMEOUT_S (default 420;
# 0: none) bounds each test; a fresh host's first flashinfer test JIT-compiles for minutes
# unless prebuilt modules travel. And stop_leftover_engines, after the tests.
per_test_timeout() {
  local limit=${PER_TEST_TIMEOUT_S:-420}
  if [ "$limit" != 0 ] && python3 -c "import pytest_timeout" 2>/dev/null; then
    echo "--timeout=$limit"
  fi
}
# After the tests: an sglang process (its title starts "sglang::") that outlived its test, e.g.
# a child an interrupted lane did not reach, is named and killed. On a warm host the next call
# would otherwise share the CPUs and the GPU with it and measure that. Every such process on
# the host, the tests' or not: never run tests beside a benchmark (session 65's call C lost its
# benchmark's engines to this sweep when a lane ended). sglang's children cannot be told apart
# by an environment mark, since setproctitle overwrites what /proc/PID/environ shows.
stop_leftover_engines() {
  local left
  left=$(pgrep -f '^sglang::' || true)
  [ -z "$left" ] && return 0
  echo "gpu: engine processes left after the tests, killed: $(ps -o pid=,args= -p $(echo $left | tr ' ' ',') | tr -s ' ' | tr '\n' ';')"
  kill -9 $left 2>/dev/null || true
}
