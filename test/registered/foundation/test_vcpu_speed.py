"""specpatch.gpu_host.vcpu_speed: each CPU's speed at a fixed piece of Python."""

from __future__ import annotations

import os

import pytest

from specpatch.gpu_host import vcpu_speed


@pytest.mark.parametrize(
    "text, cpus",
    [("0-3,8", [0, 1, 2, 3, 8]), ("5", [5]), ("2,0-1,1", [0, 1, 2]), ("", [])],
)
def test_cpu_lists_read_as_taskset_writes_them(text, cpus):
    assert vcpu_speed.parse_cpu_list(text) == cpus


def test_speeds_are_relative_to_the_fastest_cpu():
    assert vcpu_speed.relative({0: 200.0, 3: 100.0, 5: 150.0}) == {
        0: 1.0,
        3: 0.5,
        5: 0.75,
    }


def test_a_probe_runs_on_the_cpu_asked_for_and_gives_the_affinity_back(monkeypatch):
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    seen = []
    original = vcpu_speed.spin

    def spin_and_look(n):
        seen.append(os.sched_getaffinity(0))
        return original(n)

    monkeypatch.setattr(vcpu_speed, "spin", spin_and_look)
    speed = vcpu_speed.loops_per_second(cpu, repeats=2, iterations=1000)

    assert speed > 0
    assert seen and all(s == {cpu} for s in seen)
    assert os.sched_getaffinity(0) == allowed


def test_the_map_covers_every_allowed_cpu_and_its_fastest_is_one():
    speeds = vcpu_speed.speed_map(repeats=1)

    assert sorted(speeds) == sorted(os.sched_getaffinity(0))
    assert max(speeds.values()) == 1.0
    assert all(0 < s <= 1.0 for s in speeds.values())
    assert vcpu_speed.format_map({1: 0.5, 0: 1.0}) == "cpu0 1.00 cpu1 0.50"
