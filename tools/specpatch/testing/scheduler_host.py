"""How an engine's scheduler process used its host while a benchmark row ran.

At small batch a speculating engine is bound by its scheduler's Python loop, so two engines of
one config can differ widely when one scheduler shares its core or is preempted (profiles in
docs/benchmarks.md found every host frame of one engine about twice as long as the next's). A
row that records how busy the scheduler's process was and how often the kernel took its core
away says whether the row measured the config or the host.

    schedulers = scheduler_processes()          # once the engine is up
    before = snapshot(schedulers)
    ...                                         # the measured runs
    usage = snapshot(schedulers).since(before)  # usage.busy, usage.preempted_per_s
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import psutil

# The title sglang's scheduler processes set (setproctitle), one per TP rank.
SCHEDULER_TITLE = "sglang::scheduler"


def is_scheduler(proc: psutil.Process) -> bool:
    """Whether proc is one of sglang's scheduler processes (by its process title)."""
    try:
        return any(SCHEDULER_TITLE in part for part in proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def scheduler_processes(root: Optional[psutil.Process] = None) -> list[psutil.Process]:
    """The scheduler processes among root's descendants (default: this process's)."""
    root = root or psutil.Process()
    return [p for p in root.children(recursive=True) if is_scheduler(p)]


@dataclass(frozen=True)
class HostUsage:
    """CPU seconds (user + system, every thread), involuntary and voluntary context
    switches (as /proc/PID/status counts them) and wall seconds, summed over scheduler
    processes: totals from snapshot(), or one interval's from since()."""

    cpu_s: float
    preemptions: int
    wall_s: float
    # Voluntary switches: each time a thread blocked (a CUDA sync that sleeps rather than
    # spins, a socket or lock wait). A scheduler busy under 1.0 with many of them waited on
    # something; with few, it lost its core.
    waits: int = 0

    @classmethod
    def zero(cls) -> "HostUsage":
        """Nothing used over no time: the start of a sum of intervals."""
        return cls(cpu_s=0.0, preemptions=0, wall_s=0.0)

    def __add__(self, other: "HostUsage") -> "HostUsage":
        """Two intervals' use together (an engine that runs in turns with others: its
        own runs' intervals summed)."""
        return HostUsage(
            cpu_s=self.cpu_s + other.cpu_s,
            preemptions=self.preemptions + other.preemptions,
            wall_s=self.wall_s + other.wall_s,
            waits=self.waits + other.waits,
        )

    def since(self, before: "HostUsage") -> "HostUsage":
        return HostUsage(
            cpu_s=self.cpu_s - before.cpu_s,
            preemptions=self.preemptions - before.preemptions,
            wall_s=self.wall_s - before.wall_s,
            waits=self.waits - before.waits,
        )

    @property
    def busy(self) -> float:
        """CPU seconds per wall second: about 1.0 for a loop that never waits (a host-bound
        engine), more with busy helper threads."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def preempted_per_s(self) -> float:
        return self.preemptions / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def waits_per_s(self) -> float:
        return self.waits / self.wall_s if self.wall_s > 0 else 0.0


def snapshot(procs: list[psutil.Process]) -> HostUsage:
    """The processes' totals now; a process that has gone counts nothing."""
    cpu_s, preemptions, waits = 0.0, 0, 0
    for proc in procs:
        try:
            times = proc.cpu_times()
            switches = proc.num_ctx_switches()
        except psutil.NoSuchProcess:
            continue
        cpu_s += times.user + times.system
        preemptions += switches.involuntary
        waits += switches.voluntary
    return HostUsage(
        cpu_s=cpu_s, preemptions=preemptions, wall_s=time.monotonic(), waits=waits
    )


def cpus_of(procs: list[psutil.Process]) -> list[int]:
    """The CPU each process's main thread last ran on (a process that has gone: none)."""
    cpus = []
    for proc in procs:
        try:
            cpus.append(proc.cpu_num())
        except psutil.NoSuchProcess:
            continue
    return cpus


def move(procs: list[psutil.Process], cpus: set[int]) -> None:
    """Run every thread of the processes on `cpus` only (threads started later inherit the
    affinity of the thread that starts them). A benchmark puts each engine's schedulers on
    one CPU of their own and everything else of its process tree off it, so that the engines
    it compares run their host loops on the same CPU."""
    for proc in procs:
        try:
            for thread in proc.threads():
                os.sched_setaffinity(thread.id, cpus)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
