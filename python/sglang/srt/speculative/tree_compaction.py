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

All operations are fixed-size and sync-free: rows that do not move copy onto themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

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
        """Identity moves (nothing accepted past the root), for tests and CUDA-graph warm-up."""
        rows = _front_rows(bs, max_accept, num_draft_tokens, torch.device(device)).flatten()
        return cls(dst_rows=rows, src_rows=rows.clone())


def _front_rows(bs: int, max_accept: int, num_draft_tokens: int, device) -> torch.Tensor:
    # [bs, max_accept]: row b * num_draft_tokens + i
    block_start = torch.arange(bs, dtype=torch.int64, device=device) * num_draft_tokens
    return block_start[:, None] + torch.arange(max_accept, dtype=torch.int64, device=device)


def plan_accepted_path_moves(accept_index: torch.Tensor, num_draft_tokens: int) -> AcceptedPathMoves:
    """accept_index: [bs, max_accept] flat rows of the accepted path, -1 past its end."""
    bs, max_accept = accept_index.shape
    if max_accept > num_draft_tokens:
        raise ValueError(
            f"an accepted path of up to {max_accept} nodes does not fit a block of "
            f"{num_draft_tokens} draft tokens"
        )
    front = _front_rows(bs, max_accept, num_draft_tokens, accept_index.device)
    path = accept_index.to(torch.int64)
    src = torch.where(path >= 0, path, front)
    return AcceptedPathMoves(dst_rows=front.flatten(), src_rows=src.flatten())


def compact_rows(rows: torch.Tensor, moves: AcceptedPathMoves) -> None:
    """rows[dst] = rows[src] in place, for a tensor laid out [bs * num_draft_tokens, ...].

    The gather completes before the scatter, so a row that is both a source and a
    destination (a path that skips one node: sources shift down by one) is read first.
    """
    rows.index_copy_(0, moves.dst_rows, rows.index_select(0, moves.src_rows))


def compact_accepted_tree_path(
    *,
    accept_index: torch.Tensor,
    num_draft_tokens: int,
    verify_out_cache_loc: torch.Tensor,
    kv_pool: MovableKVPool,
    predict: torch.Tensor,
    hidden_states: Optional[torch.Tensor],
) -> AcceptedPathMoves:
    """Compact KV slots, predict and hidden_states (when captured) of the accepted paths.

    accept_index: [bs, max_accept]; verify_out_cache_loc: [bs * num_draft_tokens], the KV slot
    verify wrote for each row; predict: [bs * num_draft_tokens]; hidden_states:
    [bs * num_draft_tokens, hidden] or None. predict and hidden_states change in place.
    """
    moves = plan_accepted_path_moves(accept_index, num_draft_tokens)
    tgt_slots = verify_out_cache_loc.index_select(0, moves.dst_rows)
    src_slots = verify_out_cache_loc.index_select(0, moves.src_rows)
    kv_pool.move_kv_cache(tgt_slots, src_slots)
    # The KV canary's fingerprints travel with the K/V they describe (no-op when off).
    kv_canary.on_kv_move(kv_pool, tgt_slots, src_slots)
    compact_rows(predict, moves)
    if hidden_states is not None:
        compact_rows(hidden_states, moves)
    return moves
