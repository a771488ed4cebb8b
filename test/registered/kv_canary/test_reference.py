"""The reference write / verify: what each check catches, and what it deliberately lets pass."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.kv_canary import reference
from sglang.srt.kv_canary.contract import (
    REC_EXPECTED_FP,
    REC_EXPECTED_TOKEN,
    REC_FOUND_FP,
    REC_FOUND_WRITER,
    REC_POSITION,
    REC_REQ_ROW,
    REC_SLOT,
    FingerprintCheck,
    FingerprintWrite,
    PlanBuffers,
    ViolationSink,
    ViolationSinks,
)
from sglang.srt.kv_canary.fingerprint import (
    FREED,
    NEVER_WRITTEN,
    fingerprint,
    pack_writer,
    unpack_writer,
)
from sglang.srt.kv_canary.staging import stage_forward
from sglang.srt.kv_canary.tables import (
    IDENTITY_CONTENT,
    IDENTITY_REQUEST,
    RequestRecord,
)

ROWS, CONTEXT, SLOTS = 6, 32, 256
ONE = torch.tensor([1], dtype=torch.int32)


class Pools:
    """A record with a target and a draft group, and helpers to write / check one row."""

    def __init__(self, identity=IDENTITY_REQUEST):
        self.record = RequestRecord(
            torch.zeros(ROWS, CONTEXT, dtype=torch.int32), identity
        )
        self.target = self.record.register_group(
            object(), "target", is_draft=False, token_offset=0, num_slots=SLOTS
        )
        self.draft = self.record.register_group(
            object(), "draft", is_draft=True, token_offset=1, num_slots=SLOTS
        )
        self.next_slot = 1

    def place(self, row: int, n: int, tag: int) -> list[int]:
        """Give `row` n fresh slots at positions [0, n) and set its identity."""
        slots = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        self.record.req_to_token[row, :n] = torch.tensor(slots, dtype=torch.int32)
        self.record.row_tag[row] = (
            tag if self.record.identity == IDENTITY_REQUEST else 0
        )
        return slots

    def write(self, row, positions, tokens, group=None, owner=None, record_tokens=True):
        group = group or self.target
        slots = self.record.req_to_token[row, positions].to(torch.int64)
        reference.write_fingerprints(
            self.record,
            group,
            owner or group,
            FingerprintWrite(
                out_cache_loc=slots,
                positions=torch.tensor(positions),
                input_ids=torch.tensor(tokens),
                req_pool_indices=torch.tensor([row]),
                token_batch_rows=None,
                tokens_per_row=len(positions),
                live_rows=ONE,
                record_tokens=record_tokens,
            ),
        )

    def check(
        self,
        rows,
        lens,
        group=None,
        owner=None,
        capacity=64,
        live_rows=None,
        verify_on=1,
    ) -> ViolationSink:
        group = group or self.target
        sink = ViolationSink.allocate(capacity, "cpu")
        reference.verify_fingerprints(
            self.record,
            group,
            owner or group,
            FingerprintCheck(
                req_pool_indices=torch.tensor(rows),
                verify_lens=torch.tensor(lens, dtype=torch.int32),
                live_rows=torch.tensor(
                    [len(rows) if live_rows is None else live_rows], dtype=torch.int32
                ),
                verify_on=torch.tensor([verify_on], dtype=torch.int32),
            ),
            sink,
        )
        return sink


def _records(sink):
    return sink.records[: min(int(sink.count), sink.capacity)].tolist()


@pytest.fixture
def pools():
    p = Pools()
    p.place(1, 8, tag=111)
    p.write(1, list(range(8)), [10 + i for i in range(8)])
    p.place(2, 8, tag=222)
    p.write(2, list(range(8)), [20 + i for i in range(8)])
    return p


def test_clean_prefix_passes_and_counts_checks(pools):
    sink = pools.check([1, 2], [8, 5])
    assert int(sink.count) == 0 and int(sink.checks) == 13


def test_flipped_fingerprint_names_row_position_slot_and_both_values(pools):
    slot = int(pools.record.req_to_token[1, 3])
    good = int(pools.target.slot_fp[slot])
    pools.target.slot_fp[slot] ^= 1 << 40
    (rec,) = _records(pools.check([1], [8]))
    assert (rec[REC_REQ_ROW], rec[REC_POSITION], rec[REC_SLOT]) == (1, 3, slot)
    assert rec[REC_EXPECTED_FP] == good and rec[REC_FOUND_FP] == good ^ (1 << 40)
    assert rec[REC_EXPECTED_TOKEN] == 13 and unpack_writer(rec[REC_FOUND_WRITER]) == (
        1,
        3,
    )


def test_wrong_req_to_token_entry_is_caught(pools):
    pools.record.req_to_token[1, 2] = pools.record.req_to_token[
        2, 2
    ]  # same position, other request
    (rec,) = _records(pools.check([1], [8]))
    assert rec[REC_POSITION] == 2 and unpack_writer(rec[REC_FOUND_WRITER]) == (2, 2)


def test_slot_reused_by_another_request_is_caught(pools):
    """A premature free: request 3 gets slot (1, 5) and writes its own token there."""
    slot = int(pools.record.req_to_token[1, 5])
    pools.record.req_to_token[3, 0] = slot
    pools.record.row_tag[3] = 333
    pools.write(3, [0], [99])
    (rec,) = _records(pools.check([1], [8]))
    assert rec[REC_SLOT] == slot and unpack_writer(rec[REC_FOUND_WRITER]) == (3, 0)


def test_freed_and_never_written_slots_are_caught(pools):
    slot = int(pools.record.req_to_token[1, 1])
    pools.record.note_freed(torch.tensor([slot]))
    assert int(pools.check([1], [8]).count) == 0  # poisoning waits for the next bracket
    pools.record.apply_pending_frees()
    pools.record.req_to_token[1, 6] = SLOTS - 1  # nobody ever wrote that slot
    found = {r[REC_POSITION]: r[REC_FOUND_FP] for r in _records(pools.check([1], [8]))}
    assert found == {1: FREED, 6: NEVER_WRITTEN}


def test_stray_write_to_a_live_slot_is_caught(pools):
    """Request 2 writes position 9 into request 1's slot at position 4 (wrong out_cache_loc)."""
    slot = int(pools.record.req_to_token[1, 4])
    reference.write_fingerprints(
        pools.record,
        pools.target,
        pools.target,
        FingerprintWrite(
            out_cache_loc=torch.tensor([slot]),
            positions=torch.tensor([9]),
            input_ids=torch.tensor([7]),
            req_pool_indices=torch.tensor([2]),
            token_batch_rows=None,
            tokens_per_row=1,
            live_rows=ONE,
            record_tokens=True,
        ),
    )
    (rec,) = _records(pools.check([1], [8]))
    assert rec[REC_POSITION] == 4 and unpack_writer(rec[REC_FOUND_WRITER]) == (2, 9)


def test_same_content_in_another_request_is_caught_only_with_request_identity():
    """Content identity (radix cache on) cannot tell apart two requests with the same token at the
    same position; request identity can. That K/V differs only if the earlier tokens differ.
    """
    for identity, expected in ((IDENTITY_REQUEST, 1), (IDENTITY_CONTENT, 0)):
        p = Pools(identity)
        p.place(1, 4, tag=1)
        p.write(1, [0, 1, 2, 3], [5, 6, 7, 8])
        p.place(2, 4, tag=2)
        p.write(2, [0, 1, 2, 3], [9, 9, 7, 9])  # same token 7 at position 2
        p.record.req_to_token[1, 2] = p.record.req_to_token[2, 2]
        assert int(p.check([1], [4]).count) == expected


def test_draft_slots_carry_the_next_token(pools):
    """EAGLE draft pools hold the K/V of token p + 1 at position p: offset 1."""
    tokens = [
        10 + i for i in range(9)
    ]  # committed tokens incl. the bonus at position 8
    pools.write(1, list(range(8)), tokens[1:9], group=pools.draft)
    assert int(pools.check([1], [8], group=pools.draft).count) == 0
    assert (
        pools.record.token_at[1, 8] == 18
    )  # recorded at p + 1, where the target will read it
    # a draft pool filled without the shift (token p at p) is wrong from position 0 on
    pools.write(1, list(range(8)), tokens[:8], group=pools.draft, record_tokens=False)
    assert int(pools.check([1], [8], group=pools.draft).count) == 8


def test_a_forward_bound_to_another_pool_is_caught(pools):
    """A draft step whose batch points at the target pool reads target slots with the draft's
    expectations: the group salt differs (and the token offset)."""
    pools.write(1, list(range(8)), [11 + i for i in range(8)], group=pools.draft)
    sink = pools.check([1], [8], group=pools.target, owner=pools.draft)
    assert int(sink.count) == 8


def test_borrowed_positions_only_need_a_live_slot_of_that_position(pools):
    """Positions before row_own_from came from the prefix cache: another request's write at
    the same position passes, a freed slot or one holding another position does not."""
    pools.record.req_to_token[1, :4] = pools.record.req_to_token[2, :4]
    assert (
        int(pools.check([1], [8]).count) == 4
    )  # as own positions: other request's fps
    pools.record.row_own_from[1] = 4
    assert int(pools.check([1], [8]).count) == 0
    pools.record.req_to_token[1, 1] = pools.record.req_to_token[2, 3]
    pools.record.note_freed(pools.record.req_to_token[2, 0:1].to(torch.int64))
    pools.record.apply_pending_frees()
    recs = _records(pools.check([1], [8]))
    assert sorted(r[REC_POSITION] for r in recs) == [0, 1]
    assert all(r[REC_EXPECTED_FP] == 0 and r[REC_EXPECTED_TOKEN] == -1 for r in recs)


def test_verify_off_checks_nothing_and_padding_rows_are_ignored(pools):
    pools.target.slot_fp[:] = 3
    assert int(pools.check([1, 2], [8, 8], verify_on=0).checks) == 0
    sink = pools.check([1, 2], [8, 8], live_rows=1)  # row 2 is CUDA-graph padding
    assert int(sink.checks) == 8 and {r[REC_REQ_ROW] for r in _records(sink)} == {1}


def test_padding_tokens_are_not_written():
    p = Pools()
    p.place(1, 2, tag=5)
    reference.write_fingerprints(
        p.record,
        p.target,
        p.target,
        FingerprintWrite(
            out_cache_loc=torch.tensor([1, 0]),
            positions=torch.tensor([0, 0]),
            input_ids=torch.tensor([4, 4]),
            req_pool_indices=torch.tensor([1, 0]),
            token_batch_rows=None,
            tokens_per_row=1,
            live_rows=ONE,
            record_tokens=True,
        ),
    )
    assert (
        int(p.target.slot_fp[0]) == NEVER_WRITTEN and int(p.record.token_at[0, 0]) == 0
    )
    assert int(p.target.slot_fp[1]) == int(
        fingerprint(torch.tensor(5), torch.tensor(0), torch.tensor(4), p.target.salt)
    )
    assert int(p.target.slot_writer[1]) == int(
        pack_writer(torch.tensor(1), torch.tensor(0))
    )


def test_speculative_writes_leave_the_token_record_alone(pools):
    before = pools.record.token_at.clone()
    pools.write(1, [0, 1], [77, 78], record_tokens=False)
    assert torch.equal(before, pools.record.token_at)
    assert (
        int(pools.check([1], [8]).count) == 2
    )  # the slots now disagree with the record


def test_records_are_capped_but_every_violation_is_counted(pools):
    pools.target.slot_fp[:] = 5
    sink = pools.check([1, 2], [8, 8], capacity=3)
    assert int(sink.count) == 16 and len(_records(sink)) == 3


def test_multi_layer_steps_skip_their_speculative_tail():
    """Multi-layer EAGLE step i's pool holds token p + 1 + i at p: the last i prefix positions
    hold draft tokens, not committed ones, and are not checked."""
    p = Pools()
    step2 = p.record.register_group(
        object(), "draft step 2", is_draft=True, token_offset=3, num_slots=SLOTS
    )
    plan = PlanBuffers.allocate(ROWS, "cpu")
    from canary_sim import Batch, Mode

    batch = Batch(
        Mode.DECODE,
        2,
        torch.tensor([1, 2]),
        torch.tensor([10, 1]),
        torch.tensor([0, 0]),
        torch.tensor([0, 0]),
        None,
        rids=["a", "b"],
    )
    stage_forward(
        reference,
        p.record,
        step2,
        batch,
        True,
        plan,
        ViolationSinks.allocate(1, 8, "cpu"),
    )
    assert plan.verify_lens[:2].tolist() == [8, 0]
