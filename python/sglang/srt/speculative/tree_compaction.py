"""Spec v2 tree drafting: move the accepted tree path to the front of each request's block.

Verify lays out every request's draft tree as one block of num_draft_tokens rows: row
`b * num_draft_tokens + j` holds tree node j of request b, in predict / hidden_states and in
the KV slot `req_to_token[req, seq_len + j]` that verify wrote. Acceptance walks a path
`accept_index[b, :accept_len]` through that block (node 0, the root, first).

Everything after verify is chain-shaped: the scheduler reads request b's tokens from the first
accept_len rows of its block, draft-extend takes the last accepted row as
`b * num_draft_tokens + accept_len - 1`, and the next round treats KV positions
seq_len .. seq_len + accept_len - 1 as committed. A chain's accepted path already is that
prefix; a tree's is not, so after verify the path's rows and KV slots are copied to the front
of the block. Rows past the path are left as they are: nothing reads them, and their slots
stay allocated to the request (spec v2 over-allocates each request's block) and are
overwritten by the next round.

The next round drafts from each request's bonus token, the last accepted one: compaction
returns it too (bonus_tokens: [bs] int32), as it knows where each path ends.

Per-token captures of the verify forward (routed experts, the NSA indexer's top-k; see
sglang.srt.speculative.verify_captures) are rows in the same layout until the scheduler writes
row r to its host cache at KV slot out_cache_loc[r]. They move with predict and hidden_states,
so that each committed slot ends up with its accepted node's capture, like its KV.

All operations are fixed-size and sync-free. On CUDA one triton kernel moves predict,
hidden_states and the captures, writes the KV slot moves and the bonus tokens, and the pool moves
the KV: at
bs 1 the decode loop is bound by kernel launches on the host, so the ~20 small torch ops of the
plain version (plan_accepted_path_moves + compact_rows + bonus_tokens_of_compacted, kept as the
reference and the CPU path) cost tok/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
import triton
import triton.language as tl

from sglang.srt import kv_canary


class MovableKVPool(Protocol):
    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class AcceptedPathMoves:
    """Row moves that put each request's accepted path at the front of its block.

    Rows index the flat verify layout [bs * num_draft_tokens]. Entry (b, i) copies row
    src_rows[b * max_accept + i] to row dst_rows[b * max_accept + i] = b * num_draft_tokens + i.
    """

    # [bs * max_accept], int64
    dst_rows: torch.Tensor
    # [bs * max_accept], int64; equal to dst_rows past the accepted path
    src_rows: torch.Tensor

    @classmethod
    def make_dummy(cls, bs: int, max_accept: int, num_draft_tokens: int, device="cpu"):
        """Identity moves (nothing accepted past the root), for tests."""
        rows = _front_rows(
            bs, max_accept, num_draft_tokens, torch.device(device)
        ).flatten()
        return cls(dst_rows=rows, src_rows=rows.clone())


def _front_rows(
    bs: int, max_accept: int, num_draft_tokens: int, device
) -> torch.Tensor:
    # [bs, max_accept]: row b * num_draft_tokens + i
    block_start = torch.arange(bs, dtype=torch.int64, device=device) * num_draft_tokens
    return block_start[:, None] + torch.arange(
        max_accept, dtype=torch.int64, device=device
    )


def _check_path_fits(max_accept: int, num_draft_tokens: int) -> None:
    if max_accept > num_draft_tokens:
        raise ValueError(
            f"an accepted path of up to {max_accept} nodes does not fit a block of "
            f"{num_draft_tokens} draft tokens"
        )


def plan_accepted_path_moves(
    accept_index: torch.Tensor, num_draft_tokens: int
) -> AcceptedPathMoves:
    """accept_index: [bs, max_accept] flat rows of the accepted path, -1 past its end."""
    bs, max_accept = accept_index.shape
    _check_path_fits(max_accept, num_draft_tokens)
    front = _front_rows(bs, max_accept, num_draft_tokens, accept_index.device)
    path = accept_index.to(torch.int64)
    src = torch.where(path >= 0, path, front)
    return AcceptedPathMoves(dst_rows=front.flatten(), src_rows=src.flatten())


def bonus_tokens_of_compacted(
    accept_index: torch.Tensor, num_draft_tokens: int, predict: torch.Tensor
) -> torch.Tensor:
    """[bs] int32: each request's last accepted token, read from compacted predict (row
    b * num_draft_tokens + accept_len - 1). Verify always accepts the root, so accept_len >= 1;
    a row of only -1 reads the root's row."""
    bs = accept_index.shape[0]
    accept_len = (accept_index >= 0).sum(dim=1).clamp_(min=1)
    block_start = (
        torch.arange(bs, dtype=torch.int64, device=predict.device) * num_draft_tokens
    )
    return predict.index_select(0, block_start + accept_len - 1).to(torch.int32)


def compact_rows(rows: torch.Tensor, moves: AcceptedPathMoves) -> None:
    """rows[dst] = rows[src] in place, for a tensor laid out [bs * num_draft_tokens, ...].

    The gather completes before the scatter, so a row that is both a source and a
    destination (a path that skips one node: sources shift down by one) is read first.
    """
    rows.index_copy_(0, moves.dst_rows, rows.index_select(0, moves.src_rows))


# Row tensors (hidden states and captures) one kernel launch moves; more fall back to torch.
MAX_FUSED_ROW_TENSORS = 3
_ROW_TILE = 256


@dataclass(frozen=True)
class RowLayout:
    """Where a row tensor's elements lie: element (row, col) of its [rows, num_cols] view is at
    row * row_stride + (col // inner_size) * outer_stride + (col % inner_size) * inner_stride.

    Covers [rows, n] and [rows, a, b] tensors of any strides, so a column slice of a wider
    buffer (the capturers' device caches are sliced to topk_size columns) moves in place.
    """

    row_stride: int
    inner_size: int
    outer_stride: int
    inner_stride: int
    num_cols: int

    @classmethod
    def of(cls, rows: torch.Tensor) -> "RowLayout":
        if rows.dim() == 2:
            return cls(
                rows.stride(0), max(rows.shape[1], 1), 0, rows.stride(1), rows.shape[1]
            )
        if rows.dim() == 3:
            return cls(
                rows.stride(0),
                max(rows.shape[2], 1),
                rows.stride(1),
                rows.stride(2),
                rows.shape[1] * rows.shape[2],
            )
        raise ValueError(
            f"a row tensor to compact must be [rows, n] or [rows, a, b], got shape "
            f"{tuple(rows.shape)}"
        )


@triton.jit
def _move_row_tile(
    rows_ptr,
    src,  # [MAX_ACCEPT_POW2] int64 source row of each path slot
    dst,  # [MAX_ACCEPT_POW2] int64 target row
    moves,  # [MAX_ACCEPT_POW2] bool: the slot's row moves
    tile,
    row_stride,
    inner_size,
    outer_stride,
    inner_stride,
    num_cols,
    BLOCK: tl.constexpr,
):
    """rows[dst] = rows[src] for columns [tile * BLOCK, (tile + 1) * BLOCK) (RowLayout)."""
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    col_offsets = (cols // inner_size) * outer_stride + (
        cols % inner_size
    ) * inner_stride
    mask = moves[:, None] & (cols < num_cols)[None, :]
    gathered = tl.load(
        rows_ptr + src[:, None] * row_stride + col_offsets[None, :], mask=mask
    )
    # Every source of this tile is read before any target is written (a path that skips a
    # node has rows that are both).
    tl.debug_barrier()
    tl.store(
        rows_ptr + dst[:, None] * row_stride + col_offsets[None, :], gathered, mask=mask
    )


# The path's index tensors and lengths, which a step's compile must not depend on: the
# verify's KV slots are a slice of the allocator's free list (its alignment changes from step
# to step) and the lengths change with the shape, so Triton's specialisation on them compiled
# the kernel again in the middle of serving (102 ms at a policy's wide-tree step on a host
# without Triton's cache). The row tensors keep theirs: moving their columns is the bulk of
# the work, and their pointers and strides are fixed by the model.
_PATH_INDEX_ARGS = [
    "accept_index_ptr",
    "out_cache_loc_ptr",
    "predict_ptr",
    "tgt_slots_ptr",
    "src_slots_ptr",
    "bonus_ptr",
]


@triton.jit(
    do_not_specialize=["max_accept", "num_draft_tokens"],
    do_not_specialize_on_alignment=_PATH_INDEX_ARGS,
)
def _compact_accepted_path_kernel(
    accept_index_ptr,  # [bs, max_accept] flat rows of the path, -1 past its end
    out_cache_loc_ptr,  # [bs * num_draft_tokens] KV slot of each row
    predict_ptr,  # [bs * num_draft_tokens]
    tgt_slots_ptr,  # [bs * max_accept] out
    src_slots_ptr,  # [bs * max_accept] out
    bonus_ptr,  # [bs] out: the last accepted token
    # Up to three row tensors [bs * num_draft_tokens, ...] (hidden states, captures), each
    # with its RowLayout; unused without HAS_ROWS_i.
    rows0_ptr,
    rows0_row_stride,
    rows0_inner_size,
    rows0_outer_stride,
    rows0_inner_stride,
    rows0_num_cols,
    rows1_ptr,
    rows1_row_stride,
    rows1_inner_size,
    rows1_outer_stride,
    rows1_inner_stride,
    rows1_num_cols,
    rows2_ptr,
    rows2_row_stride,
    rows2_inner_size,
    rows2_outer_stride,
    rows2_inner_stride,
    rows2_num_cols,
    max_accept,
    num_draft_tokens,
    MAX_ACCEPT_POW2: tl.constexpr,
    HAS_ROWS0: tl.constexpr,
    HAS_ROWS1: tl.constexpr,
    HAS_ROWS2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (b, t): request b's path rows, columns [t * BLOCK, (t + 1) * BLOCK) of every
    row tensor.

    Every program gathers all of its sources before a barrier and scatters after it, so a row
    that is both a source and a target (a path that skips a node) is read first. Requests'
    blocks are disjoint and column tiles split rows, so programs never share an element.
    """
    b = tl.program_id(0)
    tile = tl.program_id(1)
    i = tl.arange(0, MAX_ACCEPT_POW2)
    on_path_slot = i < max_accept
    path = tl.load(
        accept_index_ptr + b * max_accept + i, mask=on_path_slot, other=-1
    ).to(tl.int64)
    dst = b.to(tl.int64) * num_draft_tokens + i
    moves = on_path_slot & (path >= 0) & (path != dst)
    src = tl.where(moves, path, dst)

    if tile == 0:
        tl.store(
            tgt_slots_ptr + b * max_accept + i,
            tl.load(out_cache_loc_ptr + dst, mask=on_path_slot),
            mask=on_path_slot,
        )
        tl.store(
            src_slots_ptr + b * max_accept + i,
            tl.load(out_cache_loc_ptr + src, mask=on_path_slot),
            mask=on_path_slot,
        )
        tokens = tl.load(predict_ptr + src, mask=on_path_slot)
        accept_len = tl.maximum(
            tl.sum((on_path_slot & (path >= 0)).to(tl.int32), axis=0), 1
        )
        tl.store(
            bonus_ptr + b, tl.sum(tl.where(i == accept_len - 1, tokens, 0), axis=0)
        )
        tl.debug_barrier()
        tl.store(predict_ptr + dst, tokens, mask=moves)

    if HAS_ROWS0:
        _move_row_tile(
            rows0_ptr,
            src,
            dst,
            moves,
            tile,
            rows0_row_stride,
            rows0_inner_size,
            rows0_outer_stride,
            rows0_inner_stride,
            rows0_num_cols,
            BLOCK,
        )
    if HAS_ROWS1:
        _move_row_tile(
            rows1_ptr,
            src,
            dst,
            moves,
            tile,
            rows1_row_stride,
            rows1_inner_size,
            rows1_outer_stride,
            rows1_inner_stride,
            rows1_num_cols,
            BLOCK,
        )
    if HAS_ROWS2:
        _move_row_tile(
            rows2_ptr,
            src,
            dst,
            moves,
            tile,
            rows2_row_stride,
            rows2_inner_size,
            rows2_outer_stride,
            rows2_inner_stride,
            rows2_num_cols,
            BLOCK,
        )


def _row_tensors(
    hidden_states: Optional[torch.Tensor],
    captures: Sequence[torch.Tensor],
    num_rows: int,
) -> list[torch.Tensor]:
    """hidden_states (when captured) and the captures, each checked to hold one row per verify
    row: a capture of other rows would be compacted along the wrong rows."""
    row_tensors = ([hidden_states] if hidden_states is not None else []) + list(
        captures
    )
    for rows in row_tensors:
        if rows.shape[0] != num_rows:
            raise ValueError(
                f"a row tensor of shape {tuple(rows.shape)} to compact along the accepted path "
                f"does not have the verify's {num_rows} rows"
            )
    return row_tensors


def compact_path_rows_reference(
    accept_index: torch.Tensor,
    num_draft_tokens: int,
    verify_out_cache_loc: torch.Tensor,
    predict: torch.Tensor,
    hidden_states: Optional[torch.Tensor],
    captures: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch: compact predict, hidden_states and the captures in place; return the KV
    slot moves (tgt, src), each [bs * max_accept] int64, identity past the path, and the bonus
    tokens [bs] int32."""
    row_tensors = _row_tensors(hidden_states, captures, verify_out_cache_loc.shape[0])
    moves = plan_accepted_path_moves(accept_index, num_draft_tokens)
    compact_rows(predict, moves)
    for rows in row_tensors:
        compact_rows(rows, moves)
    return (
        verify_out_cache_loc.index_select(0, moves.dst_rows).to(torch.int64),
        verify_out_cache_loc.index_select(0, moves.src_rows).to(torch.int64),
        bonus_tokens_of_compacted(accept_index, num_draft_tokens, predict),
    )


def _row_tensor_args(rows: Optional[torch.Tensor], placeholder: torch.Tensor) -> list:
    if rows is None:
        return [placeholder, 0, 1, 0, 0, 0]
    layout = RowLayout.of(rows)
    return [
        rows,
        layout.row_stride,
        layout.inner_size,
        layout.outer_stride,
        layout.inner_stride,
        layout.num_cols,
    ]


def compact_path_rows_triton(
    accept_index: torch.Tensor,
    num_draft_tokens: int,
    verify_out_cache_loc: torch.Tensor,
    predict: torch.Tensor,
    hidden_states: Optional[torch.Tensor],
    captures: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compact_path_rows_reference in one kernel launch (up to MAX_FUSED_ROW_TENSORS row
    tensors; more, which no verify produces today, are moved by torch afterwards)."""
    bs, max_accept = accept_index.shape
    _check_path_fits(max_accept, num_draft_tokens)
    row_tensors = _row_tensors(hidden_states, captures, verify_out_cache_loc.shape[0])
    fused, unfused = (
        row_tensors[:MAX_FUSED_ROW_TENSORS],
        row_tensors[MAX_FUSED_ROW_TENSORS:],
    )
    tgt_slots, src_slots = torch.empty(
        (2, bs * max_accept), dtype=torch.int64, device=accept_index.device
    )
    bonus_tokens = torch.empty(bs, dtype=torch.int32, device=accept_index.device)
    if bs == 0:
        return tgt_slots, src_slots, bonus_tokens
    num_tiles = max(
        [triton.cdiv(RowLayout.of(rows).num_cols, _ROW_TILE) for rows in fused] + [1]
    )
    slots = fused + [None] * (MAX_FUSED_ROW_TENSORS - len(fused))
    row_args = [arg for rows in slots for arg in _row_tensor_args(rows, predict)]
    _compact_accepted_path_kernel[(bs, num_tiles)](
        accept_index,
        verify_out_cache_loc,
        predict,
        tgt_slots,
        src_slots,
        bonus_tokens,
        *row_args,
        max_accept,
        num_draft_tokens,
        MAX_ACCEPT_POW2=triton.next_power_of_2(max_accept),
        HAS_ROWS0=slots[0] is not None,
        HAS_ROWS1=slots[1] is not None,
        HAS_ROWS2=slots[2] is not None,
        BLOCK=_ROW_TILE,
    )
    if unfused:
        moves = plan_accepted_path_moves(accept_index, num_draft_tokens)
        for rows in unfused:
            compact_rows(rows, moves)
    return tgt_slots, src_slots, bonus_tokens


def compact_accepted_tree_path(
    *,
    accept_index: torch.Tensor,
    num_draft_tokens: int,
    verify_out_cache_loc: torch.Tensor,
    kv_pool: MovableKVPool,
    predict: torch.Tensor,
    hidden_states: Optional[torch.Tensor],
    captures: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Compact KV slots, predict, hidden_states (when captured) and the verify's per-token
    captures along the accepted paths; return the bonus tokens, [bs] int32.

    accept_index: [bs, max_accept]; verify_out_cache_loc: [bs * num_draft_tokens], the KV slot
    verify wrote for each row; predict: [bs * num_draft_tokens]; hidden_states:
    [bs * num_draft_tokens, hidden] or None; captures: [bs * num_draft_tokens, ...] each, rows
    that the scheduler writes to KV slot verify_out_cache_loc[row] later
    (verify_captures.verify_capture_rows). predict, hidden_states and the captures change in
    place.
    """
    compact = (
        compact_path_rows_triton if predict.is_cuda else compact_path_rows_reference
    )
    tgt_slots, src_slots, bonus_tokens = compact(
        accept_index,
        num_draft_tokens,
        verify_out_cache_loc,
        predict,
        hidden_states,
        captures,
    )
    kv_pool.move_kv_cache(tgt_slots, src_slots)
    # The KV canary's fingerprints travel with the K/V they describe (no-op when off).
    kv_canary.on_kv_move(kv_pool, tgt_slots, src_slots)
    return bonus_tokens
