"""Python stacks of an engine's scheduler processes, sampled by py-spy while a benchmark runs.

A profile of ops says how long each op took; when one engine runs the same ops slower than
another on the same CPU, it cannot say which Python frames the slower one adds between them.
py-spy reads a process's stacks from outside it (no change to the engine, no pause with
--nonblocking) and, at exit, writes how many samples each distinct stack got, one
"frame;frame;...;frame COUNT" line per stack (its raw, collapsed format). An idle scheduler
(sglang's --sleep-on-idle waits in a poll) yields no samples, so an engine's file covers the
time its scheduler worked; benchmark/spec/stack_diff.py compares two of them.

    with sampled({"policy": [p1], "chain": [p2]}, out_dir, cpus={0, 1, 2}) as files:
        ...  # the measured runs
    # files: {"policy": [out_dir / "stacks-policy-<pid>.txt"], "chain": [...]}
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Iterator, Mapping

import psutil

PY_SPY = "py-spy"
# Samples a second: enough for a few thousand samples per config in a benchmark's runs,
# few enough that py-spy stays a small load on the CPUs it is given.
DEFAULT_RATE = 250
# Seconds py-spy gets to write its file once asked to stop.
STOP_TIMEOUT_S = 30


def py_spy_path() -> str:
    """The py-spy executable on PATH (tools/stage-extra-wheels.sh puts it in .whl; on the GPU
    host it lands in /tmp/gpu-site/bin)."""
    path = shutil.which(PY_SPY)
    if path is None:
        raise FileNotFoundError(
            f"{PY_SPY} is not on PATH: pip install py-spy, or on the GPU host carry .whl "
            "(tools/stage-extra-wheels.sh) and source tools/gpu-env.sh, which puts "
            "/tmp/gpu-site/bin on PATH"
        )
    return path


def record_command(executable: str, pid: int, out: Path, rate: int) -> list[str]:
    """py-spy's command that samples process pid into `out` until interrupted: collapsed
    stacks, frames by function (not by line), without pausing the process."""
    return [
        executable,
        "record",
        "--pid",
        str(pid),
        "--rate",
        str(rate),
        "--function",
        "--nonblocking",
        "--format",
        "raw",
        "--output",
        str(out),
    ]


@contextlib.contextmanager
def sampled(
    processes: Mapping[str, list[psutil.Process]],
    out_dir: Path,
    cpus: set[int],
    rate: int = DEFAULT_RATE,
) -> Iterator[dict[str, list[Path]]]:
    """Sample every process of `processes` (name -> its processes) until the block ends,
    each into out_dir / f"stacks-{name}-{pid}.txt", py-spy's own output beside it in
    ".log" (where it says why it could not attach, e.g. ptrace refused); the samplers run on
    `cpus` only (keep them off the CPU the sampled schedulers share). Yields the files by
    name; they are written when the block exits (py-spy writes on SIGINT)."""
    executable = py_spy_path()
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[Path]] = {name: [] for name in processes}
    samplers: list[subprocess.Popen] = []
    try:
        for name, procs in processes.items():
            for proc in procs:
                out = out_dir / f"stacks-{name}-{proc.pid}.txt"
                with open(out.with_suffix(".log"), "w") as log:
                    sampler = subprocess.Popen(
                        record_command(executable, proc.pid, out, rate),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                samplers.append(sampler)
                os.sched_setaffinity(sampler.pid, cpus)
                files[name].append(out)
        yield files
    finally:
        for sampler in samplers:
            sampler.send_signal(signal.SIGINT)
        for sampler in samplers:
            try:
                sampler.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                sampler.kill()
                sampler.wait()
