"""specpatch.gpu_host.host_watch: busy threads and each CPU's steal, from /proc."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from specpatch.gpu_host import host_watch as hw

# A thread's stat line (proc(5)): pid, (comm), state, then fields 4..; utime is field 14,
# stime 15, processor 39. This comm holds a space and both parentheses.
STAT = (
    "1034 (sglang::sch (x)) R 601 1034 601 0 -1 4194560 9 0 0 0 "
    "250 50 0 0 20 0 12 0 777 1000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 "
    "10 0 0 0 0 0"
)


def test_a_stat_line_gives_comm_cpu_ticks_and_last_cpu_even_with_parens_in_comm():
    assert hw.parse_task_stat(STAT) == ("sglang::sch (x)", 300, 10)


def test_steal_is_read_per_cpu_and_the_total_line_is_skipped():
    text = (
        "cpu  100 0 50 1000 0 0 0 30 0 0\n"
        "cpu0 60 0 30 500 0 0 0 10 0 0\n"
        "cpu1 40 0 20 500 0 0 0 20 5 0\n"
        "\n"  # an empty line is skipped, not a crash
        "intr 12345 0 0\n"
        "ctxt 999\n"
    )
    assert hw.parse_cpu_steal(text) == {0: (10, 600), 1: (20, 580)}


def thread(tid, ticks, cpu=0, pid=7, name="worker"):
    return hw.ThreadStat(pid, tid, "python3", name, ticks, cpu)


def test_busy_threads_are_those_over_the_least_share_busiest_first():
    before = {1: thread(1, 100), 2: thread(2, 100), 3: thread(3, 100)}
    after = {
        1: thread(1, 150, cpu=3),  # half a core over one second at 100 ticks/s
        2: thread(2, 102),  # 0.02: idle
        3: thread(3, 200, cpu=5),  # a whole core
        4: thread(4, 900),  # born in between: no share to give
    }

    busy = hw.busy_threads(before, after, seconds=1.0, ticks_per_s=100, least=0.05)

    assert [(b.thread.tid, b.share, b.thread.cpu) for b in busy] == [
        (3, 1.0, 5),
        (1, 0.5, 3),
    ]


def test_a_thread_id_reused_by_another_process_is_not_compared():
    before = {5: thread(5, 10, pid=7)}
    after = {5: thread(5, 500, pid=8)}
    assert hw.busy_threads(before, after, 1.0, 100, 0.05) == []


def test_steal_shares_are_stolen_ticks_over_all_ticks_in_between():
    before = {0: (10, 1000), 1: (0, 1000)}
    after = {0: (60, 1100), 1: (0, 1100), 2: (5, 50)}  # cpu2 came online: left out
    assert hw.steal_shares(before, after) == {0: 0.5, 1: 0.0}


def test_a_line_names_each_busy_thread_and_each_cpu_with_steal():
    busy = [hw.Busy(hw.ThreadStat(657, 657, "python3", "sglang::schedul", 9, 0), 0.98)]
    line = hw.format_line(100.0, busy, {0: 0.0, 3: 0.2}, least=0.05)
    assert line == "100 busy 657/657 python3:sglang::schedul 0.98@cpu0 steal cpu3 0.20"


def fake_proc(root: Path, pid: int, comm: str, tasks: dict[int, str]) -> None:
    (root / str(pid) / "task").mkdir(parents=True)
    (root / str(pid) / "comm").write_text(comm + "\n")
    for tid, stat in tasks.items():
        (root / str(pid) / "task" / str(tid)).mkdir()
        (root / str(pid) / "task" / str(tid) / "stat").write_text(stat)


def test_threads_are_read_from_every_process_and_broken_entries_skipped(tmp_path):
    fake_proc(tmp_path, 1034, "python3", {1034: STAT, 1040: STAT.replace("250", "1")})
    fake_proc(tmp_path, 1200, "gone", {1200: "truncated"})
    (tmp_path / "self").mkdir()  # not a pid

    threads = hw.read_threads(tmp_path)

    assert sorted(threads) == [1034, 1040]
    assert threads[1040] == hw.ThreadStat(
        1034, 1040, "python3", "sglang::sch (x)", 51, 10
    )


def test_the_real_proc_shows_a_spinning_child_as_busy_on_its_cpu():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # started and spinning
        line = next(hw.watch(interval=1.0, least=0.05))
    finally:
        child.kill()
        child.wait()
    found = re.search(rf"{child.pid}/{child.pid} \S+ (\d\.\d\d)@cpu(\d+)", line)
    assert found, line
    # A share of a core even on a loaded host (a CI machine runs tests side by side).
    assert float(found.group(1)) >= 0.1
