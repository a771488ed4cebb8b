"""specpatch.testing.engine's helpers on fakes: what best_of times and returns, the DP-attention port
block, and clean-up after a failed engine start."""

from __future__ import annotations

import os
import random
import socket
import time

import pytest

from specpatch.testing import engine as eng


class _FakeEngine:
    """Answers generate() like sglang's Engine; records each call's max_new_tokens."""

    def __init__(self):
        self.calls: list[int] = []

    def generate(self, input_ids, sampling_params):
        n = sampling_params["max_new_tokens"]
        self.calls.append(n)
        return [
            {
                "output_ids": [0] * n,
                "meta_info": {"completion_tokens": n, "spec_verify_ct": 1},
            }
            for _ in input_ids
        ]


def test_best_of_warms_up_at_full_length_then_times_each_repeat(monkeypatch):
    fake = _FakeEngine()
    clock = iter(
        [0.0, 0.5, 10.0, 13.0, 20.0, 21.0, 30.0, 32.0]
    )  # warm-up 0.5 s, then 3 s, 1 s, 2 s
    monkeypatch.setattr(eng.time, "perf_counter", lambda: next(clock))

    best = eng.best_of(fake, [[1, 2], [3]], max_new_tokens=64, repeats=3)

    assert fake.calls == [
        64,
        64,
        64,
        64,
    ]  # one untimed full-length run, then the repeats
    assert best.seconds == 1.0  # the fastest repeat, not the warm-up
    assert best.completion_tokens == 128


class _Draws:
    """randrange() answers from a fixed list: the ports free_dp_port tries, in order."""

    def __init__(self, ports):
        self.ports = iter(ports)

    def randrange(self, start, stop):
        return next(self.ports)


def test_free_dp_port_skips_a_port_whose_tcp_block_is_taken():
    from sglang.srt.server_args import ZMQ_TCP_PORT_DELTA

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = (
            taken.getsockname()[1] - ZMQ_TCP_PORT_DELTA - 3
        )  # `taken` sits inside busy's block
        other = next(
            (
                p
                for p in range(21000, 39000, 97)
                if p != busy and eng.dp_port_is_free(p)
            ),
            None,
        )
        if other is None:
            pytest.skip("this host has no free port block to test with")

        assert not eng.dp_port_is_free(busy)
        assert eng.free_dp_port(_Draws([busy, other])) == other


def test_free_dp_port_gives_up_with_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]

        with pytest.raises(RuntimeError, match="no free DP-attention port block"):
            eng.free_dp_port(_Draws([busy] * 3), attempts=3)


def test_a_failed_engine_start_kills_its_child_processes(monkeypatch):
    import sglang
    import sglang.srt.entrypoints.engine  # noqa: F401  (imported first, they bind the real
    import sglang.srt.managers.tokenizer_manager  # noqa: F401  kill_process_tree, not the fake)
    import sglang.srt.utils

    killed = []

    def failing_engine(**kwargs):
        raise RuntimeError("Rank 0 scheduler died during initialization")

    monkeypatch.setattr(sglang, "Engine", failing_engine)
    monkeypatch.setattr(
        sglang.srt.utils,
        "kill_process_tree",
        lambda pid, include_parent=True: killed.append((pid, include_parent)),
    )

    with pytest.raises(RuntimeError, match="scheduler died"):
        with eng.engine(model_path="unused"):
            pass

    assert killed == [(os.getpid(), False)]  # the children, not the test process


def test_dp_attention_engines_get_a_port_of_their_own(monkeypatch):
    import sglang

    seen = {}

    class _Recorder:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def shutdown(self):
            seen["shut_down"] = True

    monkeypatch.setattr(sglang, "Engine", _Recorder)
    monkeypatch.setattr(eng, "free_dp_port", lambda: 31234)

    with eng.engine(model_path="unused", enable_dp_attention=True):
        pass
    assert seen["port"] == 31234 and seen["shut_down"]

    seen.clear()
    with eng.engine(model_path="unused"):
        pass
    assert (
        "port" not in seen
    )  # without DP attention sglang uses IPC, and its default port


def _child_then_sigquit(wait, returncodes: list):
    """Start a `sleep` child, then `wait(send)`, where send() SIGQUITs this process as sglang's
    failing children do; the child's return code goes to `returncodes`."""
    import signal
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    try:
        wait(lambda: os.kill(os.getpid(), signal.SIGQUIT))
    finally:
        try:
            returncodes.append(child.wait(timeout=5))
        except subprocess.TimeoutExpired:  # not killed
            returncodes.append(None)
            child.kill()
            child.wait()


def test_a_failing_child_fails_the_test_instead_of_killing_pytest(capfd):
    """sglang's SIGQUIT handlers kill_process_tree(os.getpid()): SIGKILL of the Engine's own
    process, i.e. pytest ("Killed", no traceback, the children's log lost in the capture).
    Inside engine() they kill the children and raise, in the launch phase (a signal.signal
    handler) and the running phase (an asyncio signal callback, which swallows Exceptions).
    """
    import asyncio
    import signal
    import time

    import sglang.srt.entrypoints.engine as engine_mod
    import sglang.srt.managers.tokenizer_manager as tm_mod

    originals = engine_mod.kill_process_tree, tm_mod.kill_process_tree
    previous = signal.getsignal(signal.SIGQUIT)
    os.write(2, b"Scheduler hit an exception: AttributeError: no chain_drafts\n")
    returncodes: list = []
    loop = asyncio.new_event_loop()
    try:
        with eng.child_failure_raises():
            # Launch phase: Engine.__init__ waits on its scheduler's pipe.
            signal.signal(
                signal.SIGQUIT, lambda *_: engine_mod.kill_process_tree(os.getpid())
            )
            with pytest.raises(eng.EngineChildFailed, match="no chain_drafts"):
                _child_then_sigquit(lambda send: (send(), time.sleep(5)), returncodes)

            # Running phase: Engine.generate runs the event loop.
            loop.add_signal_handler(
                signal.SIGQUIT, lambda: tm_mod.kill_process_tree(os.getpid())
            )

            def serve(send):
                loop.call_later(0.05, send)
                loop.run_until_complete(asyncio.sleep(5))

            with pytest.raises(eng.EngineChildFailed, match="no chain_drafts"):
                _child_then_sigquit(serve, returncodes)
    finally:
        loop.remove_signal_handler(signal.SIGQUIT)
        loop.close()
        signal.signal(signal.SIGQUIT, previous)
    assert (
        returncodes == [-signal.SIGKILL] * 2
    )  # the children were killed, this process lives
    assert (
        engine_mod.kill_process_tree,
        tm_mod.kill_process_tree,
    ) == originals  # put back
    capfd.readouterr()


def test_leak_check_ignores_test_names_and_catches_sglang_reports():
    traceback = (
        '  File "test_tree_v2_paged_gpu.py", line 119, in '
        "test_paged_retraction_keeps_identity_and_leaks_nothing\n"
    )
    eng.assert_no_leak_reported(traceback)
    report = (
        "token_to_kv_pool_allocator memory leak detected! total=4096, available=4000"
    )
    with pytest.raises(AssertionError, match="memory leak detected"):
        eng.assert_no_leak_reported(traceback + report)
    with pytest.raises(AssertionError):
        eng.assert_no_leak_reported("req_to_token_pool Memory Leak Detected!")


def test_server_port_leaves_room_for_the_derived_grpc_port():
    for seed in range(20):
        port = eng.free_server_port(random.Random(seed))
        assert 20000 <= port < eng.ephemeral_port_floor() - 1000
        # ServerArgs derives port + 10000 and refuses anything past 65535.
        assert port + 10000 <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # it was free when chosen, and nothing holds it


def test_chosen_ports_stay_below_the_ephemeral_range(monkeypatch):
    """An outgoing connection can take an ephemeral port between the choice and the server's
    bind (which waits for the model to load); below the range nothing takes it."""
    monkeypatch.setattr(eng, "ephemeral_port_floor", lambda: 30000)
    start, stop = eng.chosen_port_range()
    assert start == 20000 and stop == 30000 - 1100
    ports = {eng.free_server_port(random.Random(seed)) for seed in range(50)}
    assert max(ports) < stop


def test_ramp_generate_spreads_arrivals_and_times_the_whole_load(monkeypatch):
    import asyncio

    arrivals = []

    class FakeEngine:
        # sglang's Engine: its tokenizer manager runs on the engine's own loop
        loop = asyncio.new_event_loop()

        async def async_generate(self, input_ids, sampling_params):
            assert asyncio.get_running_loop() is self.loop
            arrivals.append((input_ids[0], asyncio.get_event_loop().time()))
            await asyncio.sleep(0.01)
            n = sampling_params["max_new_tokens"]
            return {
                "output_ids": [input_ids[0]] * n,
                "meta_info": {"completion_tokens": n, "spec_verify_ct": n // 2},
            }

    # The thread's current loop is another engine's (the last one started).
    asyncio.set_event_loop(asyncio.new_event_loop())
    prompts = [[i] for i in range(5)]
    run = eng.ramp_generate(FakeEngine(), prompts, 8, ramp_seconds=0.2)
    assert run.output_ids == [[i] * 8 for i in range(5)]  # in request order
    assert (run.completion_tokens, run.verify_count) == (40, 20)
    times = [t for _, t in sorted(arrivals)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(0.03 <= g <= 0.08 for g in gaps), gaps  # 0.2 s / 5 requests
    assert run.seconds >= 0.8 * 0.2


def test_arrivals_generate_gives_each_request_its_own_delay_and_length():
    import asyncio

    asked = {}

    class FakeEngine:
        loop = asyncio.new_event_loop()

        async def async_generate(self, input_ids, sampling_params):
            assert asyncio.get_running_loop() is self.loop
            asked[input_ids[0]] = asyncio.get_event_loop().time()
            await asyncio.sleep(0.02)
            n = sampling_params["max_new_tokens"]
            return {"output_ids": [7] * n, "meta_info": {"completion_tokens": n}}

    asyncio.set_event_loop(asyncio.new_event_loop())
    run = eng.arrivals_generate(
        FakeEngine(), [[0], [1], [2]], [5, 1, 2], [0.0, 0.0, 0.1]
    )
    assert run.output_ids == [[7] * 5, [7], [7] * 2]
    assert run.completion_tokens == 8
    assert asked[2] - asked[0] >= 0.08 and asked[1] - asked[0] < 0.05
    # Requests 0 and 1 in flight together; request 2 sent after both finished.
    assert run.peak_in_flight == 2
    with pytest.raises(ValueError):  # a delay or a length missing is refused
        eng.arrivals_generate(FakeEngine(), [[0], [1]], [5], [0.0, 0.0])


def test_identity_by_batch_size_runs_each_size_and_names_the_diverging_one():
    e = _FakeEngine()
    prompts = [[1], [2], [3], [4]]
    accept = eng.identical_by_batch_size(e, prompts, [[0] * 5] * 4, (1, 4), "triton")
    assert e.calls == [5, 5]
    assert accept == {1: 5.0, 4: 5.0}
    diverging = [[0] * 5, [0] * 5, [0, 0, 7, 0, 0], [0] * 5]
    with pytest.raises(AssertionError, match="triton bs 4"):
        eng.identical_by_batch_size(e, prompts, diverging, (1, 4), "triton")


@pytest.mark.parametrize(
    "spans, peak",
    [
        ([], 0),
        ([(0.0, 1.0)], 1),
        ([(0.0, 1.0), (0.5, 2.0), (0.7, 0.8)], 3),
        # One request finishing as the next is sent: never both in flight.
        ([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)], 1),
        ([(0.0, 3.0), (1.0, 2.0), (2.0, 2.5)], 2),
    ],
)
def test_peak_in_flight_counts_the_most_open_spans(spans, peak):
    assert eng.peak_in_flight(spans) == peak


def test_sigquit_kills_children_through_the_patched_kill_and_restores_the_handler():
    """An engine started in a thread installs no SIGQUIT handler; sigquit_kills_children
    stands in for the one it would have: a child's SIGQUIT raises EngineChildFailed here
    (under child_failure_raises) instead of ending the process."""
    import signal

    before = signal.getsignal(signal.SIGQUIT)
    with eng.child_failure_raises(), eng.sigquit_kills_children():
        with pytest.raises(eng.EngineChildFailed):
            os.kill(os.getpid(), signal.SIGQUIT)
            time.sleep(1.0)  # the handler runs at the next bytecode; never reached
    assert signal.getsignal(signal.SIGQUIT) is before


def test_concurrency_generate_keeps_each_request_under_its_level():
    """Request i goes out once fewer than levels[i] are in flight: the batch is held at each
    phase's level and drains to the next one's, whatever the engine's speed."""
    import asyncio

    in_flight, most_seen, order = [0], [], []

    class FakeEngine:
        loop = asyncio.new_event_loop()

        async def async_generate(self, input_ids, sampling_params):
            in_flight[0] += 1
            most_seen.append((input_ids[0], in_flight[0]))
            order.append(input_ids[0])
            await asyncio.sleep(0.01 * (1 + input_ids[0] % 3))
            in_flight[0] -= 1
            n = sampling_params["max_new_tokens"]
            return {
                "output_ids": [input_ids[0]] * n,
                "meta_info": {"completion_tokens": n},
            }

    asyncio.set_event_loop(asyncio.new_event_loop())
    levels = [1, 1, 4, 4, 4, 4, 4, 4, 2, 2, 1]
    prompts = [[i] for i in range(len(levels))]
    run = eng.concurrency_generate(FakeEngine(), prompts, [3] * len(levels), levels)

    assert order == list(range(len(levels)))  # sent in order
    assert run.output_ids == [[i] * 3 for i in range(len(levels))]
    assert run.completion_tokens == 3 * len(levels)
    # Each request, once sent, had at most its level in flight (itself included).
    assert all(count <= levels[i] for i, count in most_seen)
    assert max(count for _, count in most_seen) == 4 and run.peak_in_flight == 4
    with pytest.raises(ValueError):  # a level missing is refused
        eng.concurrency_generate(FakeEngine(), prompts, [3] * len(levels), levels[:-1])
