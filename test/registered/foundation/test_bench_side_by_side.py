"""benchmark/spec/bench_e2e.py --side-by-side: every config's engine up at once, the configs
taking turns run by run with their schedulers on one CPU; and the engine group it runs in."""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import bench_e2e  # noqa: E402

from specpatch.testing import engine as eng  # noqa: E402
from specpatch.testing import scheduler_host  # noqa: E402
from specpatch.testing.scheduler_host import HostUsage  # noqa: E402


def test_turns_rotate_the_first_engine_each_round():
    turns = bench_e2e.Turns({"a": 1, "b": 2, "c": 3}, {}, repeats=4)

    assert [turns.order(i) for i in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_taking_turns_warms_each_engine_then_times_them_alternately(monkeypatch):
    calls = []
    clock = iter(range(100))

    def snapshot(procs):
        # each engine's one scheduler has used one CPU second per read
        return HostUsage(
            cpu_s=float(next(clock)), preemptions=1, wall_s=float(next(clock))
        )

    monkeypatch.setattr(scheduler_host, "snapshot", snapshot)
    turns = bench_e2e.Turns({"a": "A", "b": "B"}, {"a": ["pa"], "b": ["pb"]}, 3)

    def run(engine):
        calls.append(engine)
        return f"{engine}{len(calls)}"

    results, usage = turns.take(run)

    assert calls == ["A", "B", "A", "B", "B", "A", "A", "B"]
    assert results == {"a": ["A3", "A6", "A7"], "b": ["B4", "B5", "B8"]}
    # Three intervals each (before and after a run: 2 cpu and 2 wall seconds apart).
    assert usage["a"] == HostUsage(cpu_s=6.0, preemptions=0, wall_s=6.0)
    assert usage["a"].busy == pytest.approx(1.0)


def test_labelled_turns_print_each_timed_run_as_it_ends(monkeypatch, capsys):
    monkeypatch.setattr(scheduler_host, "snapshot", lambda procs: HostUsage.zero())
    turns = bench_e2e.Turns({"a": "A", "b": "B"}, {"a": [], "b": []}, 2)
    speeds = iter([1.0, 2.0, 300.0, 400.0, 500.0, 600.0])

    turns.take(
        lambda engine: types.SimpleNamespace(tok_per_s=next(speeds)), label="bs 4"
    )

    # The untimed round prints nothing; then round 0 (a, b) and round 1 (b, a).
    assert capsys.readouterr().out.splitlines() == [
        "bs 4: a run 1/2 300 tok/s",
        "bs 4: b run 1/2 400 tok/s",
        "bs 4: b run 2/2 500 tok/s",
        "bs 4: a run 2/2 600 tok/s",
    ]


def test_host_usage_sums_intervals_from_zero():
    one = HostUsage(cpu_s=1.5, preemptions=3, wall_s=2.0, waits=4)
    two = HostUsage(cpu_s=0.5, preemptions=1, wall_s=1.0, waits=0)

    total = HostUsage.zero() + one + two

    assert total == HostUsage(cpu_s=2.0, preemptions=4, wall_s=3.0, waits=4)
    assert total.busy == pytest.approx(2.0 / 3.0)


@pytest.fixture
def engines_without_a_gpu(monkeypatch):
    """measure_side_by_side's engine group, schedulers and runs faked: each engine a name,
    each engine's scheduler a string, each run one second of 8 tokens a request; a host of
    CPUs 0-3 whose CPU 2 is the fastest."""
    started, runs, moves = [], [], []
    pool_tokens = (
        {}
    )  # engine -> its KV pool: what it asked for unless a test shrinks it

    @contextlib.contextmanager
    def engine_group():
        def start(**kwargs):
            started.append((kwargs, os.environ.get("SGLANG_SPEC_CHAIN_FAST_PATH")))
            engine = f"engine{len(started)}"
            pool_tokens.setdefault(engine, kwargs["max_total_tokens"])
            return engine

        yield start

    def generate(e, batch, n):
        runs.append((e, len(batch), n))
        return eng.GreedyRun(
            output_ids=[[0] * n] * len(batch),
            seconds=1.0,
            completion_tokens=n * len(batch),
        )

    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    monkeypatch.setattr(bench_e2e.eng, "engine_group", engine_group)
    monkeypatch.setattr(bench_e2e.eng, "generate", generate)
    # Engines a test starts its own way: pools as large as any asks for.
    monkeypatch.setattr(
        bench_e2e.eng, "kv_pool_tokens", lambda e: pool_tokens.get(e, 1 << 30)
    )
    monkeypatch.setattr(
        bench_e2e.vcpu_speed,
        "speed_map",
        lambda cpus=None: {0: 0.6, 1: 0.55, 2: 1.0, 3: 0.9},
    )
    monkeypatch.setattr(bench_e2e, "HOST_CPUS", [0, 1, 2, 3])
    # The schedulers this process has: one more with each engine started.
    monkeypatch.setattr(
        scheduler_host,
        "scheduler_processes",
        lambda: [f"scheduler{i + 1}" for i in range(len(started))],
    )
    monkeypatch.setattr(
        scheduler_host, "snapshot", lambda procs: HostUsage(0.0, 0, 0.0)
    )
    monkeypatch.setattr(scheduler_host, "cpus_of", lambda procs: [2] * len(procs))
    monkeypatch.setattr(
        scheduler_host, "move", lambda procs, cpus: moves.append((list(procs), cpus))
    )
    return types.SimpleNamespace(
        started=started, runs=runs, moves=moves, pool_tokens=pool_tokens
    )


def test_side_by_side_starts_every_engine_and_puts_their_schedulers_on_one_cpu(
    engines_without_a_gpu,
):
    rows = bench_e2e.measure_side_by_side(
        Path("/t"), Path("/d"), ["none", "chain", "policy"], [4], 8, 100, repeats=2
    )

    started = engines_without_a_gpu.started
    assert [kwargs.get("speculative_eagle_topk") for kwargs, _ in started] == [
        None,
        1,
        16,
    ]
    # An idle engine sleeps rather than spin beside the one that runs.
    assert all(kwargs["sleep_on_idle"] is True for kwargs, _ in started)
    # Every engine's pool at once: the smallest, not 2^16 tokens, for 4 requests of 8.
    assert all(kwargs["max_total_tokens"] == 1 << 15 for kwargs, _ in started)
    # Each config's env only while its engine starts (its schedulers read it then).
    assert [env for _, env in started] == [None, "1", None]
    assert "SGLANG_SPEC_CHAIN_FAST_PATH" not in os.environ
    schedulers, cpus = engines_without_a_gpu.moves[0]
    assert schedulers == ["scheduler1", "scheduler2", "scheduler3"]
    assert cpus == {2}  # --pin-scheduler none: the fastest CPU
    assert [r["scheduler_cpus"] for r in rows] == [[2]] * 3
    assert [r["scheduler_cpu_speed"] for r in rows] == [1.0] * 3
    assert [(r["config"], r["bs"]) for r in rows] == [
        ("none", 4),
        ("chain", 4),
        ("policy", 4),
    ]
    assert all(r["side_by_side"] == ["none", "chain", "policy"] for r in rows)
    assert rows[0]["accept_length"] == 1.0  # no speculation


def test_side_by_side_runs_the_configs_in_turns(engines_without_a_gpu):
    bench_e2e.measure_side_by_side(
        Path("/t"), Path("/d"), ["none", "chain"], [1, 4], 8, 100, repeats=2
    )

    runs = engines_without_a_gpu.runs
    full = [(e, bs) for e, bs, n in runs if n == 8]
    first = [(e, bs) for e, bs, n in runs if n == 1]
    # Per batch size: a warm-up round, then rounds that alternate which engine goes first.
    assert full == [
        ("engine1", 1),
        ("engine2", 1),
        ("engine1", 1),
        ("engine2", 1),
        ("engine2", 1),
        ("engine1", 1),
        ("engine1", 4),
        ("engine2", 4),
        ("engine1", 4),
        ("engine2", 4),
        ("engine2", 4),
        ("engine1", 4),
    ]
    assert len(first) == len(full)  # first-token runs in the same turns


def test_side_by_side_prints_each_size_before_the_next_runs(
    engines_without_a_gpu, monkeypatch, capsys
):
    # A device call cut by its time limit keeps what it printed: each finished size's rows.
    printed_before_bs4 = []
    generate = bench_e2e.eng.generate

    def generate_noting_output(e, batch, n):
        if len(batch) == 4 and not printed_before_bs4:
            printed_before_bs4.append(capsys.readouterr().out)
        return generate(e, batch, n)

    monkeypatch.setattr(bench_e2e.eng, "generate", generate_noting_output)

    bench_e2e.measure_side_by_side(
        Path("/t"), Path("/d"), ["none", "chain"], [1, 4], 8, 100, repeats=2
    )

    # One fake run: 8 tokens of one request in 1 s.
    assert "none bs 1: 8 tok/s, accept 1.00, diverged None" in printed_before_bs4[0]
    assert "chain bs 1: 8 tok/s" in printed_before_bs4[0]
    assert "bs 4" not in printed_before_bs4[0]
    assert "chain bs 4: 32 tok/s" in capsys.readouterr().out


def test_side_by_side_pins_where_asked(engines_without_a_gpu):
    bench_e2e.measure_side_by_side(
        Path("/t"), Path("/d"), ["none", "chain"], [1], 8, 100, pin_scheduler="3"
    )

    schedulers, cpus = engines_without_a_gpu.moves[0]
    assert (schedulers, cpus) == (["scheduler1", "scheduler2"], {3})
    # The rest of this process tree off it, and every CPU back for this process at the end.
    assert engines_without_a_gpu.moves[1][1] == {0, 1, 2}
    assert engines_without_a_gpu.moves[-1][1] == {0, 1, 2, 3}


class _Watchdog:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def stop(self):
        self.log.append(("stop", self.name))


def test_an_engine_group_stops_every_watchdog_before_it_kills_the_children(
    monkeypatch,
):
    import sglang
    import sglang.srt.utils

    log = []

    class FakeEngine:
        def __init__(self, **kwargs):
            name = kwargs["name"]
            if name == "broken":
                raise RuntimeError("scheduler died during start-up")
            self.tokenizer_manager = types.SimpleNamespace(
                _subprocess_watchdog=_Watchdog(log, name) if name != "bare" else None
            )
            log.append(("start", name))

    monkeypatch.setattr(sglang, "Engine", FakeEngine)
    monkeypatch.setattr(
        sglang.srt.utils,
        "kill_process_tree",
        lambda pid, include_parent=True, wait_timeout=None: log.append(
            ("kill", include_parent, wait_timeout)
        ),
    )

    with eng.engine_group() as start:
        a = start(name="a")
        start(name="bare")
        start(name="b")
        assert isinstance(a, FakeEngine)
    assert log == [
        ("start", "a"),
        ("start", "bare"),
        ("start", "b"),
        ("stop", "a"),
        ("stop", "b"),
        ("kill", False, 60),  # waits for the GPU to be let go
    ]

    log.clear()
    with pytest.raises(RuntimeError, match="died"):
        with eng.engine_group() as start:
            start(name="a")
            start(name="broken")
    assert log == [("start", "a"), ("stop", "a"), ("kill", False, 60)]


def test_live_tokens_cover_the_largest_batch_or_the_mixed_load(monkeypatch):
    monkeypatch.setattr(bench_e2e, "PROMPT_LEN", [8, 64])
    per_request = 64 + bench_e2e.SPEC_SLACK_TOKENS

    assert bench_e2e.live_tokens([1, 48, 4], None, 128) == 48 * (per_request + 128)
    tail = bench_e2e.MixedLoad.parse("4:1.5:2x1024")
    # two requests of 1024 tokens and four of 128, all in flight at once at worst
    assert bench_e2e.live_tokens([1], tail, 128) == 2 * (per_request + 1024) + 4 * (
        per_request + 128
    )
    assert bench_e2e.live_tokens([64], tail, 128) == 64 * (per_request + 128)


def test_side_by_side_mixed_load_rows_keep_every_run(
    engines_without_a_gpu, monkeypatch
):
    def arrivals(e, prompts, tokens, delays):
        engines_without_a_gpu.runs.append((e, len(prompts), "mixed"))
        seconds = 2.0 if e == "engine1" else 1.0
        return eng.GreedyRun(
            output_ids=[[0] * n for n in tokens],
            seconds=seconds,
            completion_tokens=sum(tokens),
            peak_in_flight=6 if e == "engine1" else 3,
        )

    monkeypatch.setattr(bench_e2e.eng, "arrivals_generate", arrivals)
    rows = bench_e2e.measure_side_by_side(
        Path("/t"),
        Path("/d"),
        ["none", "chain"],
        [],
        8,
        100,
        repeats=2,
        mixed=bench_e2e.MixedLoad.parse("4:1.5:2x16"),
    )

    assert [(r["config"], r["bs"]) for r in rows] == [
        ("none", "mixed"),
        ("chain", "mixed"),
    ]
    tokens = 2 * 16 + 4 * 8
    assert [r["tok_per_s_repeats"] for r in rows] == [
        [tokens / 2.0] * 2,
        [tokens / 1.0] * 2,
    ]
    assert [r["peak_in_flight_repeats"] for r in rows] == [[6, 6], [3, 3]]
    assert bench_e2e.mixed_run_lines(rows) == [
        f"  none: {tokens / 2.0:.0f} at 6 / {tokens / 2.0:.0f} at 6",
        f"  chain: {tokens:.0f} at 3 / {tokens:.0f} at 3",
    ]
    mixed_runs = [e for e, _, kind in engines_without_a_gpu.runs if kind == "mixed"]
    assert mixed_runs == [
        "engine1",
        "engine2",
        "engine1",
        "engine2",
        "engine2",
        "engine1",
    ]


@pytest.mark.parametrize(
    "bs, tokens, pool",
    [
        (64, 256, 64 * (64 + 256 + 256)),  # what its live requests hold
        (128, 256, 1 << 16),  # no more than one engine alone gets
    ],
)
def test_side_by_side_pools_hold_the_live_requests(
    engines_without_a_gpu, monkeypatch, bs, tokens, pool
):
    monkeypatch.setattr(bench_e2e, "PROMPT_LEN", [8, 64])
    bench_e2e.measure_side_by_side(
        Path("/t"), Path("/d"), ["none", "chain"], [1, bs], tokens, 100, repeats=1
    )

    assert [k["max_total_tokens"] for k, _ in engines_without_a_gpu.started] == [
        pool,
        pool,
    ]


def test_side_by_side_engines_take_a_large_static_share_of_a_capped_pool(
    engines_without_a_gpu,
):
    bench_e2e.measure_side_by_side(
        Path("/t"), Path("/d"), ["none", "chain"], [4], 8, 100, repeats=1
    )

    # Engines loading at once read each other's weights as used memory: at sglang's
    # default share the later ones would get a few hundred tokens.
    shares = [k["mem_fraction_static"] for k, _ in engines_without_a_gpu.started]
    assert shares == [bench_e2e.SIDE_BY_SIDE_MEM_FRACTION] * 2
    assert bench_e2e.SIDE_BY_SIDE_MEM_FRACTION > 0.55


def test_an_engine_with_a_short_pool_stops_the_run_before_it_runs(
    engines_without_a_gpu, monkeypatch
):
    monkeypatch.setattr(bench_e2e, "PROMPT_LEN", [8, 64])
    need = 48 * (64 + bench_e2e.SPEC_SLACK_TOKENS + 128)
    engines_without_a_gpu.pool_tokens["engine2"] = need - 1

    with pytest.raises(
        SystemExit, match=f"short of the {need} tokens.*: chain {need - 1};"
    ):
        bench_e2e.measure_side_by_side(
            Path("/t"), Path("/d"), ["none", "chain"], [1, 48], 128, 100, repeats=1
        )
    assert engines_without_a_gpu.runs == []


def test_a_pool_that_holds_the_live_requests_runs(engines_without_a_gpu):
    need = bench_e2e.live_tokens([4], None, 8)
    engines_without_a_gpu.pool_tokens["engine1"] = need  # below the cap, enough

    rows = bench_e2e.measure_side_by_side(
        Path("/t"), Path("/d"), ["none", "chain"], [4], 8, 100, repeats=1
    )

    assert [r["config"] for r in rows] == ["none", "chain"]


def test_py_spy_samples_each_configs_schedulers_over_the_runs_only(
    engines_without_a_gpu, monkeypatch, tmp_path
):
    events = []

    @contextlib.contextmanager
    def sampled(processes, out_dir, cpus):
        events.append(("sample", dict(processes), out_dir, cpus))
        yield {}
        events.append(("stop", len(engines_without_a_gpu.runs)))

    monkeypatch.setattr(bench_e2e.stack_sampler, "sampled", sampled)

    bench_e2e.measure_side_by_side(
        Path("/t"), Path("/d"), ["none", "chain"], [4], 8, 100, stacks_dir=tmp_path
    )

    # After both engines started and their schedulers moved to CPU 2; from the other CPUs.
    assert events[0] == (
        "sample",
        {"none": ["scheduler1"], "chain": ["scheduler2"]},
        tmp_path,
        {0, 1, 3},
    )
    assert engines_without_a_gpu.moves[0][1] == {2}
    # Stopped after the last run (2 configs x (warm-up + 3 repeats) x full and first token).
    assert events[1] == ("stop", 16)


def test_py_spy_needs_side_by_side(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--py-spy", "/tmp/s"])

    with pytest.raises(SystemExit):
        bench_e2e.main()

    assert "--py-spy samples the engines of --side-by-side" in capsys.readouterr().err


class FakeClock:
    def __init__(self, *times):
        self.times = iter(times)

    def __call__(self):
        return next(self.times)


def test_a_deadline_cuts_at_the_first_load_that_would_pass_it(capsys):
    # Loads start at 10, 40 (the first took 30 s) and 75 (the second took 35 s).
    deadline = bench_e2e.Deadline(100, clock=FakeClock(0, 10, 40, 75, 76))

    assert deadline.next_fits("bs 1")  # 10 + 0
    assert deadline.next_fits("bs 4")  # 40 + 30 = 70
    assert not deadline.next_fits("bs 16")  # 75 + 35 = 110 > 100
    assert not deadline.next_fits("bs 48")  # and nothing after it
    out = capsys.readouterr().out
    assert out == (
        "--time-limit: bs 16 and the loads after it not measured (25 s left, bs 16 "
        "would take about 35 s)\n"
    )


def test_the_first_batch_size_after_a_mixed_load_is_priced_per_token(capsys):
    # The mixed load (64000 tokens a run) starts at 10 and takes 200 s; bs 1 (128 tokens)
    # at 210 would take 0.4 s by its tokens, not 200: it fits 300; bs 4 at 240 takes as
    # long as bs 1 did (30 s): 270 fits; bs 16 at 280 + 40 does not.
    deadline = bench_e2e.Deadline(300, clock=FakeClock(0, 10, 210, 240, 280))

    assert deadline.next_fits("mixed", "mixed", 64000)
    assert deadline.next_fits("bs 1", "batch", 128)
    assert deadline.next_fits("bs 4", "batch", 512)
    assert not deadline.next_fits("bs 16", "batch", 2048)
    assert capsys.readouterr().out == (
        "--time-limit: bs 16 and the loads after it not measured (20 s left, bs 16 "
        "would take about 40 s)\n"
    )


def test_without_a_limit_every_load_fits():
    deadline = bench_e2e.Deadline(None, clock=FakeClock(0, 1e9, 2e9))

    assert deadline.next_fits("bs 1") and deadline.next_fits("bs 4")


def test_side_by_side_stops_at_the_deadline_and_keeps_the_sizes_it_measured(
    engines_without_a_gpu,
):
    # Made at 0 with 50 s; bs 1 starts at 10, bs 4 at 30 (bs 1 took 20 s): 30 + 20 = 50
    # fits; bs 16 at 55 would end past it.
    deadline = bench_e2e.Deadline(50, clock=FakeClock(0, 10, 30, 55))

    rows = bench_e2e.measure_side_by_side(
        Path("/t"),
        Path("/d"),
        ["none", "chain"],
        [1, 4, 16],
        8,
        100,
        repeats=2,
        deadline=deadline,
    )

    assert [(r["config"], r["bs"]) for r in rows] == [
        ("none", 1),
        ("chain", 1),
        ("none", 4),
        ("chain", 4),
    ]
    assert {bs for _, bs, _ in engines_without_a_gpu.runs} == {1, 4}


def test_time_limit_needs_side_by_side(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--time-limit", "500"])

    with pytest.raises(SystemExit):
        bench_e2e.main()

    assert "--time-limit cuts the loads of --side-by-side" in capsys.readouterr().err


def test_no_round_starts_its_engines_after_the_deadline_expired(
    bench_without_models, monkeypatch
):
    rounds = []

    def measure_side_by_side(*args, deadline, **kwargs):
        rounds.append(deadline)
        deadline.expired = True  # this round's last load did not fit
        row = {"config": "none", "bs": 1, "tok_per_s": 100.0, "accept_length": 1.0}
        return [row, {**row, "config": "chain"}]

    monkeypatch.setattr(bench_e2e, "measure_side_by_side", measure_side_by_side)
    argv = ["bench_e2e.py", "--configs", "none,chain", "--batch-sizes", "1"]
    argv += ["--side-by-side", "--rounds", "3", "--time-limit", "500"]
    monkeypatch.setattr(sys, "argv", [*argv, "--no-warm-up-engine"])

    bench_e2e.main()

    assert len(rounds) == 1


def test_start_together_needs_side_by_side(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--start-together"])

    with pytest.raises(SystemExit):
        bench_e2e.main()

    assert "--start-together starts the engines of --side-by-side" in (
        capsys.readouterr().err
    )


# A scheduler process as start_engines reads it (psutil.Process: hashable, a pid).
FakeProcess = collections.namedtuple("FakeProcess", "pid")


class StartedEngine(str):
    """A fake engine: its name, and its child pids (sglang's Engine.get_all_child_pids)."""

    def get_all_child_pids(self):
        return [int(self[-1]) * 10, int(self[-1]) * 10 + 1]  # scheduler, detokenizer


@pytest.fixture
def timed_starts(monkeypatch):
    """start(**kwargs) that takes 0.3 s, recording when it began and ended and the env it
    saw; each engine's scheduler a process whose pid is its engine's first child pid."""
    import threading
    import time

    log, lock = [], threading.Lock()

    def start(name, fail=False):
        began = time.perf_counter()
        time.sleep(0.3)
        with lock:
            log.append((name, began, time.perf_counter(), os.environ.get("SPEC_X")))
        if fail:
            raise RuntimeError(f"{name} failed to start")
        return StartedEngine(name)

    # Every engine's processes exist from the start (the scheduler and its detokenizer).
    procs = [FakeProcess(pid) for pid in (10, 20, 30)]
    monkeypatch.setattr(scheduler_host, "scheduler_processes", lambda: procs)
    monkeypatch.delenv("SPEC_X", raising=False)
    return types.SimpleNamespace(start=start, log=log, procs=procs)


def test_start_together_starts_each_env_group_at_once(timed_starts):
    settings = {n: {"name": f"engine{i + 1}"} for i, n in enumerate("abc")}
    envs = {"a": {}, "b": {"SPEC_X": "1"}, "c": {}}

    with contextlib.ExitStack() as threads:
        started = bench_e2e.start_engines(timed_starts.start, settings, envs, threads)

    assert list(started) == ["a", "b", "c"]  # settings' order, not the start order
    assert [e for e, _, _ in started.values()] == ["engine1", "engine2", "engine3"]
    spans = {name: (began, ended, env) for name, began, ended, env in timed_starts.log}
    # a and c (no env) together, then b alone under its env.
    assert abs(spans["engine1"][0] - spans["engine3"][0]) < 0.15
    assert spans["engine2"][0] >= max(spans["engine1"][1], spans["engine3"][1])
    assert (spans["engine1"][2], spans["engine2"][2], spans["engine3"][2]) == (
        None,
        "1",
        None,
    )
    assert "SPEC_X" not in os.environ  # restored after its group
    # Each engine's schedulers by its child pids.
    assert {n: [p.pid for p in procs] for n, (_, _, procs) in started.items()} == {
        "a": [10],
        "b": [20],
        "c": [30],
    }
    assert all(0.25 <= seconds < 1.0 for _, seconds, _ in started.values())


def test_engines_start_one_after_another_by_default(timed_starts, monkeypatch):
    settings = {n: {"name": f"engine{i + 1}"} for i, n in enumerate("ab")}
    started_so_far = []

    def start(**kwargs):
        started_so_far.append(kwargs["name"])
        return timed_starts.start(**kwargs)

    # One after another, an engine's schedulers are the processes new since the last.
    monkeypatch.setattr(
        scheduler_host,
        "scheduler_processes",
        lambda: timed_starts.procs[: len(started_so_far)],
    )

    started = bench_e2e.start_engines(start, settings, {"a": {}, "b": {}})

    (a, b) = sorted(timed_starts.log, key=lambda entry: entry[1])
    assert a[2] <= b[1]  # b began after a ended
    assert {n: [p.pid for p in procs] for n, (_, _, procs) in started.items()} == {
        "a": [10],
        "b": [20],
    }


def test_the_threads_engines_start_in_live_until_the_stack_closes(timed_starts):
    # sglang's schedulers are SIGKILLed when the thread that spawned them ends
    # (PR_SET_PDEATHSIG): the threads must not end when their group has started.
    settings = {n: {"name": f"engine{i + 1}"} for i, n in enumerate("ab")}
    spawners = []

    def start(**kwargs):
        spawners.append(threading.current_thread())
        return timed_starts.start(**kwargs)

    with contextlib.ExitStack() as threads:
        bench_e2e.start_engines(start, settings, {"a": {}, "b": {}}, threads)
        assert len(set(spawners)) == 2
        assert threading.main_thread() not in spawners
        assert all(t.is_alive() for t in spawners)
    assert not any(t.is_alive() for t in spawners)


def test_engines_started_together_stop_before_their_threads_end(
    engines_without_a_gpu, monkeypatch
):
    spawners, alive_at_stop, lock = [], [], threading.Lock()
    both_starting = threading.Barrier(2, timeout=10)  # as real starts overlap

    @contextlib.contextmanager
    def engine_group():
        def start(**kwargs):
            both_starting.wait()
            with lock:
                spawners.append(threading.current_thread())
                return StartedEngine(f"engine{len(spawners)}")

        yield start
        alive_at_stop.extend(t.is_alive() for t in spawners)

    monkeypatch.setattr(bench_e2e.eng, "engine_group", engine_group)
    monkeypatch.setattr(
        scheduler_host,
        "scheduler_processes",
        lambda: [FakeProcess(10), FakeProcess(20)],
    )

    bench_e2e.measure_side_by_side(
        Path("/t"),
        Path("/d"),
        ["none", "policy"],
        [4],
        8,
        100,
        repeats=1,
        start_together=True,
    )

    assert threading.main_thread() not in spawners and len(set(spawners)) == 2
    assert alive_at_stop == [True, True]  # the engines stopped with their threads up
    assert not any(t.is_alive() for t in spawners)


def test_a_failed_start_raises_once_every_start_of_its_group_ended(timed_starts):
    settings = {
        "a": {"name": "engine1", "fail": True},
        "b": {"name": "engine2"},
    }

    with (
        contextlib.ExitStack() as threads,
        pytest.raises(RuntimeError, match="engine1 failed to start"),
    ):
        bench_e2e.start_engines(
            timed_starts.start, settings, {"a": {}, "b": {}}, threads
        )

    # b's start was not abandoned: the engine group's exit can stop it.
    assert sorted(name for name, *_ in timed_starts.log) == ["engine1", "engine2"]


def test_mixed_runs_that_peaked_far_apart_are_named_as_different_loads():
    rows = [
        {
            "config": "policy",
            "bs": bench_e2e.MIXED,
            "tok_per_s_repeats": [5404.0, 7102.0],
            "peak_in_flight_repeats": [39, 17],
        },
        {
            "config": "chain",
            "bs": bench_e2e.MIXED,
            "tok_per_s_repeats": [6760.0, 5850.0],
            "peak_in_flight_repeats": [40, 36],
        },
        {"config": "chain", "bs": 4, "tok_per_s_repeats": [1.0]},
    ]

    lines = bench_e2e.mixed_run_lines(rows)

    assert lines[:2] == [
        "  policy: 5404 at 39 / 7102 at 17",
        "  chain: 6760 at 40 / 5850 at 36",
    ]
    assert lines[2].startswith("  runs of policy peaked 1.5x apart or more")
    assert len(bench_e2e.mixed_run_lines(rows[1:])) == 1  # the chain's runs: one load
