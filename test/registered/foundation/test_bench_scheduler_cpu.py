"""benchmark/spec/bench_e2e.py --pin-scheduler: which CPU an engine's schedulers get, and
what a row records of where they ran."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import bench_e2e  # noqa: E402

SPEEDS = {0: 0.6, 3: 1.0, 5: 1.0, 7: 0.9}


@pytest.mark.parametrize(
    "pin, cpu", [("none", None), ("fastest", 3), ("7", 7), ("0", 0)]
)
def test_the_scheduler_cpu_is_none_the_fastest_lowest_first_or_the_one_named(pin, cpu):
    assert bench_e2e.scheduler_cpu(pin, SPEEDS) == cpu


def test_a_row_records_its_schedulers_cpus_and_the_slowest_of_their_speeds():
    me = psutil.Process()
    cpu = me.cpu_num()

    placed = bench_e2e.scheduler_placement([me], {cpu: 0.55, cpu + 1: 1.0})
    unknown = bench_e2e.scheduler_placement([me], {cpu + 1: 1.0})

    assert placed == {"scheduler_cpus": [cpu], "scheduler_cpu_speed": 0.55}
    assert unknown == {"scheduler_cpus": [cpu], "scheduler_cpu_speed": None}


def test_placing_schedulers_moves_them_to_the_cpu_and_nothing_when_unpinned(
    monkeypatch,
):
    moves = []
    monkeypatch.setattr(
        bench_e2e.scheduler_host, "move", lambda procs, cpus: moves.append(cpus)
    )
    monkeypatch.setattr(bench_e2e, "HOST_CPUS", [0, 1, 2, 3])

    bench_e2e.place_schedulers([], None)
    assert moves == []

    bench_e2e.place_schedulers([], 2)
    assert moves == [{2}, {0, 1, 3}]  # the schedulers, then the rest of the tree


def test_the_host_cpus_are_this_process_affinity():
    assert bench_e2e.HOST_CPUS == sorted(os.sched_getaffinity(0))
