"""Plain-torch stage, write and verify: the specification the triton kernels (kernels.py) must match.

Used by the CPU tests and by the manager on CPU devices. Host syncs are fine here; ordering of
violation records is by (batch row, position), while the kernels record in any order.
"""

from __future__ import annotations

import torch

from sglang.srt.kv_canary.contract import (
    FingerprintCheck,
    FingerprintWrite,
    ForwardPlan,
    PlanBuffers,
    ViolationSink,
    ViolationSinks,
)
from sglang.srt.kv_canary.fingerprint import fingerprint, pack_writer
from sglang.srt.kv_canary.tables import FingerprintGroup, RequestRecord

_LOW32 = 0xFFFFFFFF


def stage_plan(plan: ForwardPlan, buffers: PlanBuffers, sinks: ViolationSinks) -> None:
    """Write one forward's plan into the static buffers and empty every sink.

    verify_lens[b] = max(prefix of row b - speculative_tail, 0) for the live rows; rows at and
    past batch_size are left as they are (the kernels read only rows < live_rows).
    """
    bs = plan.batch_size
    if bs > 0:
        if plan.extend_seq_lens is None:
            first = torch.arange(bs, device=plan.positions.device) * plan.tokens_per_row
        else:
            lens = plan.extend_seq_lens[:bs].to(torch.int64)
            first = torch.cumsum(lens, 0) - lens
        prefix = plan.positions.to(torch.int64)[first]
        buffers.verify_lens[:bs] = (
            (prefix - plan.speculative_tail).clamp(min=0).to(torch.int32)
        )
    buffers.live_rows.fill_(bs)
    buffers.verify_on.fill_(int(plan.verify))
    sinks.reset()


def write_fingerprints(
    record: RequestRecord,
    storage: FingerprintGroup,
    owner: FingerprintGroup,
    w: FingerprintWrite,
) -> None:
    """Stamp every live token's slot in `storage` with the fingerprint `owner` expects.

    storage: the group of the KV pool the forward actually writes; owner: the group of the
    runner doing the forward (salt, token offset). They differ only when a forward is bound to
    the wrong pool, which is what the salt exposes.
    """
    n = w.num_tokens
    if n == 0:
        return
    device = storage.slot_fp.device
    if w.token_batch_rows is None:
        batch_row = torch.arange(n, device=device) // w.tokens_per_row
    else:
        batch_row = w.token_batch_rows.to(torch.int64)
    live = batch_row < w.live_rows.to(torch.int64)[0]
    batch_row = batch_row[live]
    row = w.req_pool_indices.to(torch.int64)[batch_row]
    pos = w.positions.to(torch.int64)[live]
    token = w.input_ids.to(torch.int64)[live]
    slot = w.out_cache_loc.to(torch.int64)[live]

    storage.slot_fp[slot] = fingerprint(record.row_tag[row], pos, token, owner.salt)
    storage.slot_writer[slot] = pack_writer(row, pos)
    if w.record_tokens:
        col = pos + owner.token_offset
        fits = (col >= 0) & (col < record.token_at.shape[1])
        record.token_at[row[fits], col[fits]] = token[fits].to(torch.int32)


def verify_fingerprints(
    record: RequestRecord,
    storage: FingerprintGroup,
    owner: FingerprintGroup,
    c: FingerprintCheck,
    sink: ViolationSink,
) -> None:
    """Check slots req_to_token[row, :verify_len] of every live batch row; record mismatches.

    Own positions (>= row_own_from) must carry exactly fp(tag, p, token_at[row, p + offset]).
    Borrowed positions must carry some live fingerprint written for position p.
    """
    if int(c.verify_on[0]) == 0:
        return
    bs = c.req_pool_indices.numel()
    live_rows = min(int(c.live_rows[0]), bs)
    width = record.token_at.shape[1]
    for b in range(live_rows):
        n = int(c.verify_lens[b])
        if n <= 0:
            continue
        row = int(c.req_pool_indices[b])
        pos = torch.arange(n, dtype=torch.int64, device=storage.slot_fp.device)
        slot = record.req_to_token[row, :n].to(torch.int64)
        found = storage.slot_fp[slot]
        writer = storage.slot_writer[slot]

        own = pos >= int(record.row_own_from[row])
        col = pos + owner.token_offset
        readable = own & (col < width)
        token = torch.full_like(pos, -1)
        token[readable] = record.token_at[row, col[readable]].to(torch.int64)
        expected = fingerprint(record.row_tag[row], pos, token, owner.salt)

        bad_own = own & (found != expected)
        bad_borrowed = ~own & (((found & 1) == 0) | ((writer & _LOW32) != pos))
        bad = (bad_own | bad_borrowed).nonzero().flatten()

        for i in bad.tolist():
            index = int(sink.count[0])
            sink.count[0] += 1
            if index >= sink.capacity:
                continue
            borrowed = not bool(own[i])
            sink.records[index] = torch.tensor(
                [
                    b,
                    row,
                    i,
                    int(slot[i]),
                    0 if borrowed else int(expected[i]),
                    int(found[i]),
                    -1 if borrowed else int(token[i]),
                    int(writer[i]),
                ],
                dtype=torch.int64,
            )
        sink.checks[0] += n
