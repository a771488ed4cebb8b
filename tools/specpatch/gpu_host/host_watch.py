"""What ran where on this host, second by second: the busy threads and each CPU's steal.

At small batch a speculating engine is bound by its scheduler's Python loop, and profiles on
the GPU hosts found one engine's every host op up to twice as slow as the next engine's with
the same ops (docs/benchmarks.md). This log says, for every interval, which threads kept a
core busy (process and thread name, share of a core, the CPU each last ran on) and how much of
each CPU's time the hypervisor gave to something else (the `steal` column of /proc/stat): a
slow engine whose scheduler had its CPU to itself in the guest and no steal was slowed below
the guest (a hyperthread sibling, a clock), which no pinning inside the guest can fix.

    python -m specpatch.gpu_host.host_watch > host.log &   # until killed, one line a second
    ...                                                      # the benchmark
    kill %1

Each line: `TIME busy PID/TID PROCESS:THREAD SHARE@cpuN | ... steal cpuN SHARE ...`.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional


@dataclass(frozen=True)
class ThreadStat:
    pid: int
    tid: int
    process: str  # the process's name (its main thread's comm)
    thread: str  # this thread's comm
    ticks: int  # user + system CPU time, in clock ticks
    cpu: int  # the CPU it last ran on


def parse_task_stat(text: str) -> tuple[str, int, int]:
    """(comm, user + system ticks, last CPU) of a /proc/PID/task/TID/stat line. comm sits
    between the first "(" and the last ")" and may itself hold spaces and parentheses;
    the fields after it are counted from the state field (proc(5): utime is field 14,
    stime 15 and processor 39 of the whole line)."""
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): field n of the line is fields[n - 3].
    return comm, int(fields[11]) + int(fields[12]), int(fields[36])


def read_threads(proc: Path = Path("/proc")) -> dict[int, ThreadStat]:
    """Every thread of every process now, by thread id; one that exits while read is left
    out."""
    threads = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            process = (entry / "comm").read_text().strip()
            tasks = list((entry / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                comm, ticks, cpu = parse_task_stat((task / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
            tid = int(task.name)
            threads[tid] = ThreadStat(int(entry.name), tid, process, comm, ticks, cpu)
    return threads


def parse_cpu_steal(text: str) -> dict[int, tuple[int, int]]:
    """Per CPU of a /proc/stat text, (steal ticks, all ticks). The per-CPU lines are
    `cpuN user nice system idle iowait irq softirq steal [guest guest_nice]`; guest time is
    already counted in user, so the total is the first eight fields."""
    steal = {}
    for line in text.splitlines():
        name, *values = line.split() or [""]
        if not name.startswith("cpu") or name == "cpu":
            continue
        ticks = [int(v) for v in values[:8]]
        steal[int(name[3:])] = (ticks[7] if len(ticks) > 7 else 0, sum(ticks))
    return steal


@dataclass(frozen=True)
class Busy:
    thread: ThreadStat
    share: float  # of one core over the interval


def busy_threads(
    before: dict[int, ThreadStat],
    after: dict[int, ThreadStat],
    seconds: float,
    ticks_per_s: int,
    least: float,
) -> list[Busy]:
    """Threads seen at both ends that used at least `least` of a core in between, busiest
    first."""
    busy = []
    for tid, now in after.items():
        then = before.get(tid)
        if then is None or then.pid != now.pid or seconds <= 0:
            continue
        share = (now.ticks - then.ticks) / ticks_per_s / seconds
        if share >= least:
            busy.append(Busy(now, share))
    return sorted(busy, key=lambda b: (-b.share, b.thread.tid))


def steal_shares(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]
) -> dict[int, float]:
    """Per CPU, the share of its ticks in between that were stolen."""
    shares = {}
    for cpu, (steal, total) in after.items():
        if cpu not in before:
            continue
        elapsed = total - before[cpu][1]
        shares[cpu] = (steal - before[cpu][0]) / elapsed if elapsed > 0 else 0.0
    return shares


def format_line(
    at: float, busy: list[Busy], steal: dict[int, float], least: float
) -> str:
    threads = " | ".join(
        f"{b.thread.pid}/{b.thread.tid} {b.thread.process}:{b.thread.thread} "
        f"{b.share:.2f}@cpu{b.thread.cpu}"
        for b in busy
    )
    stolen = " ".join(
        f"cpu{cpu} {share:.2f}"
        for cpu, share in sorted(steal.items())
        if share >= least
    )
    return f"{at:.0f} busy {threads} steal {stolen}".rstrip()


def watch(interval: float, least: float, proc: Path = Path("/proc")) -> Iterator[str]:
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    threads = read_threads(proc)
    steal = parse_cpu_steal((proc / "stat").read_text())
    then = time.monotonic()
    while True:
        time.sleep(interval)
        now_threads = read_threads(proc)
        now_steal = parse_cpu_steal((proc / "stat").read_text())
        now = time.monotonic()
        yield format_line(
            time.time(),
            busy_threads(threads, now_threads, now - then, ticks_per_s, least),
            steal_shares(steal, now_steal),
            least,
        )
        threads, steal, then = now_threads, now_steal, now


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds a line")
    parser.add_argument(
        "--least",
        type=float,
        default=0.05,
        help="smallest share of a core (a thread) or of a CPU's ticks (steal) shown",
    )
    args = parser.parse_args(argv)
    for line in watch(args.interval, args.least):
        print(line, flush=True)


if __name__ == "__main__":
    main()
