"""Deferred drains (SGLANG_KV_CANARY_DEFERRED_DRAIN=1): findings are read back behind the
forward and reported, in bracket order, by the first bracket that finds them landed; raise mode
raises there. The device copy is replaced by a gate the test opens."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from canary_sim import SimEngine, draft_step_batch

from sglang.srt.kv_canary.config import CanaryMode, parse_canary_config
from sglang.srt.kv_canary.manager import flush_deferred_findings
from sglang.srt.kv_canary.report import KVCanaryViolationError
from sglang.srt.kv_canary.staging import SinkDrainer


class Gate:
    """Stands in for the CUDA event recorded after the device-to-host copies."""

    def __init__(self):
        self.open = False

    def query(self) -> bool:
        return self.open

    def synchronize(self) -> None:
        self.open = True


@pytest.fixture
def deferred(monkeypatch):
    engine = SimEngine(num_steps=4, seed=3)
    engine.admit(10)
    engine.admit(7)
    manager = engine.draft
    manager.config = replace(manager.config, mode=CanaryMode.RAISE, deferred_drain=True)
    gates: list[Gate] = []
    real_drain = SinkDrainer.drain

    def gated_drain(self, staged, indices, deferred_drain):
        assert deferred_drain, "the manager did not ask for a deferred drain"
        pending = real_drain(self, staged, indices, deferred_drain)
        pending.copied = Gate()
        gates.append(pending.copied)
        return pending

    monkeypatch.setattr(SinkDrainer, "drain", gated_drain)
    reported: list[str] = []
    bad_labels: set[str] = set()

    def report(drained, label):
        reported.append(label)
        return (
            [SimpleNamespace(describe=lambda: f"violation in {label}")]
            if label in bad_labels
            else []
        )

    monkeypatch.setattr(manager.reporter, "report", report)
    batch = draft_step_batch(engine, 0)
    return SimpleNamespace(
        manager=manager, gates=gates, reported=reported, bad=bad_labels, batch=batch
    )


def bracket(d, indices):
    with d.manager.with_ops_outside_graph(indices, d.batch):
        pass


def test_findings_wait_for_their_copy_and_keep_bracket_order(deferred):
    d = deferred
    bracket(d, [0, 1])
    assert (
        d.reported == [] and len(d.gates) == 1
    )  # one copy for the bracket's two forwards
    bracket(d, [2])
    d.gates[1].open = (
        True  # the later one landed first: nothing may overtake the earlier one
    )
    bracket(d, [0])
    assert d.reported == []
    d.gates[0].open = True
    bracket(d, [1])
    assert d.reported == ["draft step 0", "draft step 1", "draft step 2"]
    d.manager.flush()
    assert d.reported == [
        "draft step 0",
        "draft step 1",
        "draft step 2",
        "draft step 0",
        "draft step 1",
    ]


def test_raise_mode_raises_at_the_bracket_that_reads_the_findings(deferred):
    d = deferred
    d.bad.add("draft step 1")
    bracket(d, [1])  # the violating forward: its findings are still on the device
    d.gates[0].open = True
    with pytest.raises(KVCanaryViolationError, match="violation in draft step 1"):
        bracket(d, [0])
    assert not d.manager.single_forwards[
        0
    ].is_staged  # the raising bracket staged nothing


def test_too_many_pending_drains_are_waited_for(deferred):
    from sglang.srt.kv_canary.manager import MAX_PENDING_DRAINS

    d = deferred
    for _ in range(MAX_PENDING_DRAINS):
        bracket(d, [0])
    assert d.reported == []
    bracket(d, [0])  # one past the bound: everything pending is read back
    assert len(d.reported) == MAX_PENDING_DRAINS + 1


@pytest.mark.parametrize(
    "raw,expected", [("1", True), ("true", True), ("0", False), ("", False)]
)
def test_env_switch(raw, expected):
    assert (
        parse_canary_config(
            env={"SGLANG_KV_CANARY": "log", "SGLANG_KV_CANARY_DEFERRED_DRAIN": raw}
        ).deferred_drain
        is expected
    )


def test_bad_env_switch_names_the_variable():
    with pytest.raises(ValueError, match="SGLANG_KV_CANARY_DEFERRED_DRAIN='maybe'"):
        parse_canary_config(
            env={"SGLANG_KV_CANARY": "log", "SGLANG_KV_CANARY_DEFERRED_DRAIN": "maybe"}
        )


def test_default_drains_behind_the_forward():
    assert parse_canary_config(env={"SGLANG_KV_CANARY": "log"}).deferred_drain is True
    assert (
        parse_canary_config(
            env={"SGLANG_KV_CANARY": "log", "SGLANG_KV_CANARY_DEFERRED_DRAIN": "0"}
        ).deferred_drain
        is False
    )


def test_idle_flush_reports_what_no_later_bracket_read(deferred):
    d = deferred
    d.bad.add("draft step 1")
    bracket(d, [0, 1])  # the last forwards before the server goes idle
    assert d.reported == []
    with pytest.raises(KVCanaryViolationError, match="violation in draft step 1"):
        flush_deferred_findings()  # the scheduler's idle hook
    assert d.reported == ["draft step 0", "draft step 1"]
    flush_deferred_findings()  # nothing pending any more
    assert d.reported == ["draft step 0", "draft step 1"]


def test_the_scheduler_idle_hook_flushes_deferred_findings(monkeypatch):
    from sglang.srt.managers import scheduler_runtime_checker_mixin as mixin

    calls = []
    monkeypatch.setattr(mixin, "flush_deferred_findings", lambda: calls.append("flush"))
    idle_scheduler = SimpleNamespace(
        is_fully_idle=lambda: True,
        enable_hisparse=True,
        init_new_token_ratio=0.7,
        **{
            name: (lambda: None)
            for name in (
                "_check_tree_cache",
                "_maybe_log_idle_metrics",
                "_publish_kv_events",
                "reset_device_timer_window",
                "maybe_sleep_on_idle",
            )
        },
    )
    mixin.SchedulerRuntimeCheckerMixin.on_idle(idle_scheduler)
    assert calls == ["flush"]
    busy_scheduler = SimpleNamespace(is_fully_idle=lambda: False)
    mixin.SchedulerRuntimeCheckerMixin.on_idle(busy_scheduler)
    assert calls == ["flush"]


class CountingGate(Gate):
    def __init__(self):
        super().__init__()
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1
        super().synchronize()


def _pending_with(host, gate, release=None, indices=(0,)):
    from sglang.srt.kv_canary.staging import PendingDrain, StagedForward

    return PendingDrain(
        StagedForward("DECODE", 1, True, ["r"]), indices, host, gate, release
    )


def _sink_copy(count, checks, records=(), num_sinks=1):
    """Host copy of a manager's sinks: sink 0 holds (count, checks, records), the others junk."""
    import torch

    host = torch.full((num_sinks, 1 + 4, 8), -1, dtype=torch.int64)
    host[:, 0, :2] = torch.tensor([count + 100, checks + 100])
    host[0, 0, :2] = torch.tensor([count, checks])
    for i, r in enumerate(records):
        host[0, 1 + i] = torch.tensor(r)
    return host


def test_a_landed_copy_is_read_without_waiting_and_its_buffer_handed_back():
    gate, released = CountingGate(), []
    pending = _pending_with(
        _sink_copy(1, 12, [[0, 3, 5, 40, 7, 8, 9, 10]]), gate, released.append
    )
    assert not pending.ready()
    gate.open = True
    assert pending.ready()
    [(index, result)] = pending.result()
    assert gate.waits == 0, "result() waited on a copy ready() had already seen land"
    assert index == 0
    assert (result.violation_count, result.checks, result.records.tolist()) == (
        1,
        12,
        [[0, 3, 5, 40, 7, 8, 9, 10]],
    )
    assert released == [pending]
    pending.host.fill_(
        0
    )  # the buffer is reused by a later drain: the result keeps its own copy
    assert result.records.tolist() == [[0, 3, 5, 40, 7, 8, 9, 10]]


def test_reading_an_unlanded_copy_waits_for_it():
    gate = CountingGate()
    [(_, result)] = _pending_with(_sink_copy(0, 30), gate).result()
    assert gate.waits == 1 and (result.violation_count, result.checks) == (0, 30)


def test_records_past_capacity_are_counted_not_read():
    [(_, result)] = _pending_with(
        _sink_copy(9, 30, [[i] * 8 for i in range(4)]), None
    ).result()
    assert result.violation_count == 9 and len(result.records) == 4


def test_a_bracket_reads_only_the_sinks_of_the_forwards_it_ran():
    """One copy holds every sink of the manager; a draft extend (single forward 0 only) must
    not report the draft steps' sinks, and a draft replay reports each step's own."""
    host = _sink_copy(1, 12, [[0, 3, 5, 40, 7, 8, 9, 10]], num_sinks=3)
    host[2, 0, :2] = torch.tensor([0, 7])
    assert [
        (i, d.violation_count, d.checks) for i, d in _pending_with(host, None).result()
    ] == [(0, 1, 12)]
    ran_all = _pending_with(host, None, indices=(0, 2)).result()
    assert [(i, d.violation_count, d.checks) for i, d in ran_all] == [
        (0, 1, 12),
        (2, 0, 7),
    ]


def test_pinned_copies_are_reused_once_handed_back():
    import torch

    from sglang.srt.kv_canary.staging import _PinnedCopies

    pool = _PinnedCopies(torch.zeros(2, 5, 8, dtype=torch.int64))
    pair = (torch.zeros(2, 5, 8, dtype=torch.int64), Gate())
    pool.give_back(_pending_with(*pair))
    host, event = pool.take()
    assert host is pair[0] and event is pair[1]
