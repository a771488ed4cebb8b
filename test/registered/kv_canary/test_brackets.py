"""Bracket semantics: nesting is an error, a pre-op needs a staged single forward (or a graph
capture), and pre-ops dispatch to the single forward of the active draft step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from canary_sim import Batch, SimEngine, draft_step_batch

from sglang.srt.kv_canary import api
from sglang.srt.kv_canary.config import CanaryMode
from sglang.srt.kv_canary.manager import CanaryBracketError
from sglang.srt.kv_canary.report import KVCanaryViolationError


@pytest.fixture
def engine():
    e = SimEngine(num_steps=4, seed=3)
    e.admit(10)
    e.admit(7)
    return e


def test_nested_activation_is_an_error(engine):
    with engine.draft.with_active_single_forward_manager(0):
        with pytest.raises(CanaryBracketError, match="nested"):
            with engine.draft.with_active_single_forward_manager(1):
                pass
    # the failed attempt left the manager usable
    with engine.draft.with_active_single_forward_manager(1):
        pass


def test_nested_outside_bracket_is_an_error(engine):
    batch = draft_step_batch(engine, 0)
    with engine.draft.with_ops_outside_graph([0, 1], batch):
        with pytest.raises(CanaryBracketError, match="nested"):
            with engine.draft.with_ops_outside_graph([2], batch):
                pass


def test_index_out_of_range_is_an_error(engine):
    with pytest.raises(CanaryBracketError, match="out of range"):
        with engine.draft.with_active_single_forward_manager(
            3
        ):  # num_steps - 1 == 3 forwards: 0..2
            pass
    with pytest.raises(CanaryBracketError, match="out of range"):
        with engine.draft.with_ops_outside_graph([0, 5], draft_step_batch(engine, 0)):
            pass


def test_pre_op_outside_any_bracket_is_an_error(engine):
    batch = draft_step_batch(engine, 0)
    with engine.draft.with_active_single_forward_manager(0):
        with pytest.raises(CanaryBracketError, match="outside with_ops_outside_graph"):
            engine.draft.pre_ops_maybe_inside_graph(batch)
    target_batch = Batch(**{**batch.__dict__, "token_to_kv_pool": engine.target_pool})
    with pytest.raises(CanaryBracketError, match="outside with_ops_outside_graph"):
        engine.target.pre_ops_maybe_inside_graph(target_batch)


def test_pre_op_on_a_step_the_bracket_did_not_stage_is_an_error(engine):
    batch = draft_step_batch(engine, 2)
    with engine.draft.with_ops_outside_graph([0, 1], batch):
        with engine.draft.with_active_single_forward_manager(2):
            with pytest.raises(CanaryBracketError, match="draft step 2"):
                engine.draft.pre_ops_maybe_inside_graph(batch)


def test_draft_pre_op_needs_an_active_step(engine):
    batch = draft_step_batch(engine, 0)
    with engine.draft.with_ops_outside_graph([0, 1, 2], batch):
        with pytest.raises(
            CanaryBracketError, match="needs with_active_single_forward_manager"
        ):
            engine.draft.pre_ops_maybe_inside_graph(batch)


def test_pre_op_during_capture_is_allowed_and_touches_nothing(engine):
    batch = draft_step_batch(engine, 0)
    before = engine.draft.group.slot_fp.clone()
    with engine.draft.capturing(), engine.draft.with_active_single_forward_manager(1):
        engine.draft.pre_ops_maybe_inside_graph(batch)
    assert torch.equal(before, engine.draft.group.slot_fp)


def test_capture_inside_a_bracket_restores_the_staged_plan(engine):
    batch = draft_step_batch(engine, 0)
    with engine.draft.with_ops_outside_graph([0], batch):
        staged = engine.draft.single_forwards[0].plan.live_rows.clone()
        with engine.draft.capturing():
            assert int(engine.draft.single_forwards[0].plan.live_rows) == 0
        assert torch.equal(engine.draft.single_forwards[0].plan.live_rows, staged)
        with engine.draft.with_active_single_forward_manager(0):
            engine.draft.pre_ops_maybe_inside_graph(batch)
    assert engine.draft.group.slot_fp[batch.out_cache_loc].ne(0).all()


def test_pre_ops_dispatch_to_the_active_steps_single_forward(engine):
    """Each draft step's checks land in its own single forward's sink, and are reported under
    its own name."""
    staged = draft_step_batch(engine, 0)
    sinks = [sf.sink for sf in engine.draft.single_forwards]
    seen_checks = []

    def record_checks(index):
        seen_checks.append([int(s.checks[0]) for s in sinks])

    with engine.draft.with_ops_outside_graph([0, 1, 2], staged):
        for step in (0, 2):
            with engine.draft.with_active_single_forward_manager(step):
                engine.draft.pre_ops_maybe_inside_graph(draft_step_batch(engine, step))
            record_checks(step)
    prefix = sum(r.kv_len for r in engine.reqs.values())
    assert seen_checks == [[prefix, 0, 0], [prefix, 0, prefix]]
    by_group = engine.draft.reporter.stats.checks_by_group
    assert {k: v for k, v in by_group.items() if k != "draft step 0"} == {
        "target": 0,
        "draft step 1": 0,
        "draft step 2": prefix,
    }
    assert (
        by_group["draft step 0"] == prefix
    )  # the admissions' draft extends checked nothing (no prefix)


def test_violations_are_reported_under_the_steps_name(engine):
    req = next(iter(engine.reqs.values()))
    slot = int(engine.r2t[req.row, 1])
    engine.draft.group.slot_fp[slot] ^= 8  # corrupt one draft slot
    staged = draft_step_batch(engine, 0)
    with pytest.raises(KVCanaryViolationError) as err:
        with engine.draft.with_ops_outside_graph([0, 1, 2], staged):
            with engine.draft.with_active_single_forward_manager(1):
                engine.draft.pre_ops_maybe_inside_graph(draft_step_batch(engine, 1))
    (violation,) = err.value.violations
    assert (violation.group, violation.rid, violation.position, violation.slot) == (
        "draft step 1",
        req.rid,
        1,
        slot,
    )


def test_log_mode_counts_without_raising():
    engine = SimEngine(num_steps=2, seed=4, mode=CanaryMode.LOG)
    req = engine.admit(9)
    engine.target.group.slot_fp[int(engine.r2t[req.row, 4])] = 12345
    engine.decode([req])
    stats = engine.target.reporter.stats.as_dict()
    assert (
        stats["violations_total"] == 1 and stats["violations_by_group"]["target"] == 1
    )
    assert engine.target.reporter.last_violations[0].position == 4


def test_an_exception_inside_the_bracket_discards_and_propagates(engine):
    staged = draft_step_batch(engine, 0)
    with pytest.raises(ZeroDivisionError):
        with engine.draft.with_ops_outside_graph([0, 1], staged):
            1 / 0
    assert not any(sf.is_staged for sf in engine.draft.single_forwards)
    with engine.draft.with_ops_outside_graph([0], staged):  # usable again
        pass


def test_draft_extend_brackets_stage_single_forward_zero(engine):
    req = next(iter(engine.reqs.values()))
    engine.spec_round([req])  # runs draft extend v2 through api.draft_extend_brackets
    assert engine.draft.reporter.stats.checks_by_group["draft step 0"] > 0
    with api.draft_extend_brackets(engine.draft, draft_step_batch(engine, 0)):
        assert engine.draft.single_forwards[0].is_staged and engine.draft._active == 0
    assert (
        not engine.draft.single_forwards[0].is_staged and engine.draft._active is None
    )


def test_a_decorated_draft_step_runs_with_its_single_forward_active(engine):
    seen = []

    class Worker:
        draft_runner = SimpleNamespace(kv_canary=engine.draft)

        @api.in_draft_step
        def _draft_step(self, forward_batch, out_cache_loc, i, input_ids, hidden=None):
            seen.append((engine.draft._active, forward_batch, input_ids, hidden))
            return i * 10

    worker = Worker()
    assert worker._draft_step("fb", "loc", 1, "ids", hidden="h") == 10
    assert seen == [(1, "fb", "ids", "h")] and engine.draft._active is None
    with pytest.raises(CanaryBracketError):  # the step index is checked
        worker._draft_step("fb", "loc", len(engine.draft.single_forwards), "ids")
    Worker.draft_runner = SimpleNamespace(kv_canary=None)  # canary off: a plain call
    assert worker._draft_step("fb", "loc", 2, "ids") == 20
