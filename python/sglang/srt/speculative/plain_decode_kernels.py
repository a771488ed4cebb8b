"""The small device ops around a `none` step's DECODE graph (plain_decode_steps), one triton
launch per group.

A `none` step is a plain engine's decode step plus what spec v2 needs around it: the DECODE
inputs built from the spec v2 batch (each request's carried bonus token, at position seq_len,
into the KV slot spec v2 allocated there) and the owed row pushed onto each request's ring.
On a host-bound target a plain engine's step is bound by the host's launches, and in plain
torch these groups are several launches each (advanced indexing alone is several): one
kernel each costs the host 8-19 us less a step (benchmark/spec/host_op_costs.py,
docs/benchmarks.md). The plain torch versions are the references and the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang.srt.utils.eager_jit import eager_jit

# ----------------------------------------------------------------------------- DECODE inputs


@dataclass(frozen=True)
class DecodeInputs:
    """A `none` step's DECODE batch fields, for a spec v2 batch of bs requests."""

    # [bs] int64: each request's carried bonus token, decoded at position seq_len
    input_ids: torch.Tensor
    # [bs] int64: the KV slot of position seq_len, req_to_token[req_pool_indices, seq_lens]
    out_cache_loc: torch.Tensor
    # [bs], seq_lens' dtype: seq_lens + 1, the lengths once that token is in
    seq_lens: torch.Tensor


def decode_inputs_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
) -> DecodeInputs:
    """req_to_token: [rows, max_context]; req_pool_indices, seq_lens, bonus_tokens: [bs]."""
    return DecodeInputs(
        input_ids=bonus_tokens.to(torch.int64),
        out_cache_loc=req_to_token[req_pool_indices, seq_lens].to(torch.int64),
        seq_lens=seq_lens + 1,
    )


@eager_jit
def _decode_inputs_kernel(
    req_to_token_ptr,
    req_to_token_stride,
    req_pool_indices_ptr,
    seq_lens_ptr,
    bonus_tokens_ptr,
    ids_and_locs_ptr,  # [2, bs] int64: input_ids, then out_cache_loc
    new_seq_lens_ptr,
    bs,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < bs
    row = tl.load(req_pool_indices_ptr + offs, mask=mask, other=0).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + offs, mask=mask, other=0)
    loc = tl.load(
        req_to_token_ptr + row * req_to_token_stride + seq_len, mask=mask, other=0
    )
    bonus = tl.load(bonus_tokens_ptr + offs, mask=mask, other=0)
    tl.store(ids_and_locs_ptr + offs, bonus.to(tl.int64), mask=mask)
    tl.store(ids_and_locs_ptr + bs + offs, loc.to(tl.int64), mask=mask)
    tl.store(new_seq_lens_ptr + offs, seq_len + 1, mask=mask)


_DECODE_INPUTS_BLOCK = 256


def decode_inputs_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
) -> DecodeInputs:
    bs = seq_lens.shape[0]
    ids_and_locs = torch.empty((2, bs), dtype=torch.int64, device=seq_lens.device)
    new_seq_lens = torch.empty_like(seq_lens)
    if bs > 0:
        grid = (triton.cdiv(bs, _DECODE_INPUTS_BLOCK),)
        _decode_inputs_kernel[grid](
            req_to_token,
            req_to_token.stride(0),
            req_pool_indices,
            seq_lens,
            bonus_tokens,
            ids_and_locs,
            new_seq_lens,
            bs,
            BLOCK=_DECODE_INPUTS_BLOCK,
        )
    return DecodeInputs(ids_and_locs[0], ids_and_locs[1], new_seq_lens)


def decode_inputs(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
) -> DecodeInputs:
    run = decode_inputs_triton if seq_lens.is_cuda else decode_inputs_reference
    return run(req_to_token, req_pool_indices, seq_lens, bonus_tokens)


# ----------------------------------------------------------------------------- ring push


def push_rows_reference(
    ring_hidden: torch.Tensor,
    ring_tokens: torch.Tensor,
    lag: torch.Tensor,
    slots: torch.Tensor,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
) -> None:
    """Append one row per request to its slot's ring, in place: ring_hidden [num_slots,
    width, hidden], ring_tokens [num_slots, width], lag [num_slots] (rows each ring holds);
    slots [bs] (distinct request slots), hidden [bs, hidden], tokens [bs]. Nothing checks
    that a ring has room: the caller catches up before any lag reaches width."""
    column = lag[slots]
    ring_hidden[slots, column] = hidden.to(ring_hidden.dtype)
    ring_tokens[slots, column] = tokens.to(ring_tokens.dtype)
    lag[slots] = column + 1


@eager_jit
def _push_rows_kernel(
    ring_hidden_ptr,
    ring_tokens_ptr,
    lag_ptr,
    slots_ptr,
    hidden_ptr,
    hidden_stride,
    tokens_ptr,
    width,
    HIDDEN: tl.constexpr,  # one per model: its loop unrolls to whole tiles
    BLOCK_H: tl.constexpr,
):
    # One program per request: slots are distinct, so no two programs touch one ring.
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    column = tl.load(lag_ptr + slot)
    row = slot * width + column
    src = hidden_ptr + b.to(tl.int64) * hidden_stride
    dst = ring_hidden_ptr + row * HIDDEN
    for start in range(0, HIDDEN, BLOCK_H):
        offs = start + tl.arange(0, BLOCK_H)
        mask = offs < HIDDEN
        values = tl.load(src + offs, mask=mask)
        tl.store(dst + offs, values.to(dst.dtype.element_ty), mask=mask)
    token = tl.load(tokens_ptr + b)
    tl.store(ring_tokens_ptr + row, token.to(ring_tokens_ptr.dtype.element_ty))
    tl.store(lag_ptr + slot, column + 1)


_PUSH_BLOCK_H = 1024


def push_rows_triton(
    ring_hidden: torch.Tensor,
    ring_tokens: torch.Tensor,
    lag: torch.Tensor,
    slots: torch.Tensor,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
) -> None:
    bs = slots.shape[0]
    if bs == 0:
        return
    assert hidden.stride(-1) == 1 and ring_hidden.is_contiguous()
    _push_rows_kernel[(bs,)](
        ring_hidden,
        ring_tokens,
        lag,
        slots,
        hidden,
        hidden.stride(0),
        tokens,
        ring_tokens.shape[1],
        HIDDEN=ring_hidden.shape[2],
        BLOCK_H=_PUSH_BLOCK_H,
    )


def push_rows(
    ring_hidden: torch.Tensor,
    ring_tokens: torch.Tensor,
    lag: torch.Tensor,
    slots: torch.Tensor,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
) -> None:
    run = push_rows_triton if lag.is_cuda else push_rows_reference
    run(ring_hidden, ring_tokens, lag, slots, hidden, tokens)


# ----------------------------------------------------------------------------- start-up


# The dtypes a `none` step's token tensors come in: sglang's sampler returns int64 token ids
# for a greedy batch (argmax) and int32 for a sampled one, and the carried bonus tokens keep
# the dtype of the step that made them.
TOKEN_DTYPES = (torch.int32, torch.int64)


def compile_kernels(
    req_to_token: torch.Tensor,
    ring_hidden: torch.Tensor,
    ring_tokens: torch.Tensor,
    lag: torch.Tensor,
) -> None:
    """Compile (or load from Triton's cache) every variant of the two kernels a `none` step
    launches, at start-up: one launch of each per token dtype, on scratch tensors of the
    dtypes and hidden width of the server's own (req_to_token, the ring's tensors). Compiled
    at the server's first `none` steps instead, each held every running request for about
    50 ms, and a batch first steps without speculation where it is large. The kernels do not
    specialise on alignment or integer values (eager_jit), so a scratch tensor selects the
    server's compile."""
    device = lag.device
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    seq_lens = torch.zeros(1, dtype=torch.int64, device=device)
    rows = torch.zeros(1, 1, dtype=req_to_token.dtype, device=device)
    hidden_size = ring_hidden.shape[2]
    # The target's hidden states, pushed in the dtype the ring was allocated with (the one
    # upstream gives the draft extend's hidden states).
    hidden = torch.zeros(1, hidden_size, dtype=ring_hidden.dtype, device=device)
    for dtype in TOKEN_DTYPES:
        tokens = torch.zeros(1, dtype=dtype, device=device)
        decode_inputs_triton(rows, slots, seq_lens, tokens)
        # A ring of one slot and one row per launch: the push fills it.
        push_rows_triton(
            torch.zeros(1, 1, hidden_size, dtype=ring_hidden.dtype, device=device),
            torch.zeros(1, 1, dtype=ring_tokens.dtype, device=device),
            torch.zeros(1, dtype=lag.dtype, device=device),
            slots,
            hidden,
            tokens,
        )
