"""Fused triton stage, write and verify kernels; reference.py is their specification.

Stage runs outside graphs, once per bracket (one forward, or one graph replay of several), and
replaces a dozen small torch ops: at batch size 1 the decode loop is bound by host launches, so
each launch saved is time saved. Write and verify are CUDA-graph safe: grids depend only on
tensor shapes (fixed for a captured batch size), every per-forward value (live rows, prefix
lengths, the sampling switch) is read from device memory, and violations go to a
fixed-capacity device buffer through an atomic counter. Nothing here reads a value back to
the host.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sglang.srt.kv_canary.contract import (
    RECORD_WIDTH,
    FingerprintCheck,
    FingerprintWrite,
    ForwardPlan,
    PlanBuffers,
    ViolationSink,
    ViolationSinks,
)
from sglang.srt.kv_canary.tables import FingerprintGroup, RequestRecord

STAGE_BLOCK = 128
WRITE_BLOCK = 128
VERIFY_BLOCK = 128
# Programs per request row in verify: a long prefix is split across them in strided blocks.
VERIFY_SPLITS = 4


@triton.jit
def _mix64(x):
    # splitmix64 finaliser, logical shifts as shift-and-mask (fingerprint.mix64)
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * -4658895280553007687
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * -7723592293110705685
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


@triton.jit
def _fingerprint(tag, pos, token, salt):
    inner = _mix64((pos << 32) ^ (token & 0xFFFFFFFF) ^ salt)
    return _mix64(inner ^ tag) | 1


@triton.jit
def _stage_block(
    start,
    tokens_before,
    positions,
    extend_seq_lens,
    verify_lens,
    bs,
    tokens_per_row,
    speculative_tail,
    VARIABLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """verify_lens for batch rows [start, start + BLOCK); returns the tokens of rows < start + BLOCK."""
    b = start + tl.arange(0, BLOCK)
    in_range = b < bs
    if VARIABLE:
        lens = tl.load(extend_seq_lens + b, mask=in_range, other=0).to(tl.int64)
        first = tokens_before + tl.cumsum(lens, 0) - lens
        tokens_before += tl.sum(lens, 0)
    else:
        first = b.to(tl.int64) * tokens_per_row
    prefix = tl.load(positions + first, mask=in_range, other=0).to(tl.int64)
    tl.store(
        verify_lens + b,
        tl.maximum(prefix - speculative_tail, 0).to(tl.int32),
        mask=in_range,
    )
    return tokens_before


@triton.jit
def _stage_kernel(
    positions,  # [n]
    extend_seq_lens,  # [>= bs], or a dummy when VARIABLE is False
    verify_lens,  # [max_rows] int32
    live_rows,  # [1] int32
    verify_on,  # [1] int32
    sinks,  # [NUM_SINKS, 1 + capacity, RECORD_WIDTH] int64: row 0 of each is zeroed
    sink_stride,
    bs,
    tokens_per_row,
    speculative_tail,
    verify,
    NUM_SINKS: tl.constexpr,  # fixed per manager: one compiled variant each
    VARIABLE: tl.constexpr,
    BLOCK: tl.constexpr,
    DYNAMIC_BOUND: tl.constexpr,  # as in _verify_kernel: the interpreter needs a static bound
    STATIC_ITERS: tl.constexpr,
):
    # One program: rows of varying length need a running sum of lengths across blocks.
    tokens_before = tl.zeros((1,), dtype=tl.int64)
    if DYNAMIC_BOUND:
        for start in range(0, bs, BLOCK):
            tokens_before = _stage_block(
                start,
                tokens_before,
                positions,
                extend_seq_lens,
                verify_lens,
                bs,
                tokens_per_row,
                speculative_tail,
                VARIABLE,
                BLOCK,
            )
    else:
        for it in range(STATIC_ITERS):
            tokens_before = _stage_block(
                it * BLOCK,
                tokens_before,
                positions,
                extend_seq_lens,
                verify_lens,
                bs,
                tokens_per_row,
                speculative_tail,
                VARIABLE,
                BLOCK,
            )
    tl.store(live_rows, bs)
    tl.store(verify_on, verify)
    for i in tl.static_range(NUM_SINKS):
        tl.store(
            sinks + i * sink_stride + tl.arange(0, 2), tl.zeros((2,), dtype=tl.int64)
        )


@triton.jit
def _write_kernel(
    slot_fp,  # [num_slots] int64
    slot_writer,  # [num_slots] int64
    token_at,  # [rows, token_at_width] int32
    row_tag,  # [rows] int64
    out_cache_loc,  # [n]
    positions,  # [n]
    input_ids,  # [n]
    req_pool_indices,  # [bs]
    token_batch_rows,  # [n] or a dummy when HAS_ROW_MAP is False
    live_rows,  # [1] int32
    n,
    tokens_per_row,
    token_at_stride,
    token_at_width,
    salt,
    token_offset,
    HAS_ROW_MAP: tl.constexpr,
    RECORD_TOKENS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = j < n
    if HAS_ROW_MAP:
        batch_row = tl.load(token_batch_rows + j, mask=in_range, other=0).to(tl.int64)
    else:
        batch_row = (j // tokens_per_row).to(tl.int64)
    live = in_range & (batch_row < tl.load(live_rows).to(tl.int64))

    row = tl.load(req_pool_indices + batch_row, mask=live, other=0).to(tl.int64)
    pos = tl.load(positions + j, mask=live, other=0).to(tl.int64)
    token = tl.load(input_ids + j, mask=live, other=0).to(tl.int64)
    slot = tl.load(out_cache_loc + j, mask=live, other=0).to(tl.int64)
    tag = tl.load(row_tag + row, mask=live, other=0)

    tl.store(slot_fp + slot, _fingerprint(tag, pos, token, salt), mask=live)
    tl.store(slot_writer + slot, (row << 32) | (pos & 0xFFFFFFFF), mask=live)
    if RECORD_TOKENS:
        col = pos + token_offset
        fits = live & (col >= 0) & (col < token_at_width)
        tl.store(token_at + row * token_at_stride + col, token.to(tl.int32), mask=fits)


@triton.jit
def _verify_block(
    start,
    n,
    batch_row,
    row,
    tag,
    own_from,
    slot_fp,
    slot_writer,
    token_at,
    req_to_token,
    records,
    count,
    req_to_token_stride,
    token_at_stride,
    token_at_width,
    capacity,
    salt,
    token_offset,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Check positions [start, start + BLOCK) of one row; record the bad ones."""
    pos = start + tl.arange(0, BLOCK)
    in_range = pos < n
    slot = tl.load(
        req_to_token + row * req_to_token_stride + pos, mask=in_range, other=0
    ).to(tl.int64)
    found = tl.load(slot_fp + slot, mask=in_range, other=0)
    writer = tl.load(slot_writer + slot, mask=in_range, other=0)

    own = pos >= own_from
    col = pos + token_offset
    readable = in_range & own & (col < token_at_width)
    token = tl.load(token_at + row * token_at_stride + col, mask=readable, other=-1).to(
        tl.int64
    )
    expected = _fingerprint(tag, pos.to(tl.int64), token, salt)

    bad_own = own & (found != expected)
    bad_borrowed = (~own) & (((found & 1) == 0) | ((writer & 0xFFFFFFFF) != pos))
    bad = in_range & (bad_own | bad_borrowed)

    index = tl.atomic_add(count + tl.zeros_like(pos), 1, mask=bad)
    keep = bad & (index < capacity)
    record = records + index * WIDTH
    zero = tl.zeros_like(pos).to(tl.int64)
    tl.store(record + 0, zero + batch_row, mask=keep)
    tl.store(record + 1, zero + row, mask=keep)
    tl.store(record + 2, pos.to(tl.int64), mask=keep)
    tl.store(record + 3, slot, mask=keep)
    tl.store(record + 4, tl.where(own, expected, 0), mask=keep)
    tl.store(record + 5, found, mask=keep)
    tl.store(record + 6, tl.where(own, token, -1), mask=keep)
    tl.store(record + 7, writer, mask=keep)


@triton.jit
def _verify_kernel(
    slot_fp,  # [num_slots] int64
    slot_writer,  # [num_slots] int64
    token_at,  # [rows, token_at_width] int32
    row_tag,  # [rows] int64
    row_own_from,  # [rows] int32
    req_to_token,  # [rows, context_len] int32
    req_pool_indices,  # [bs]
    verify_lens,  # [>= bs] int32
    live_rows,  # [1] int32
    verify_on,  # [1] int32
    records,  # [capacity, RECORD_WIDTH] int64
    count,  # [1] int64
    checks,  # [1] int64
    req_to_token_stride,
    token_at_stride,
    token_at_width,
    capacity,
    salt,
    token_offset,
    WIDTH: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    # Compiled: loop up to the row's prefix length. The interpreter cannot take a loaded value
    # as a loop bound (numpy >= 2.5 refuses 1-element arrays as scalars), so it walks a static
    # bound covering the whole context and relies on the masks.
    DYNAMIC_BOUND: tl.constexpr,
    STATIC_ITERS: tl.constexpr,
):
    batch_row = tl.program_id(0)
    split = tl.program_id(1)
    active = (tl.load(verify_on) != 0) & (batch_row < tl.load(live_rows))
    n = tl.where(active, tl.load(verify_lens + batch_row), 0)
    # padding rows may hold any row index: read nothing through them
    row = tl.load(req_pool_indices + batch_row, mask=active, other=0).to(tl.int64)
    tag = tl.load(row_tag + row, mask=active, other=0)
    own_from = tl.load(row_own_from + row, mask=active, other=0)

    if DYNAMIC_BOUND:
        for start in range(split * BLOCK, n, SPLITS * BLOCK):
            _verify_block(
                start,
                n,
                batch_row,
                row,
                tag,
                own_from,
                slot_fp,
                slot_writer,
                token_at,
                req_to_token,
                records,
                count,
                req_to_token_stride,
                token_at_stride,
                token_at_width,
                capacity,
                salt,
                token_offset,
                WIDTH,
                BLOCK,
            )
    else:
        for it in range(STATIC_ITERS):
            _verify_block(
                (it * SPLITS + split) * BLOCK,
                n,
                batch_row,
                row,
                tag,
                own_from,
                slot_fp,
                slot_writer,
                token_at,
                req_to_token,
                records,
                count,
                req_to_token_stride,
                token_at_stride,
                token_at_width,
                capacity,
                salt,
                token_offset,
                WIDTH,
                BLOCK,
            )

    tl.atomic_add(checks, n.to(tl.int64), mask=split == 0)


def stage_plan(plan: ForwardPlan, buffers: PlanBuffers, sinks: ViolationSinks) -> None:
    variable = plan.extend_seq_lens is not None
    _stage_kernel[(1,)](
        plan.positions,
        plan.extend_seq_lens if variable else plan.positions,
        buffers.verify_lens,
        buffers.live_rows,
        buffers.verify_on,
        sinks.storage,
        sinks.storage.stride(0),
        plan.batch_size,
        max(plan.tokens_per_row, 1),
        plan.speculative_tail,
        int(plan.verify),
        NUM_SINKS=sinks.num_sinks,
        VARIABLE=variable,
        BLOCK=STAGE_BLOCK,
        DYNAMIC_BOUND=not _interpreted(),
        STATIC_ITERS=triton.cdiv(buffers.verify_lens.numel(), STAGE_BLOCK),
    )


def write_fingerprints(
    record: RequestRecord,
    storage: FingerprintGroup,
    owner: FingerprintGroup,
    w: FingerprintWrite,
) -> None:
    n = w.num_tokens
    if n == 0:
        return
    row_map = w.token_batch_rows
    _write_kernel[(triton.cdiv(n, WRITE_BLOCK),)](
        storage.slot_fp,
        storage.slot_writer,
        record.token_at,
        record.row_tag,
        w.out_cache_loc,
        w.positions,
        w.input_ids,
        w.req_pool_indices,
        row_map if row_map is not None else w.live_rows,
        w.live_rows,
        n,
        max(w.tokens_per_row, 1),
        record.token_at.stride(0),
        record.token_at.shape[1],
        owner.salt,
        owner.token_offset,
        HAS_ROW_MAP=row_map is not None,
        RECORD_TOKENS=w.record_tokens,
        BLOCK=WRITE_BLOCK,
    )


def verify_fingerprints(
    record: RequestRecord,
    storage: FingerprintGroup,
    owner: FingerprintGroup,
    c: FingerprintCheck,
    sink: ViolationSink,
) -> None:
    bs = c.req_pool_indices.numel()
    if bs == 0:
        return
    _verify_kernel[(bs, VERIFY_SPLITS)](
        storage.slot_fp,
        storage.slot_writer,
        record.token_at,
        record.row_tag,
        record.row_own_from,
        record.req_to_token,
        c.req_pool_indices,
        c.verify_lens,
        c.live_rows,
        c.verify_on,
        sink.records,
        sink.count,
        sink.checks,
        record.req_to_token.stride(0),
        record.token_at.stride(0),
        record.token_at.shape[1],
        sink.capacity,
        owner.salt,
        owner.token_offset,
        WIDTH=RECORD_WIDTH,
        SPLITS=VERIFY_SPLITS,
        BLOCK=VERIFY_BLOCK,
        DYNAMIC_BOUND=not _interpreted(),
        STATIC_ITERS=triton.cdiv(
            record.req_to_token.shape[1], VERIFY_SPLITS * VERIFY_BLOCK
        ),
    )


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def is_usable_on(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    return device.type == "cuda" or _interpreted()
