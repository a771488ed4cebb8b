"""Python stacks of engines' schedulers: py-spy started and stopped around a benchmark's runs
(specpatch.testing.stack_sampler, bench_e2e --py-spy) and two engines' samples compared
(benchmark/spec/stack_diff.py)."""

from __future__ import annotations

import signal
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import stack_diff  # noqa: E402

from specpatch.testing import stack_sampler  # noqa: E402

CHAIN = """\
run;loop;forward;launch 60
run;loop;process_result 30
run;loop 10
"""
# The same work with a second frame under the loop, and a longer forward.
POLICY = """\
run;loop;forward;launch 80
run;loop;process_result 30
run;loop;before_decode;choose 25
run;loop 10
"""


def test_collapsed_stacks_count_self_and_inclusive_samples():
    prof = stack_diff.parse_collapsed(POLICY + "\nnot a stack line\n")

    assert prof.total == 145
    assert prof.self_samples["launch"] == 80
    assert prof.self_samples["loop"] == 10
    assert prof.inclusive["loop"] == 145
    assert prof.inclusive["before_decode"] == 25


def test_a_frame_on_a_stack_twice_counts_once_per_sample():
    prof = stack_diff.parse_collapsed("run;f;g;f 7\n")

    assert prof.inclusive["f"] == 7
    assert prof.total == 7


def test_differences_put_the_frames_one_engine_adds_first():
    chain = stack_diff.parse_collapsed(CHAIN)
    policy = stack_diff.parse_collapsed(POLICY)

    rows = stack_diff.frame_differences(chain, policy)

    # loop and run carry every extra sample; then the new frames, then the longer forward.
    assert rows[:2] == [("loop", 100, 145), ("run", 100, 145)]
    assert rows[2:5] == [
        ("before_decode", 0, 25),
        ("choose", 0, 25),
        ("forward", 60, 80),
    ]
    assert ("process_result", 30, 30) in rows


def test_report_names_both_files_and_the_extra_frames(tmp_path):
    (tmp_path / "chain.txt").write_text(CHAIN)
    (tmp_path / "policy.txt").write_text(POLICY)

    text = stack_diff.report([tmp_path / "chain.txt", tmp_path / "policy.txt"], top=5)

    assert "chain.txt: 100 samples" in text
    assert "policy.txt: 145 samples" in text
    assert "+45 samples in all" in text
    assert "    +25  (0 -> 25)  before_decode" in text


class FakeSampler:
    """A py-spy process: its command, the signals it got, whether it was waited for."""

    started: list["FakeSampler"] = []

    def __init__(self, cmd, stdout=None, stderr=None):
        self.cmd = cmd
        self.log = Path(stdout.name)  # py-spy's own messages go to a file
        self.stderr_to_log = stderr == stack_sampler.subprocess.STDOUT
        self.pid = 9000 + len(FakeSampler.started)
        self.signals = []
        self.waited = False
        FakeSampler.started.append(self)

    def send_signal(self, sig):
        self.signals.append(sig)

    def wait(self, timeout=None):
        self.waited = True
        return 0


@pytest.fixture
def fake_py_spy(monkeypatch):
    FakeSampler.started = []
    affinity = {}
    monkeypatch.setattr(stack_sampler.shutil, "which", lambda name: "/bin/py-spy")
    monkeypatch.setattr(stack_sampler.subprocess, "Popen", FakeSampler)
    monkeypatch.setattr(
        stack_sampler.os,
        "sched_setaffinity",
        lambda pid, cpus: affinity.update({pid: cpus}),
    )
    return types.SimpleNamespace(started=FakeSampler.started, affinity=affinity)


def test_every_scheduler_is_sampled_off_the_schedulers_cpu_until_the_block_ends(
    fake_py_spy, tmp_path
):
    procs = {
        "policy": [types.SimpleNamespace(pid=11)],
        "chain": [types.SimpleNamespace(pid=22), types.SimpleNamespace(pid=23)],
    }

    with stack_sampler.sampled(procs, tmp_path / "s", cpus={0, 1}, rate=100) as files:
        assert all(not s.signals for s in fake_py_spy.started)  # sampling the runs

    assert files == {
        "policy": [tmp_path / "s" / "stacks-policy-11.txt"],
        "chain": [
            tmp_path / "s" / "stacks-chain-22.txt",
            tmp_path / "s" / "stacks-chain-23.txt",
        ],
    }
    first = fake_py_spy.started[0].cmd
    assert first[:4] == ["/bin/py-spy", "record", "--pid", "11"]
    assert {"--nonblocking", "--function"} <= set(first)
    assert first[first.index("--format") + 1] == "raw"
    assert first[first.index("--rate") + 1] == "100"
    assert first[first.index("--output") + 1] == str(files["policy"][0])
    assert fake_py_spy.affinity == {9000: {0, 1}, 9001: {0, 1}, 9002: {0, 1}}
    # What py-spy says (e.g. that ptrace was refused) is kept beside its samples.
    assert fake_py_spy.started[0].log == tmp_path / "s" / "stacks-policy-11.log"
    assert all(s.stderr_to_log for s in fake_py_spy.started)
    # py-spy writes its file on SIGINT: every sampler asked, then waited for.
    assert all(s.signals == [signal.SIGINT] and s.waited for s in fake_py_spy.started)


def test_samplers_stop_when_the_runs_fail(fake_py_spy, tmp_path):
    procs = {"chain": [types.SimpleNamespace(pid=22)]}

    with pytest.raises(RuntimeError):
        with stack_sampler.sampled(procs, tmp_path, cpus={0}):
            raise RuntimeError("an engine died")

    assert fake_py_spy.started[0].signals == [signal.SIGINT]


def test_without_py_spy_the_error_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(stack_sampler.shutil, "which", lambda name: None)

    with pytest.raises(FileNotFoundError, match="stage-extra-wheels"):
        stack_sampler.py_spy_path()
