"""Each injected fault is detected: the fault functions on small pools, and the env-driven
injector inside simulated EAGLE / plain runs."""

from __future__ import annotations

import pytest
import torch
from canary_sim import Batch, Mode, SimEngine

from sglang.srt.kv_canary import faults
from sglang.srt.kv_canary.config import CanaryMode
from sglang.srt.kv_canary.faults import (
    ENV_FAULT,
    ENV_FAULT_STEP,
    FaultConfig,
    FaultKind,
    parse_fault_config,
)
from sglang.srt.kv_canary.fingerprint import FREED
from sglang.srt.kv_canary.report import KVCanaryViolationError


def test_fault_config_parsing():
    assert parse_fault_config({}) is None
    assert parse_fault_config({ENV_FAULT: "corrupt_slot"}) == FaultConfig(
        FaultKind.CORRUPT_SLOT, 1
    )
    assert (
        parse_fault_config(
            {ENV_FAULT: "free_in_use", ENV_FAULT_STEP: "40"}
        ).trigger_step
        == 40
    )
    with pytest.raises(ValueError, match=ENV_FAULT):
        parse_fault_config({ENV_FAULT: "flip_bits"})
    with pytest.raises(ValueError, match=ENV_FAULT_STEP):
        parse_fault_config({ENV_FAULT: "corrupt_slot", ENV_FAULT_STEP: "0"})


@pytest.fixture
def two_requests():
    engine = SimEngine(seed=5, num_steps=3)
    a, b = engine.admit(12), engine.admit(9)
    engine.spec_round([a, b])
    return engine, a, b


def _violations_of_next_round(engine, reqs):
    with pytest.raises(KVCanaryViolationError) as err:
        engine.spec_round(reqs)
    return err.value.violations


def test_corrupt_slot_is_detected(two_requests):
    engine, a, b = two_requests
    victim = int(engine.r2t[a.row, 5])
    faults.corrupt_slot(engine.target.group, victim, int(engine.r2t[b.row, 2]))
    (v,) = _violations_of_next_round(engine, [a, b])
    assert (v.rid, v.group, v.position, v.slot) == (a.rid, "target", 5, victim)
    assert (v.found_writer_row, v.found_writer_pos) == (b.row, 2)


def test_corrupt_slot_in_the_draft_pool_is_detected_by_the_draft_steps(two_requests):
    engine, a, b = two_requests
    faults.corrupt_slot(
        engine.draft.group, int(engine.r2t[a.row, 3]), int(engine.r2t[b.row, 3])
    )
    violations = _violations_of_next_round(engine, [a, b])
    # both inner draft steps read the prefix, each through its own single forward
    assert [(v.group, v.rid, v.position, v.forward_mode) for v in violations] == [
        ("draft step 0", a.rid, 3, "DECODE"),
        ("draft step 1", a.rid, 3, "DECODE"),
    ]


def test_misrouted_req_to_token_is_detected_in_every_pool():
    engine = SimEngine(seed=5, num_steps=3, mode=CanaryMode.LOG)
    a, b = engine.admit(12), engine.admit(9)
    faults.misroute_req_to_token(engine.r2t, a.row, 4, b.row, 7)
    engine.spec_round([a, b])
    # draft step 0, draft step 1, target verify, and draft extend (single forward 0) each saw it
    assert engine.target.reporter.stats.as_dict()["violations_by_group"] == {
        "target": 1,
        "draft step 0": 2,
        "draft step 1": 1,
    }
    (v,) = engine.draft.reporter.last_violations
    assert (
        v.forward_mode,
        v.rid,
        v.position,
        v.found_writer_row,
        v.found_writer_pos,
    ) == (
        "DRAFT_EXTEND_V2",
        a.rid,
        4,
        b.row,
        7,
    )


def test_free_in_use_is_detected(two_requests):
    engine, a, b = two_requests
    slot = int(engine.r2t[b.row, 1])
    faults.free_in_use(
        engine.target.record,
        slot,
        new_tag=77,
        new_row=a.row,
        new_position=30,
        new_token=3,
    )
    violations = _violations_of_next_round(engine, [b])  # the draft steps read it first
    assert {(v.rid, v.slot, v.found_writer_pos) for v in violations} == {
        (b.rid, slot, 30)
    }


def test_a_real_premature_free_is_detected_when_the_slot_is_reused(two_requests):
    """The allocator takes back a slot request a still uses; a new request gets it."""
    engine, a, b = two_requests
    slot = int(engine.r2t[a.row, 6])
    engine.allocator.free_slots.insert(
        0, slot
    )  # the bug: freed while in use, not poisoned
    c = engine.admit(4)
    assert slot in engine.slots_of(c, 0, 4)
    violations = _violations_of_next_round(engine, [a])
    assert {(v.rid, v.position, v.slot, v.found_writer_row) for v in violations} == {
        (a.rid, 6, slot, c.row)
    }


def test_a_freed_slot_still_referenced_is_detected_before_reuse(two_requests):
    engine, a, b = two_requests
    slot = int(engine.r2t[a.row, 2])
    from sglang.srt.kv_canary import api

    api.on_free(engine.allocator, torch.tensor([slot]))
    v = _violations_of_next_round(engine, [a])[0]
    # The report names the slot's last write: the freeing did not erase who wrote it.
    assert (v.position, v.found_fp, v.found_writer_row, v.found_writer_pos) == (
        2,
        FREED,
        a.row,
        2,
    )
    assert f"found freed (last written for row {a.row} pos 2)" in v.describe()


def test_a_draft_step_bound_to_another_pool_is_detected(two_requests):
    """The bug draft_step_binding fixes: a step's batch pointing at another pool."""
    engine, a, b = two_requests
    steps = []

    original = engine.run_draft_steps

    def bound_to_target(staged, step_batches):
        for step in step_batches[1:]:
            step.token_to_kv_pool = engine.target_pool
        steps.extend(step_batches)
        original(staged, step_batches)

    engine.run_draft_steps = bound_to_target
    violations = _violations_of_next_round(engine, [a, b])
    assert {v.group for v in violations} == {"draft step 1"}
    assert len(violations) == a.kv_len + b.kv_len  # every prefix slot of the wrong pool


FLAVOURS = {
    "eagle_chain": dict(num_steps=3),
    "eagle_tree_radix": dict(num_steps=3, topk=3, num_draft_tokens=6, radix=True),
    "standalone_tree_radix": dict(
        algorithm="STANDALONE", num_steps=3, topk=3, num_draft_tokens=6, radix=True
    ),
    "no_spec": dict(eagle=False),
}


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("kind", [k.value for k in FaultKind])
def test_env_injected_fault_is_detected(monkeypatch, flavour, kind):
    monkeypatch.setenv(ENV_FAULT, kind)
    monkeypatch.setenv(ENV_FAULT_STEP, "15")
    engine = SimEngine(seed=11, **FLAVOURS[flavour])
    injector = engine.target.fault_injector
    assert injector is not None and (
        engine.draft is None or engine.draft.fault_injector is None
    )
    with pytest.raises(KVCanaryViolationError) as err:
        engine.run_random(400)
    injected = injector.injected
    assert (
        injected is not None and injected.kind.value == kind and injected.bracket >= 15
    )
    first = err.value.violations[0]
    assert (first.req_row, first.position) == (
        injected.victim_row,
        injected.victim_position,
    )
    assert (
        injector.brackets == injected.bracket
    )  # caught in the very forward it was injected before


def test_injector_waits_for_a_victim():
    injector = faults.FaultInjector(FaultConfig(FaultKind.CORRUPT_SLOT, 1))
    empty = Batch(
        Mode.EXTEND,
        1,
        torch.tensor([1]),
        torch.tensor([0]),
        torch.tensor([3]),
        torch.tensor([5]),
        None,
        extend_seq_lens=torch.tensor([1], dtype=torch.int32),
    )
    assert injector.maybe_inject(None, empty) is None and injector.injected is None
