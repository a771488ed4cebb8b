"""specpatch.testing.scheduler_host: how busy an engine's scheduler processes were, found by
the title sglang gives them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from specpatch.testing import scheduler_host

# A child that sets a process title, then spins on the CPU, blocks a thousand times a
# second (naps) or sleeps until killed.
CHILD = """
import sys, time, setproctitle
setproctitle.setproctitle(sys.argv[1])
print("ready", flush=True)
if sys.argv[2] == "spin":
    while True:
        pass
if sys.argv[2] == "naps":
    while True:
        time.sleep(0.001)
time.sleep(60)
"""


@pytest.fixture
def spawn():
    children = []

    def start(title: str, mode: str) -> psutil.Process:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, title, mode],
            stdout=subprocess.PIPE,
            text=True,
        )
        children.append(child)
        assert child.stdout.readline().strip() == "ready"
        return psutil.Process(child.pid)

    yield start
    for child in children:
        child.kill()
        child.wait()


def test_only_processes_titled_as_sglangs_schedulers_are_found(spawn):
    scheduler = spawn("sglang::scheduler_TP0", "sleep")
    spawn("sglang::detokenizer", "sleep")

    assert [p.pid for p in scheduler_host.scheduler_processes()] == [scheduler.pid]


def usage_over(
    seconds: float, *procs: psutil.Process
) -> list[scheduler_host.HostUsage]:
    """Each process's usage over the next `seconds`."""
    before = [scheduler_host.snapshot([p]) for p in procs]
    time.sleep(seconds)
    return [scheduler_host.snapshot([p]).since(b) for p, b in zip(procs, before)]


def test_a_spinning_scheduler_is_busy_and_a_sleeping_one_is_not(spawn):
    spun, slept = usage_over(
        0.5,
        spawn("sglang::scheduler_TP0", "spin"),
        spawn("sglang::scheduler_TP1", "sleep"),
    )

    assert spun.wall_s == pytest.approx(0.5, abs=0.2)
    assert spun.busy > 0.3  # most of a core, even beside other tests' work
    assert slept.busy < 0.2
    assert spun.preemptions >= 0 and slept.preemptions >= 0


def test_a_scheduler_that_blocks_often_counts_its_waits(spawn):
    napped, spun = usage_over(
        0.5,
        spawn("sglang::scheduler_TP0", "naps"),
        spawn("sglang::scheduler_TP1", "spin"),
    )

    assert napped.waits_per_s > 100  # about 1000 one-millisecond sleeps a second
    assert spun.waits_per_s < napped.waits_per_s / 10


def test_a_process_that_has_gone_counts_nothing(spawn):
    gone = spawn("sglang::scheduler_TP0", "sleep")
    gone.kill()
    gone.wait()

    usage = scheduler_host.snapshot([gone])

    assert (usage.cpu_s, usage.preemptions) == (0.0, 0)


def test_an_interval_is_the_difference_of_two_snapshots():
    before = scheduler_host.HostUsage(cpu_s=3.0, preemptions=10, wall_s=100.0, waits=5)
    after = scheduler_host.HostUsage(cpu_s=4.5, preemptions=40, wall_s=102.0, waits=805)

    usage = after.since(before)

    assert (usage.busy, usage.preempted_per_s, usage.waits_per_s) == (0.75, 15.0, 400.0)
    empty = before.since(before)
    assert (empty.busy, empty.preempted_per_s, empty.waits_per_s) == (0.0, 0.0, 0.0)


def test_moved_processes_run_every_thread_on_the_cpus_given(spawn):
    allowed = sorted(os.sched_getaffinity(0))
    scheduler = spawn("sglang::scheduler_TP0", "spin")

    scheduler_host.move([scheduler], {allowed[-1]})
    # The spinner moves at its next preemption: at most a few ticks, longer on a busy host.
    deadline = time.monotonic() + 5.0
    while scheduler_host.cpus_of([scheduler]) != [allowed[-1]]:
        assert time.monotonic() < deadline, scheduler_host.cpus_of([scheduler])
        time.sleep(0.05)

    assert {tuple(os.sched_getaffinity(t.id)) for t in scheduler.threads()} == {
        (allowed[-1],)
    }


def test_placement_of_gone_processes_is_nothing(spawn):
    gone = spawn("sglang::scheduler_TP0", "sleep")
    gone.kill()
    gone.wait()

    assert scheduler_host.cpus_of([gone]) == []
    scheduler_host.move([gone], set(os.sched_getaffinity(0)))  # no error
