"""How fast each CPU of this host runs a fixed piece of Python right now.

A guest's CPUs are threads of the hypervisor's host: one that shares a physical core with a
busy sibling, or runs at a lower clock, runs the same Python slower, and nothing inside the
guest shows it (no steal time, no other thread on that CPU). A host-bound engine's scheduler
runs at the speed of the CPU it lands on, so a benchmark reads this map before each engine
(bench_e2e's rows carry it beside the CPU their scheduler ran on) and can pin the scheduler to
the fastest CPU (bench_e2e --pin-scheduler):

    python -m specpatch.gpu_host.vcpu_speed          # e.g. "cpu0 1.00 cpu1 0.97 ... cpu10 0.55"

The work is a loop of integer additions in this process, run on one CPU at a time (the calling
thread's affinity, restored after), timed best of a few runs: the best is the CPU's speed while
nothing else got in its way, so a CPU slow by its best is slow throughout.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Iterable, Optional

# About 5 ms of CPython on a 2020s server core: long enough to time, short enough that a
# 16-CPU map with 3 runs each takes a quarter of a second.
LOOP_ITERATIONS = 100_000


def spin(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i
    return total


def loops_per_second(
    cpu: int, repeats: int, iterations: int = LOOP_ITERATIONS
) -> float:
    """The fastest of `repeats` timed loops on `cpu`, in loop iterations per second."""
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        spin(iterations)  # the first run after a move warms the caches of that core
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            spin(iterations)
            best = min(best, time.perf_counter() - start)
    finally:
        os.sched_setaffinity(0, previous)
    return iterations / best


def relative(speeds: dict[int, float]) -> dict[int, float]:
    """Each CPU's speed over the fastest's."""
    fastest = max(speeds.values())
    return {cpu: s / fastest for cpu, s in speeds.items()}


def speed_map(
    cpus: Optional[Iterable[int]] = None, repeats: int = 3
) -> dict[int, float]:
    """Relative speed of each of `cpus` (default: every CPU this process may run on)."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    return relative({cpu: loops_per_second(cpu, repeats) for cpu in cpus})


def parse_cpu_list(text: str) -> list[int]:
    """A taskset-style list: "0-3,8" -> [0, 1, 2, 3, 8]."""
    cpus: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return sorted(set(cpus))


def format_map(speeds: dict[int, float]) -> str:
    return " ".join(f"cpu{cpu} {s:.2f}" for cpu, s in sorted(speeds.items()))


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpus", help="taskset-style list (default: this process's)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    cpus = parse_cpu_list(args.cpus) if args.cpus else None
    print(format_map(speed_map(cpus, args.repeats)))


if __name__ == "__main__":
    main()
