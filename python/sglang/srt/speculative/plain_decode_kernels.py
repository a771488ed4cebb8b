"""A `none` step's ring push (plain_decode_steps.DraftRowRing) in one triton launch.

A `none` step is a plain engine's decode step plus what spec v2 needs around it, and on a
host-bound target a plain engine's step is bound by the host's launches. Pushing each
request's owed row in plain torch is advanced indexing (a gather of the rings' fill, two
indexed writes, an indexed update of the fill: several launches each); on CUDA one kernel does
it, and the torch version is the reference and the CPU path. The step's other small ops stay
torch: a triton launch costs the host more than the four torch ops that build the DECODE
inputs (docs/benchmarks.md, "Build e8987ba8").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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


@triton.jit
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
