"""speculative/shape_runtime.py: the shape policy's config, reservations, runtime states and
the per-step switch, with a fake worker (docs/shape-policy.md)."""

from __future__ import annotations

import io
import json
import random
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from sglang.srt.speculative import shape_runtime as rt
from sglang.srt.speculative.shape_policy import GUESS_DRAWS, Shape

WIDE = Shape(16, 3, 32)
NARROW = Shape(4, 3, 8)
CHAIN = Shape(1, 3, 4)


@pytest.fixture(autouse=True)
def fresh_cache():
    rt._cached_policy.cache_clear()
    yield
    rt._cached_policy.cache_clear()


def write_config(tmp_path, **raw) -> str:
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(raw))
    return str(path)


def args(config=None, topk=16, steps=3, tokens=32, **extra):
    return SimpleNamespace(
        speculative_adaptive=config is not None,
        speculative_adaptive_config=config,
        speculative_eagle_topk=topk,
        speculative_num_steps=steps,
        speculative_num_draft_tokens=tokens,
        **extra,
    )


# ----------------------------------------------------------------------------- config


def test_a_config_without_shapes_is_upstreams_and_runs_no_policy(tmp_path):
    assert rt.read_shape_policy(None) is None
    steps_only = write_config(tmp_path, candidate_steps=[1, 3, 7])
    assert rt.read_shape_policy(steps_only) is None
    assert rt.shape_policy_of(args(steps_only)) is None


def test_a_config_with_shapes_is_read_and_checked(tmp_path):
    path = write_config(
        tmp_path, shapes=["16,3,32", "4,3,8", "1,3,4"], patience=3, force_switch_every=2
    )
    checked = []
    config = rt.read_shape_policy(path, checked.append)
    assert config.policy.shapes == (WIDE, NARROW, CHAIN)
    assert (config.policy.patience, config.force_switch_every) == (3, 2)
    assert checked == [WIDE, NARROW, CHAIN]


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"shapes": ["16,3,32", "1,3,4"], "candidate_steps": [1, 3]}, "unknown keys"),
        ({"shapes": ["16,3,32", "1,3,4"], "force_switch_every": -1}, "force_switch"),
        ({"shapes": ["16,3,32"]}, "at least two shapes"),
        ({"shapes": ["16,3,32", "16,3"]}, "is not TOPK,STEPS,DRAFT_TOKENS"),
        ({"shapes": ["16,3,32", "1,3,4"], "step_time": "wall"}, '"step_time" must be'),
        ({"shapes": ["16,3,32", "1,3,4"], "time_every": 0}, '"time_every" must be'),
        ({"shapes": ["16,3,32", "1,3,4"], "time_every": 2.5}, '"time_every" must be'),
        ({"shapes": ["16,3,32", "1,3,4"], "time_every": True}, '"time_every" must be'),
    ],
)
def test_bad_configs_are_refused_naming_the_flag(tmp_path, raw, match):
    with pytest.raises(ValueError, match="--speculative-adaptive-config") as err:
        rt.read_shape_policy(write_config(tmp_path, **raw))
    assert match in str(err.value)


def test_every_policy_knob_is_read_from_the_config(tmp_path):
    """Each PolicyConfig field is a config key (docs/shape-policy.md lists them)."""
    knobs = {
        "margin": 0.1,
        "decisive_margin": 0.5,
        "patience": 3,
        "probe_interval": 100,
        "probe_steps": 2,
        "ema_alpha": 0.5,
        "accept_horizon": 16,
    }
    config = rt.read_shape_policy(
        write_config(tmp_path, shapes=["16,3,32", "1,3,4"], **knobs)
    )
    assert {k: getattr(config.policy, k) for k in knobs} == knobs


def test_unreadable_or_broken_config_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        rt.read_shape_policy(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text("{shapes:")
    with pytest.raises(ValueError, match="not JSON"):
        rt.read_shape_policy(str(broken))


# ----------------------------------------------------------------------------- reservations


def test_reservations_cover_every_shape_of_the_set(tmp_path):
    path = write_config(tmp_path, shapes=["1,3,4", "16,3,32", "2,7,12"])
    server_args = args(path, topk=1, steps=3, tokens=4)  # the chain runs first
    # alloc_len_per_decode = max(topk * steps, draft tokens): 4, 48, 14
    assert rt.reserved_alloc_len(server_args) == 48
    assert rt.reserved_num_draft_tokens(server_args) == 32
    assert rt.carried_topk(server_args) == 16
    # The running shape's server_args do not move the reservations.
    server_args.speculative_eagle_topk = 2
    assert rt.carried_topk(server_args) == 16


def test_without_a_policy_the_flags_shape_is_reserved():
    server_args = args(None, topk=4, steps=3, tokens=8)
    assert rt.reserved_alloc_len(server_args) == 12
    assert rt.carried_topk(server_args) == 4
    no_spec = args(None, topk=None, steps=None, tokens=None)
    assert rt.carried_topk(no_spec) == 1


# ----------------------------------------------------------------------------- worker states


def fake_eagle_worker():
    """The attributes build/apply read and write on EAGLEWorkerV2, its draft worker, the
    target's model runner and server_args."""
    sa = args(None)
    dw = SimpleNamespace(
        topk=16,
        speculative_num_steps=3,
        speculative_num_draft_tokens=32,
        device="cpu",
        chain_drafts="wide chain table",
        draft_attn_backend="wide draft",
        draft_runner=SimpleNamespace(draft_attn_backend="wide draft"),
        cuda_graph_runner="wide draft graphs",
        draft_extend_attn_backend="wide extend",
        cuda_graph_runner_for_draft_extend="wide extend graphs",
    )
    runner = SimpleNamespace(attn_backend="wide verify", graph_runner="wide graphs")
    worker = SimpleNamespace(
        topk=16,
        speculative_num_steps=3,
        speculative_num_draft_tokens=32,
        server_args=sa,
        draft_worker=dw,
        target_worker=SimpleNamespace(model_runner=runner),
    )
    return worker


def test_apply_switches_between_shapes_of_equal_steps():
    from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

    worker = fake_eagle_worker()
    state = rt.ShapeRuntimeState(
        CHAIN,
        SpecRuntimeState(
            speculative_num_steps=3,
            speculative_num_draft_tokens=4,
            draft_attn_backend="chain draft",
            cuda_graph_runner="chain draft graphs",
            target_attn_backend="chain verify",
            target_graph_runner="chain graphs",
            draft_extend_attn_backend="chain extend",
            cuda_graph_runner_for_draft_extend="chain extend graphs",
        ),
        "chain table",
    )
    rt.apply_shape_runtime_state(worker, state)
    dw, runner, sa = (
        worker.draft_worker,
        worker.target_worker.model_runner,
        worker.server_args,
    )
    assert (worker.topk, worker.speculative_num_draft_tokens) == (1, 4)
    assert (dw.topk, dw.speculative_num_steps, dw.speculative_num_draft_tokens) == (
        1,
        3,
        4,
    )
    assert dw.chain_drafts == "chain table"
    assert dw.draft_attn_backend == dw.draft_runner.draft_attn_backend == "chain draft"
    assert (dw.cuda_graph_runner, dw.cuda_graph_runner_for_draft_extend) == (
        "chain draft graphs",
        "chain extend graphs",
    )
    assert dw.draft_extend_attn_backend == "chain extend"
    assert (runner.attn_backend, runner.graph_runner) == (
        "chain verify",
        "chain graphs",
    )
    assert (
        sa.speculative_eagle_topk,
        sa.speculative_num_steps,
        sa.speculative_num_draft_tokens,
    ) == (1, 3, 4)


def test_build_overrides_the_topk_and_restores_it(monkeypatch):
    from sglang.srt.speculative import chain_draft

    worker = fake_eagle_worker()
    seen = {}

    def build_adaptive_runtime_state(steps, tokens):
        dw = worker.draft_worker
        seen.update(
            steps=steps,
            tokens=tokens,
            topk=(worker.topk, dw.topk, worker.server_args.speculative_eagle_topk),
            table=dw.chain_drafts,
        )
        return "runtime"

    worker.build_adaptive_runtime_state = build_adaptive_runtime_state
    monkeypatch.setattr(
        chain_draft.ChainDraftTable,
        "for_server_args",
        classmethod(
            lambda cls, sa, device: f"table for topk {sa.speculative_eagle_topk}"
        ),
    )
    state = rt.build_shape_runtime_state(worker, NARROW)
    assert seen == dict(steps=3, tokens=8, topk=(4, 4, 4), table="table for topk 4")
    assert (state.shape, state.runtime, state.chain_drafts) == (
        NARROW,
        "runtime",
        "table for topk 4",
    )
    dw = worker.draft_worker
    assert (worker.topk, dw.topk, worker.server_args.speculative_eagle_topk) == (
        16,
    ) * 3
    assert dw.chain_drafts == "wide chain table"

    def fails(steps, tokens):
        raise RuntimeError("capture failed")

    worker.build_adaptive_runtime_state = fails
    with pytest.raises(RuntimeError, match="capture failed"):
        rt.build_shape_runtime_state(worker, CHAIN)
    assert (worker.topk, dw.topk, dw.chain_drafts) == (16, 16, "wide chain table")


# ----------------------------------------------------------------------------- the controller


class FakeWorker:
    def __init__(self):
        self.built, self.applied = [], []

    def build_shape_runtime_state(self, shape):
        self.built.append(shape)
        return rt.ShapeRuntimeState(shape, f"runtime {shape.label}", None)

    def apply_shape_runtime_state(self, state):
        self.applied.append(state.shape)


class FakeMetrics:
    def __init__(self):
        self.steps, self.switches, self.probes = {}, 0, 0

    def stepped(self, shape):
        self.steps[shape.label] = self.steps.get(shape.label, 0) + 1

    def switched(self):
        self.switches += 1

    def probed(self):
        self.probes += 1


class Clock:
    """A StepClock whose marks are the time it shows; `reached` False: the device has not
    passed the marks yet."""

    def __init__(self):
        self.now = 0.0
        self.reached = True

    def mark(self):
        return self.now

    def seconds(self, start, end):
        return end - start if self.reached else None


def run_step(controller, clock, bs, seconds):
    """Launch a decode step that takes `seconds` on the device; its result comes later."""
    shape = controller.before_decode(bs)
    clock.now += seconds
    controller.after_decode()
    return shape


def make_controller(tmp_path, initial=WIDE, **raw):
    raw.setdefault("shapes", ["16,3,32", "4,3,8", "1,3,4"])
    config = rt.read_shape_policy(write_config(tmp_path, **raw))
    worker, clock, metrics = FakeWorker(), Clock(), FakeMetrics()
    controller = rt.ShapeController(
        worker, config, initial, clock=clock, metrics=metrics
    )
    controller.register(rt.ShapeRuntimeState(initial, "built with the worker", None))
    controller.init_states()
    return controller, worker, clock, metrics


def traced_controller(tmp_path, force_switch_every):
    """A controller of the wide and narrow trees whose config traces to tmp_path/trace.jsonl,
    switching shape every force_switch_every steps."""
    trace_path = tmp_path / "trace.jsonl"
    config = rt.read_shape_policy(
        write_config(tmp_path, shapes=["16,3,32", "4,3,8"], trace=str(trace_path))
    )
    controller = rt.ShapeController(
        FakeWorker(),
        replace(config, force_switch_every=force_switch_every),
        WIDE,
        clock=(clock := Clock()),
        trace=rt.ShapeTrace.open(config.trace),
    )
    controller.register(rt.ShapeRuntimeState(WIDE, "built with the worker", None))
    controller.init_states()
    return controller, clock, trace_path


def test_init_builds_every_shape_but_the_registered_one(tmp_path):
    _, worker, _, _ = make_controller(tmp_path)
    assert worker.built == [NARROW, CHAIN]


def test_forced_switches_cycle_through_the_shapes(tmp_path):
    controller, worker, _, metrics = make_controller(tmp_path, force_switch_every=2)
    shapes = [controller.before_decode(8) for _ in range(7)]
    assert shapes == [WIDE, WIDE, NARROW, NARROW, CHAIN, CHAIN, WIDE]
    assert worker.applied == [NARROW, CHAIN, WIDE]
    assert metrics.switches == 3
    assert metrics.steps == {"16,3,32": 3, "4,3,8": 2, "1,3,4": 2}


def test_results_feed_the_shape_that_launched_them(tmp_path):
    """Overlap: the result of a step comes back after the next step launched, possibly with
    another shape."""
    controller, _, _, _ = make_controller(tmp_path, force_switch_every=1)
    policy = controller.policy
    before = dict(policy.accept_length)
    assert controller.before_decode(2) == WIDE
    assert controller.before_decode(2) == NARROW
    controller.on_verify_complete([2, 2])  # WIDE's step: 3 tokens per request
    assert policy.accept_length[NARROW] == before[NARROW]
    # Two draws against the initial guess's GUESS_DRAWS: their mean.
    a = 2 / (GUESS_DRAWS + 2)
    assert policy.accept_length[WIDE] == pytest.approx((1 - a) * before[WIDE] + a * 3)
    controller.on_verify_complete([0, 1])  # NARROW's step
    assert policy.accept_length[NARROW] == pytest.approx(
        (1 - a) * before[NARROW] + a * 1.5
    )


def test_a_result_of_another_batch_size_resets_the_queue(tmp_path):
    controller, _, _, _ = make_controller(tmp_path, force_switch_every=1)
    before = dict(controller.policy.accept_length)
    controller.before_decode(4)
    controller.before_decode(4)
    controller.on_verify_complete([1, 1, 1])  # three requests: not a launch of four
    controller.on_verify_complete([1, 1, 1, 1])  # queue was cleared: ignored
    assert controller.policy.accept_length == before


def test_each_step_is_timed_between_its_own_device_marks(tmp_path):
    """Overlap: step n + 1 launches before step n's result is read, and the host waits between
    launches. Each shape is charged its own step's device time, not the launch interval.
    """
    controller, _, clock, _ = make_controller(tmp_path, force_switch_every=2)
    costs = controller.policy.costs
    assert run_step(controller, clock, 1, 0.010) == WIDE
    clock.now += 0.050  # the host waits for an earlier result before the next launch
    assert run_step(controller, clock, 1, 0.008) == WIDE
    controller.on_verify_complete([2])
    assert costs.seconds(WIDE, 1) == pytest.approx(0.010)
    assert run_step(controller, clock, 1, 0.005) == NARROW
    controller.on_verify_complete([2])
    # The second step at a batch size confirms the cheaper of the two: its own 8 ms.
    assert costs.seconds(WIDE, 1) == pytest.approx(0.008)
    clock.now += 0.050
    assert run_step(controller, clock, 1, 0.004) == NARROW
    controller.on_verify_complete([2])  # the narrow tree's first: after a switch
    controller.on_verify_complete([2])
    assert costs.seconds(NARROW, 1) == pytest.approx(0.004)
    assert run_step(controller, clock, 1, 0.006) == CHAIN
    assert run_step(controller, clock, 1, 0.003) == CHAIN
    guess = costs.seconds(CHAIN, 1)
    controller.on_verify_complete([2])
    clock.reached = False  # a result read before the device passed the marks: not timed
    controller.on_verify_complete([2])
    clock.reached = True
    assert costs.seconds(CHAIN, 1) == guess != pytest.approx(0.003)


def test_the_first_step_after_a_switch_is_not_the_shapes_price(tmp_path):
    """A switch's first step is dearer than the shape's warm steps (several times over at
    times, under what the table leaves out as a one-off). Priced, it would keep the shape out
    at that batch size and at every size priced from it, where nothing runs it again. Its
    accept lengths count; the trace marks it."""
    controller, clock, trace_path = traced_controller(tmp_path, force_switch_every=3)
    costs = controller.policy.costs
    for seconds in (0.010, 0.010, 0.010):
        assert run_step(controller, clock, 4, seconds) == WIDE
    for seconds in (0.025, 0.006, 0.006):
        assert run_step(controller, clock, 4, seconds) == NARROW
    for _ in range(3):
        controller.on_verify_complete([3, 3, 3, 3])
    guess = costs.seconds(NARROW, 4)
    controller.on_verify_complete([3, 3, 3, 3])  # the narrow tree's first step
    assert costs.seconds(NARROW, 4) == guess < 0.025
    controller.on_verify_complete([3, 3, 3, 3])
    controller.on_verify_complete([3, 3, 3, 3])
    assert costs.seconds(NARROW, 4) == pytest.approx(0.006)
    # Every step of the narrow tree counted towards its accept length, the first one's too.
    assert controller.policy._accept_draws[NARROW] == GUESS_DRAWS + 12
    lines = [json.loads(line) for line in trace_path.read_text().splitlines()]
    results = [line for line in lines if "shape" in line]
    assert [line.get("after_switch", False) for line in results] == [
        False,
        False,
        False,
        True,
        False,
        False,
    ]
    assert results[3]["seconds"] == pytest.approx(0.025)


def test_with_step_time_period_a_step_is_charged_from_the_end_of_the_one_before(
    tmp_path,
):
    """ "step_time": "period": the device time from the end of the decode step before (same
    shape, nothing else launched between) to this step's end, so the host work between two
    steps, which the device waits out when the host is the bottleneck, is charged too; a
    step after a prefill has no such start and is charged its own span (one after a switch is
    not charged at all)."""
    controller, _, clock, _ = make_controller(
        tmp_path, force_switch_every=2, step_time="period"
    )
    assert controller.config.step_time == rt.PERIOD
    costs = controller.policy.costs
    assert run_step(controller, clock, 1, 0.010) == WIDE  # the first: its span
    controller.on_verify_complete([2])
    assert costs.seconds(WIDE, 1) == pytest.approx(0.010)
    clock.now += 0.005  # the host between the two steps; the device waits
    assert run_step(controller, clock, 1, 0.010) == WIDE
    controller.on_verify_complete([2])
    assert costs.seconds(WIDE, 1) == pytest.approx(0.015)
    clock.now += 0.030  # a switch: the step after it is not a price (nor the wait)
    assert run_step(controller, clock, 1, 0.004) == NARROW
    controller.on_verify_complete([2])
    guess = costs.seconds(NARROW, 1)
    assert guess != pytest.approx(0.004) and guess != pytest.approx(0.034)
    clock.now += 0.040  # a prefill launched between the narrow tree's two steps
    controller.after_other_forward()
    assert run_step(controller, clock, 1, 0.005) == NARROW
    controller.on_verify_complete([2])
    assert costs.seconds(NARROW, 1) == pytest.approx(0.005)


def test_with_step_time_period_a_prefills_result_processing_is_not_charged(tmp_path):
    """The overlap scheduler reads a prefill's result after launching the first decode step
    after it, so from that step's end to the next one's the device waits out the prefill's
    result processing: the second decode step after a prefill is charged its span, the
    third a period again."""
    controller, _, clock, _ = make_controller(
        tmp_path, force_switch_every=100, step_time="period"
    )
    charged = []
    controller.policy.observe_step_time = (
        lambda shape, bs, seconds, context: charged.append(round(seconds, 6))
    )
    run_step(controller, clock, 1, 0.010)
    controller.after_other_forward()  # a prefill launched
    clock.now += 0.040
    run_step(controller, clock, 1, 0.010)  # the first decode step after it
    clock.now += 0.030  # the prefill's result processed while the device waits
    run_step(controller, clock, 1, 0.010)
    clock.now += 0.005  # the first decode step's result processed
    run_step(controller, clock, 1, 0.010)
    for _ in range(4):
        controller.on_verify_complete([2])
    assert charged == [0.010, 0.010, 0.010, 0.015]


def test_by_default_a_step_is_charged_its_span(tmp_path):
    controller, _, clock, _ = make_controller(tmp_path, force_switch_every=2)
    assert controller.config.step_time == rt.SPAN
    run_step(controller, clock, 1, 0.010)
    clock.now += 0.005
    run_step(controller, clock, 1, 0.010)
    controller.on_verify_complete([2])
    controller.on_verify_complete([2])
    assert controller.policy.costs.seconds(WIDE, 1) == pytest.approx(0.010)


def test_a_step_launched_without_after_decode_is_not_timed(tmp_path):
    controller, _, clock, _ = make_controller(tmp_path, force_switch_every=1)
    controller.before_decode(1)  # e.g. the step raised before its last launch
    clock.now += 1.0
    controller.on_verify_complete([2])
    assert controller.policy.costs.seconds(WIDE, 1) == rt.StepCostTable(
        {}, 0.2
    ).seconds(WIDE, 1)


class CountingClock(Clock):
    def __init__(self):
        super().__init__()
        self.marks = 0

    def mark(self):
        self.marks += 1
        return super().mark()


def run_lagged(controller, clock, steps, seconds, host_gap=0.0):
    """`steps` decode steps of one request under the overlap scheduler (each result read
    after the next step launched), each `seconds` on the device with `host_gap` of host work
    between; returns the seconds charged, in result order."""
    charged = []
    observe = controller.policy.observe_step_time

    def record(shape, bs, seconds, context):
        charged.append(round(seconds, 6))
        observe(shape, bs, seconds, context)

    controller.policy.observe_step_time = record
    for i in range(steps):
        run_step(controller, clock, 1, seconds)
        clock.now += host_gap
        if i > 0:
            controller.on_verify_complete([2])
    controller.on_verify_complete([2])
    return charged


def test_a_confirmed_price_is_timed_one_step_in_time_every(tmp_path):
    """Timing events and table updates are a few per cent of a host-bound step: once a
    shape's price at a batch size is more than a first step's, one step in time_every is
    timed, and each timed step still places its own two marks."""
    controller, _, _, _ = make_controller(tmp_path, force_switch_every=100)
    controller._clock = clock = CountingClock()
    assert controller.config.time_every == 4
    charged = run_lagged(controller, clock, 15, 0.010)
    # Steps 1-3 launch before a second result confirms the price; then steps 7, 11 and 15.
    assert charged == [0.010] * 6
    assert clock.marks == 2 * 6


def test_time_every_1_times_every_step(tmp_path):
    controller, _, _, _ = make_controller(
        tmp_path, force_switch_every=100, time_every=1
    )
    controller._clock = clock = CountingClock()
    assert run_lagged(controller, clock, 10, 0.010) == [0.010] * 10
    assert clock.marks == 20


def test_with_step_time_period_a_sampled_step_is_charged_its_period(tmp_path):
    """The step before a timed one gets an end mark although it is not timed itself, so the
    sampled step is charged the host work before it too."""
    controller, _, _, _ = make_controller(
        tmp_path, force_switch_every=100, step_time="period"
    )
    controller._clock = clock = CountingClock()
    charged = run_lagged(controller, clock, 11, 0.010, host_gap=0.005)
    # The first has no step before it; steps 2, 3, 7 and 11 are charged from the end of the
    # one before.
    assert charged == [0.010] + [0.015] * 4
    # Two marks per timed step and one on each of steps 6 and 10, which lead a timed step.
    assert clock.marks == 2 * 5 + 2


def test_every_step_of_a_probe_is_timed(tmp_path, monkeypatch):
    """A probe runs a few steps to price a shape: each is timed, confirmed price or not."""
    controller, _, _, _ = make_controller(tmp_path, force_switch_every=100)
    controller._clock = clock = CountingClock()
    run_lagged(controller, clock, 3, 0.010)  # the price at bs 1 confirmed
    monkeypatch.setattr(
        rt.ShapePolicy, "probing", property(lambda policy: True), raising=True
    )
    assert run_lagged(controller, clock, 5, 0.010) == [0.010] * 5


def test_a_step_after_the_batch_changed_size_is_no_price_near_a_confirmed_one(tmp_path):
    """A step right after requests joined or left runs slower than the steady steps at its
    size: where the shape has a confirmed price near that size, it is not a price. A
    draining batch (48, 47, 46) keeps the steady bs-48 price; sizes far from every confirmed
    price are priced, and a first step's provisional price there (a draining batch's last
    step at bs 1) is replaced by the next step at that size, resized or not."""
    controller, _, clock, _ = make_controller(
        tmp_path, force_switch_every=100, time_every=1
    )
    charged = []
    observe = controller.policy.observe_step_time

    def record(shape, bs, seconds, context):
        charged.append((bs, round(seconds, 6)))
        observe(shape, bs, seconds, context)

    controller.policy.observe_step_time = record
    steps = [
        (48, 0.004),
        (48, 0.004),
        (47, 0.0055),  # resized, near bs 48's confirmed price
        (46, 0.0055),  # resized again
        (46, 0.004),  # steady at 46
        (8, 0.003),  # resized, nothing confirmed within a factor 2
        (3, 0.003),
        (1, 0.009),  # a draining batch's last step: bs 1's first, provisional
        (2, 0.003),
        (1, 0.0025),  # resized, but bs 1's price is only a first step's
    ]
    for bs, seconds in steps:
        run_step(controller, clock, bs, seconds)
        controller.on_verify_complete([2] * bs)
    assert charged == [steps[i] for i in (0, 1, 4, 5, 6, 7, 8, 9)]


def test_given_costs_place_no_device_marks(tmp_path):
    controller, _, clock, _ = make_controller(tmp_path, step_costs=COSTS)
    run_step(controller, clock, 1, 0.5)
    controller.on_verify_complete([2])
    assert controller.policy.costs.seconds(WIDE, 1) == 0.004


def test_the_policy_leaves_the_wide_tree_when_large_batches_make_it_slow(tmp_path):
    controller, worker, clock, metrics = make_controller(tmp_path, patience=2)
    # What each shape costs around bs 48, as measured: the wide tree's verify is 48 x 32 tokens.
    step = {WIDE: 0.020, NARROW: 0.009, CHAIN: 0.0065}
    for shape in (WIDE, NARROW, CHAIN):
        for bs in (1, 32, 64):
            controller.policy.observe_step_time(shape, bs, step[shape])
    controller.policy.accept_length.update({WIDE: 3.3, NARROW: 2.9, CHAIN: 2.4})
    chosen = []
    for _ in range(4):
        chosen.append(controller.before_decode(48))
        controller.after_decode()
    assert chosen[-1] == CHAIN
    assert worker.applied[-1] == CHAIN
    assert metrics.switches >= 1


def test_make_controller_registers_the_worker_as_built(tmp_path, monkeypatch):
    path = write_config(tmp_path, shapes=["16,3,32", "1,3,4"])
    worker = fake_eagle_worker()
    worker.server_args = args(path, enable_metrics=False, cuda_graph_max_bs=48)
    controller = rt.make_shape_controller(worker, worker.server_args)
    assert controller.active == WIDE
    state = controller._states[WIDE]
    assert state.runtime.target_attn_backend == "wide verify"
    assert state.runtime.cuda_graph_runner_for_draft_extend == "wide extend graphs"
    assert state.chain_drafts == "wide chain table"
    assert rt.make_shape_controller(worker, args(None)) is None


def test_an_idle_shape_is_probed_and_counted(tmp_path):
    controller, worker, clock, metrics = make_controller(
        tmp_path, probe_interval=4, probe_steps=2
    )
    # Every shape's step takes 5 ms at bs 1 and the three expect the same acceptance: equal
    # scores, no switch, and the idle shapes' stale scores stay within the margin.
    step = 0.005
    for shape in (WIDE, NARROW, CHAIN):
        controller.policy.observe_step_time(shape, 1, step)
    assert len(set(controller.policy.accept_length.values())) == 1
    shapes = []
    for _ in range(12):
        shapes.append(controller.before_decode(1))
        clock.now += step
        controller.after_decode()
    assert metrics.probes >= 1
    assert NARROW in shapes or CHAIN in shapes
    assert metrics.switches == sum(1 for a, b in zip([WIDE] + shapes, shapes) if a != b)


def test_shape_metrics_export_with_sglang_names(monkeypatch):
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    for name in ("Counter",):
        cls = getattr(prometheus_client, name)
        monkeypatch.setattr(
            prometheus_client,
            name,
            lambda *a, _cls=cls, **k: _cls(*a, registry=registry, **k),
        )
    metrics = rt.ShapeMetrics({"model_name": "m", "tp_rank": "0"})
    metrics.stepped(WIDE)
    metrics.stepped(WIDE)
    metrics.stepped(CHAIN)
    metrics.switched()
    metrics.probed()
    text = prometheus_client.generate_latest(registry).decode()
    assert (
        'sglang:spec_shape_steps_total{model_name="m",shape="16,3,32",tp_rank="0"} 2.0'
        in text
    )
    assert 'sglang:spec_shape_switches_total{model_name="m",tp_rank="0"} 1.0' in text
    assert 'sglang:spec_shape_probes_total{model_name="m",tp_rank="0"} 1.0' in text


# ----------------------------------------------------------------------------- given step costs

COSTS = {
    "16,3,32": {"1": 0.004, "48": 0.020},
    "4,3,8": {"1": 0.0036, "48": 0.009},
    "1,3,4": {"1": 0.0034, "48": 0.0065},
}


def test_step_costs_are_read_for_every_shape(tmp_path):
    config = rt.read_shape_policy(
        write_config(tmp_path, shapes=["16,3,32", "4,3,8", "1,3,4"], step_costs=COSTS)
    )
    assert config.step_costs[WIDE] == {1: 0.004, 48: 0.020}
    assert config.deterministic
    plain = rt.read_shape_policy(write_config(tmp_path, shapes=["16,3,32", "1,3,4"]))
    assert plain.step_costs is None and not plain.deterministic


@pytest.mark.parametrize(
    "costs,match",
    [
        ({"16,3,32": {"1": 0.004}}, r"lacks \['1,3,4'\]"),
        ({**COSTS, "8,3,16": {"1": 0.1}}, 'names 8,3,16, which is not in "shapes"'),
        ({**COSTS, "1,3,4": {"0": 0.1}}, "batch size 0 must be >= 1"),
        ({**COSTS, "1,3,4": {"4": -1}}, "seconds > 0"),
        ({**COSTS, "1,3,4": {"four": 0.1}}, "is not batch size: seconds"),
        ({**COSTS, "1,3,4": {}}, "must map batch sizes to seconds"),
        ([0.1], "must map shapes to"),
    ],
)
def test_bad_step_costs_are_refused(tmp_path, costs, match):
    shapes = ["16,3,32", "1,3,4"]
    if isinstance(costs, dict):
        costs = {k: v for k, v in costs.items() if k != "4,3,8"}
    with pytest.raises(ValueError, match='"step_costs"') as err:
        rt.read_shape_policy(write_config(tmp_path, shapes=shapes, step_costs=costs))
    assert re.search(match, str(err.value)), str(err.value)


def test_given_costs_decide_alike_on_every_rank(tmp_path):
    """Two controllers (two tensor-parallel ranks) whose steps take different wall times
    choose the same shapes from the same accept lengths."""
    picks = []
    for seconds_per_step in (0.001, 0.050):
        controller, _, clock, _ = make_controller(
            tmp_path, patience=2, step_costs=COSTS
        )
        chosen = []
        for bs in [1] * 5 + [48] * 6 + [1] * 6:
            chosen.append(controller.before_decode(bs))
            controller.on_verify_complete([2] * bs)
            clock.now += seconds_per_step
        picks.append(chosen)
        assert controller.policy.costs.seconds(WIDE, 48) == 0.020  # not refined
    assert picks[0] == picks[1]
    assert CHAIN in picks[0] and picks[0][0] == WIDE


# ----------------------------------------------------------------------------- a simulated load

# What a step of each shape costs at each batch size and commits per request, shaped like the
# 1.21B preset's measurements (docs/benchmarks.md): the wide tree's verify grows with bs * 32.
TRUE_COSTS = {
    WIDE: {1: 4.0e-3, 16: 8.0e-3, 48: 20.0e-3, 64: 26.0e-3},
    NARROW: {1: 3.6e-3, 16: 5.0e-3, 48: 9.0e-3, 64: 11.0e-3},
    CHAIN: {1: 3.4e-3, 16: 3.9e-3, 48: 6.5e-3, 64: 7.5e-3},
}
TRUE_ACCEPT = {WIDE: 3.3, NARROW: 2.9, CHAIN: 2.4}
RAMP = [1, 2, 4, 8, 16, 32, 48, 64, 48, 32, 16, 8, 4, 2, 1]


def true_seconds(shape, bs):
    from sglang.srt.speculative.shape_policy import StepCostTable

    return StepCostTable({shape: TRUE_COSTS[shape]}, 0.2).seconds(shape, bs)


def correct_drafts(shape, bs, step):
    """Accepted drafts per request whose mean over steps is TRUE_ACCEPT - 1."""
    whole, frac = divmod(TRUE_ACCEPT[shape] - 1, 1)
    return [
        int(whole) + (((step * 64 + j) * 37) % 100 < round(frac * 100))
        for j in range(bs)
    ]


def run_trace(choose, tokens_per_request=600):
    """tokens and seconds per batch size of a load that ramps 1 -> 64 -> 1: at each batch
    size, bs requests of tokens_per_request tokens (the same work for every config)."""
    by_bs = {}
    for bs in RAMP:
        tokens, seconds = by_bs.get(bs, (0.0, 0.0))
        done = 0.0
        while done < bs * tokens_per_request:
            shape = choose(bs)
            done += bs * TRUE_ACCEPT[shape]
            seconds += true_seconds(shape, bs)
        by_bs[bs] = (tokens + done, seconds)
    return by_bs


def random_drafts(seed):
    """Accepted drafts per request drawn as Binomial(3, p) with mean TRUE_ACCEPT - 1: one
    request's accept length is a draw of 1 .. 4, as a real step's is."""
    rng = random.Random(seed)

    def drafts(shape, bs, step):
        p = (TRUE_ACCEPT[shape] - 1) / 3
        return [sum(rng.random() < p for _ in range(3)) for _ in range(bs)]

    return drafts


@pytest.mark.parametrize("seed", [None, *range(10)])
def test_the_policy_tracks_the_best_shape_over_a_ramping_load(tmp_path, seed):
    """From the prior alone, measuring as it goes: within 5 % of the best fixed shape at each
    batch size, and more tokens per second over the whole load than any fixed shape; with
    accept lengths at their means every step (seed None) or drawn per request."""
    controller, _, clock, _ = make_controller(tmp_path)
    pending, steps = [], []
    drafts = correct_drafts if seed is None else random_drafts(seed)

    def choose(bs):
        shape = controller.before_decode(bs)
        clock.now += true_seconds(shape, bs)
        controller.after_decode()
        # The overlap scheduler reads a step's result after launching the next one.
        if pending:
            controller.on_verify_complete(pending.pop())
        pending.append(drafts(shape, bs, len(steps)))
        steps.append(shape)
        return shape

    policy = run_trace(choose)
    fixed = {s: run_trace(lambda bs, s=s: s) for s in (WIDE, NARROW, CHAIN)}

    def rate(by_bs, bs=None):
        rows = [v for b, v in by_bs.items() if bs is None or b == bs]
        return sum(t for t, _ in rows) / sum(s for _, s in rows)

    for bs in set(RAMP):
        best = max(rate(f, bs) for f in fixed.values())
        assert rate(policy, bs) >= 0.95 * best, (bs, rate(policy, bs), best)
    assert rate(policy) > max(rate(f) for f in fixed.values())


def test_worker_subclasses_with_their_own_init_have_the_policy_attributes():
    """STANDALONE's spec v2 workers copy their parents' __init__ instead of calling it, and
    inherit draft() and forward_batch_generation(), which read these attributes."""
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2
    from sglang.srt.speculative.standalone_worker_v2 import (
        StandaloneDraftWorker,
        StandaloneWorkerV2,
    )

    assert issubclass(StandaloneDraftWorker, EagleDraftWorker)
    assert issubclass(StandaloneWorkerV2, EAGLEWorkerV2)
    worker = object.__new__(StandaloneWorkerV2)
    assert worker.shape_controller is None
    draft = object.__new__(StandaloneDraftWorker)
    draft.server_args = args(None, topk=4, steps=3, tokens=8)
    assert draft.carried_topk == 4


# Step seconds measured on the 7.24B target (bench_e2e --write-policy-config, H100, triton;
# docs/benchmarks.md): several times the prior's units, and nearly flat up to bs 16.
COSTS_7B = {
    WIDE: {1: 8.8e-3, 4: 10.1e-3, 16: 18.6e-3, 64: 66.2e-3},
    NARROW: {1: 8.5e-3, 4: 9.3e-3, 16: 12.5e-3, 64: 24.8e-3},
    CHAIN: {1: 8.3e-3, 4: 9.2e-3, 16: 11.5e-3, 64: 19.3e-3},
}
ACCEPT_7B = {WIDE: 3.27, NARROW: 2.9, CHAIN: 2.57}


def overlapped_policy(tmp_path, step_seconds):
    """choose(bs) of a policy over COSTS_7B's shapes that runs each step for
    step_seconds(shape, bs) on its clock and learns ACCEPT_7B's accept lengths one step late,
    as under the overlap scheduler."""
    controller, _, clock, _ = make_controller(tmp_path)
    pending = []

    def choose(bs):
        shape = controller.before_decode(bs)
        clock.now += step_seconds(shape, bs)
        controller.after_decode()
        if pending:
            controller.on_verify_complete(pending.pop())
        whole, frac = divmod(ACCEPT_7B[shape] - 1, 1)
        pending.append([int(whole) + (j % 100 < frac * 100) for j in range(bs)])
        return shape

    return choose


def test_the_policy_keeps_up_with_a_batch_that_changes_every_step(tmp_path):
    """Requests arriving and finishing move the batch size at every step, so most steps meet a
    (shape, batch size) not measured yet. Guesses are priced in the units of what was measured
    (StepCostTable), so the policy does not chase shapes that only look cheap for not having
    run: within 5 % of the best fixed shape over the load."""
    from sglang.srt.speculative.shape_policy import StepCostTable

    def seconds(shape, bs):
        return StepCostTable({shape: COSTS_7B[shape]}, 0.2).seconds(shape, bs)

    trace = [*range(1, 65), *range(64, 0, -1)] * 2
    policy_choice = overlapped_policy(tmp_path, seconds)

    def rate(choose):
        shapes = [(choose(bs), bs) for bs in trace]
        tokens = sum(bs * ACCEPT_7B[s] for s, bs in shapes)
        return tokens / sum(seconds(s, bs) for s, bs in shapes)

    best_fixed = max(rate(lambda bs, s=s: s) for s in COSTS_7B)
    assert rate(policy_choice) >= 0.95 * best_fixed


# sglang's default CUDA-graph sizes up to 64: a batch runs the graph of the next size up.
GRAPH_SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]


def test_one_off_first_steps_of_a_growing_batch_do_not_keep_a_shape_out(tmp_path):
    """A mixed load on a fresh server: the first step of each (shape, graph size) compiles
    kernels and replays its graph for the first time, 0.1-0.7 s. The wide tree runs first, as
    the batch grows from 21 to 64, and at large batch loses to the chain; when the batch is back
    at 1 it is the best shape again (COSTS_7B), and the policy must find that out although its
    only small-batch point is a one-off it never re-measures there."""
    from sglang.srt.speculative.shape_policy import StepCostTable

    def seconds(shape, bs):
        return StepCostTable({shape: COSTS_7B[shape]}, 0.2).seconds(shape, bs)

    first_seen = set()

    def measured(shape, bs):
        graph = next(g for g in GRAPH_SIZES if g >= bs)
        one_off = 0.0 if (shape, graph) in first_seen else 0.1 + 0.6 * (graph == 24)
        first_seen.add((shape, graph))
        return seconds(shape, bs) + one_off

    policy_choice = overlapped_policy(tmp_path, measured)

    for bs in [*range(21, 65), *([64] * 40), *range(64, 0, -1)]:
        policy_choice(bs)
    settled = [policy_choice(1) for _ in range(200)][50:]
    assert settled.count(WIDE) >= 0.9 * len(settled), settled[-10:]


def test_the_trace_says_what_each_result_taught_the_policy(tmp_path):
    """The config's "trace" file: a line per result (shape, bs, device seconds, accept length,
    every shape's score after) and per switch."""
    controller, clock, trace_path = traced_controller(tmp_path, force_switch_every=1)
    assert controller.config.trace == str(trace_path)
    run_step(controller, clock, 2, 8e-3)
    run_step(controller, clock, 2, 6e-3)  # a forced switch to the narrow tree
    controller.on_verify_complete([2, 1])
    lines = [json.loads(line) for line in trace_path.read_text().splitlines()]
    assert lines[0] == {"step": 2, "switch": ["16,3,32", "4,3,8"], "bs": 2}
    result = lines[1]
    # The wide tree's step was the first launched; its result is read after the second.
    assert result["step"] == 1
    assert (result["shape"], result["bs"], result["accept"]) == ("16,3,32", 2, 2.5)
    assert result["seconds"] == pytest.approx(8e-3)
    assert result["scores"]["16,3,32"] == pytest.approx(
        controller.policy.score(WIDE, 2), abs=0.01
    )
    assert set(result["scores"]) == {"16,3,32", "4,3,8"}
    # When the host read the result: intervals between results are the loop's period.
    assert isinstance(result["t"], float) and "t" not in lines[0]


def test_result_lines_carry_the_host_clock_switch_lines_do_not():
    stream = io.StringIO()
    trace = rt.ShapeTrace(stream, wall_clock=iter([12.5, 12.5042]).__next__)
    launch = rt._Launch(WIDE, 4, step=3)

    trace.result(launch, 3e-3, 2.5, {"16,3,32": 1.0})
    trace.switch(4, WIDE, NARROW, 4)
    trace.result(rt._Launch(NARROW, 4, step=4), None, 2.0, {"4,3,8": 1.0})

    first, switch, second = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert (first["t"], second["t"]) == (12.5, 12.5042)
    assert "t" not in switch


def test_a_trace_in_a_missing_directory_is_refused_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="its directory does not exist"):
        rt.read_shape_policy(
            write_config(
                tmp_path,
                shapes=["16,3,32", "4,3,8"],
                trace=str(tmp_path / "no-such-dir" / "trace.jsonl"),
            )
        )


def test_a_trace_must_be_a_path(tmp_path):
    with pytest.raises(ValueError, match='"trace" must be a file path'):
        rt.read_shape_policy(
            write_config(tmp_path, shapes=["16,3,32", "4,3,8"], trace=3)
        )


def test_a_steps_context_reaches_its_price_and_the_trace(tmp_path):
    """The worker hands before_decode the batch's KV tokens (seq_lens_sum): the step's price
    is taken at its requests' mean context, and its trace line says which."""
    controller, clock, trace_path = traced_controller(tmp_path, force_switch_every=100)
    for kv_tokens in (400, 440, 480):
        controller.before_decode(4, seq_lens_sum=kv_tokens)
        clock.now += 5e-3
        controller.after_decode()
        controller.on_verify_complete([2, 1, 2, 1])
    results = [json.loads(line) for line in trace_path.read_text().splitlines()]
    assert [r["context"] for r in results] == [100.0, 110.0, 120.0]
    # The second step confirmed the price; the third was not timed ("time_every").
    assert [r["seconds"] is not None for r in results] == [True, True, False]
    assert controller.policy.costs.context_at(WIDE, 4) == 110.0
    controller.before_decode(4)  # a worker that gives no lengths: no context
    clock.now += 5e-3
    controller.after_decode()
    controller.on_verify_complete([2, 1, 2, 1])
    last = json.loads(trace_path.read_text().splitlines()[-1])
    assert last["step"] == 4 and "context" not in last
