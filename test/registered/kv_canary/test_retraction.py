"""Retraction: a retracted request is prefilled again under the same rid, on top of the KV prefix
the radix cache kept, and may get back a req_to_token row it held before.

The GPU run that motivated these tests (EAGLE3 chain, SGLANG_TEST_RETRACT=1, 600 requests) was
stopped by raise mode with 7 violations at positions 27..33 of one request's re-prefill: the
request had held that row once, got it back after nine stays in other rows, and the canary still
counted the row as its own from the first stay, so it compared the prefix it got back from the
radix cache with the row's token record, which past the first stay was the previous occupant's.
The KV was right; the record was stale. A row's ownership now ends when ReqToTokenPool.free
takes the row back (api.on_row_free).
"""

from __future__ import annotations

import pytest
import torch
from canary_sim import SimEngine

from sglang.srt.kv_canary import api, faults
from sglang.srt.kv_canary.config import CanaryMode
from sglang.srt.kv_canary.fingerprint import FREED
from sglang.srt.kv_canary.report import STATS, KVCanaryViolationError
from sglang.srt.kv_canary.tables import IDENTITY_CONTENT, RequestRecord, shared_record

# The report's shape: a 26-token prompt, one token gained per stay, back in its first row at
# the tenth re-prefill with 34 positions cached; the row's earlier occupant had 80 tokens.
PROMPT_LEN = 26
EARLIER_PROMPT_LEN = 80
STAYS_ELSEWHERE = 9
# Row 0 (padding), the first row and one per stay elsewhere: the free list is FIFO (as sglang's
# ReqToTokenPool), so the tenth re-prefill gets the first row back.
ROWS = 1 + 1 + STAYS_ELSEWHERE
# Positions cached when it is back in its first row: the prompt's but one, one more per stay.
BACK_PREFIX = PROMPT_LEN - 1 + STAYS_ELSEWHERE


def _retract_loop_back_into_the_first_row(engine: SimEngine):
    """The report's sequence. Returns (the request, its first row, the earlier occupant)."""
    earlier = engine.admit(EARLIER_PROMPT_LEN)
    first_row = earlier.row
    engine.finish(earlier)
    req = engine.admit(PROMPT_LEN, row=first_row)
    # Each stay: the re-prefill computes the last two positions (the previous stay's
    # cache_unfinished_req cached all but the last one), samples one token, and is retracted.
    engine.retract(req, keep=req.kv_len - 1)
    for _ in range(STAYS_ELSEWHERE):
        engine.readmit(req)
        assert req.row != first_row
        engine.retract(req, keep=req.kv_len - 1)
    # Back in the first row: positions 27..33 of BACK_PREFIX were cached during the other stays.
    engine.readmit(req)
    return req, first_row, earlier


def test_the_report_reproduces_when_row_frees_go_unreported():
    """Without the row release the canary flags exactly what the GPU run flagged: positions
    27..33, each expecting the earlier occupant's token and finding the token this request
    wrote there in the row it held then."""
    engine = SimEngine(radix=True, rows=ROWS, context=128, mode=CanaryMode.RAISE)
    engine.report_row_frees = False
    with pytest.raises(KVCanaryViolationError) as err:
        _retract_loop_back_into_the_first_row(engine)

    req = next(iter(engine.reqs.values()))
    first_row = req.rows_held[0]
    assert req.row == first_row
    violations = err.value.violations
    assert {(v.group, v.forward_mode, v.rid, v.req_row) for v in violations} == {
        ("target", "EXTEND", req.rid, first_row)
    }
    by_position = {v.position: v for v in violations}
    assert sorted(by_position) == list(range(PROMPT_LEN + 1, PROMPT_LEN + 8))
    earlier_tokens = engine.target.record.token_at[first_row].tolist()
    for p, v in by_position.items():
        assert not v.borrowed
        assert v.expected_token == earlier_tokens[p]
        # re-prefill k (1-based) had prefix PROMPT_LEN - 2 + k and wrote that position first
        writer_stay = p - (PROMPT_LEN - 2)
        assert (v.found_writer_row, v.found_writer_pos) == (
            req.rows_held[writer_stay],
            p,
        )


def test_a_request_back_in_a_row_it_held_before_reads_its_cached_prefix_cleanly():
    engine = SimEngine(radix=True, rows=ROWS, context=128, mode=CanaryMode.RAISE)
    req, first_row, _ = _retract_loop_back_into_the_first_row(engine)
    assert req.row == first_row
    assert engine.counts["readmitted_in_old_row"] == 1
    # The re-prefill owns only what it wrote; the cached prefix is borrowed.
    assert int(engine.target.record.row_own_from[first_row]) == BACK_PREFIX
    checks_before = STATS.as_dict()["checks_total"]
    engine.spec_round([req])
    engine.spec_round([req])
    stats = STATS.as_dict()
    assert stats["violations_total"] == 0
    assert stats["checks_total"] > checks_before + 2 * BACK_PREFIX


@pytest.fixture
def back_in_first_row():
    engine = SimEngine(radix=True, rows=ROWS, context=128, mode=CanaryMode.RAISE)
    req, _, _ = _retract_loop_back_into_the_first_row(engine)
    return engine, req


def test_a_cached_slot_freed_under_the_readmitted_request_is_still_reported(
    back_in_first_row,
):
    engine, req = back_in_first_row
    slot = int(engine.r2t[req.row, PROMPT_LEN + 3])
    api.on_free(engine.allocator, torch.tensor([slot]))
    with pytest.raises(KVCanaryViolationError) as err:
        engine.spec_round([req])
    v = err.value.violations[0]
    assert (v.rid, v.position, v.slot, v.found_fp, v.borrowed) == (
        req.rid,
        PROMPT_LEN + 3,
        slot,
        FREED,
        True,
    )


def test_a_corrupted_slot_the_readmission_wrote_is_still_checked_against_its_token(
    back_in_first_row,
):
    engine, req = back_in_first_row
    own = req.kv_len - 1  # written by the re-prefill in this row
    victim = int(engine.r2t[req.row, own])
    faults.corrupt_slot(engine.target.group, victim, int(engine.r2t[req.row, 3]))
    with pytest.raises(KVCanaryViolationError) as err:
        engine.spec_round([req])
    (v,) = [v for v in err.value.violations if v.group == "target"]
    assert (v.position, v.borrowed, v.expected_token) == (own, False, req.tokens[own])


def test_row_release_ends_ownership_and_a_chunked_continuation_keeps_it():
    record = RequestRecord(
        torch.zeros(6, 64, dtype=torch.int32), identity=IDENTITY_CONTENT
    )
    rows = torch.tensor([2, 3])
    record.adopt_owners(rows, ["a", "b"], torch.tensor([0, 5]))
    # The next chunk of the same request in the same row: still the owner since position 0.
    record.adopt_owners(rows[:1], ["a"], torch.tensor([16]))
    assert record.row_own_from[2] == 0
    record.note_row_released(2)
    # Noted on the host; applied at the next bracket, before that bracket's stage adopts.
    record.adopt_owners(rows[:1], ["a"], torch.tensor([20]))
    assert record.row_own_from[2] == 0
    record.note_row_released(2)
    record.apply_pending_frees()
    record.adopt_owners(rows, ["a", "b"], torch.tensor([34, 9]))
    assert record.row_own_from.tolist()[2:4] == [34, 5]


def test_row_free_of_a_pool_without_a_canary_is_a_no_op():
    class Pool:
        req_to_token = torch.zeros(2, 4, dtype=torch.int32)

    api.on_row_free(Pool(), 1)


RETRACTING_FLAVOURS = {
    "eagle_chain_radix": dict(num_steps=3, radix=True),
    "eagle_tree_radix": dict(num_steps=4, topk=2, num_draft_tokens=7, radix=True),
    "eagle_chain": dict(num_steps=3),
    "no_spec_radix": dict(eagle=False, radix=True),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("flavour", sorted(RETRACTING_FLAVOURS))
def test_random_workload_with_retraction_has_no_violations(flavour, seed):
    engine = SimEngine(
        seed=seed, slots=600, mode=CanaryMode.RAISE, **RETRACTING_FLAVOURS[flavour]
    )
    engine.run_random(300, retract_every=3)
    stats = STATS.as_dict()
    assert stats["violations_total"] == 0
    assert stats["checks_total"] > 1000
    for name in ("retracted", "readmitted", "readmitted_in_old_row", "freed"):
        assert engine.counts[name] > 0, f"never exercised {name}: {dict(engine.counts)}"


def test_the_random_retraction_workload_meets_the_stale_record_without_row_frees():
    """The workload above would have caught the bug: with row frees unreported it does."""
    engine = SimEngine(
        seed=0,
        slots=600,
        mode=CanaryMode.LOG,
        **RETRACTING_FLAVOURS["eagle_chain_radix"],
    )
    engine.report_row_frees = False
    engine.run_random(300, retract_every=3)
    assert STATS.as_dict()["violations_total"] > 0


def test_sglang_req_to_token_pool_free_ends_the_row_ownership():
    """The kv-canary-row-release patch's call site: ReqToTokenPool.free reports the row it
    takes back."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(
        size=4, max_context_len=16, device="cpu", enable_memory_saver=False
    )
    record = shared_record(pool, IDENTITY_CONTENT)
    (row,) = pool.alloc([SimpleNamespace(req_pool_idx=None)])
    record.adopt_owners(torch.tensor([row]), ["a"], torch.tensor([0]))
    pool.free(SimpleNamespace(req_pool_idx=row))
    record.apply_pending_frees()
    record.adopt_owners(torch.tensor([row]), ["a"], torch.tensor([12]))
    assert int(record.row_own_from[row]) == 12
