"""Spec v2: the next round's draft input, read off the draft extend of the verify block.

Draft extend re-runs the draft over the whole verify block, num_tokens_per_req rows per
request (the tree's width), but the next round only needs each request's last accepted row:
row `b * num_tokens_per_req + num_accept_tokens[b] - 1` (the block is chain-shaped after tree
compaction). Selecting that row before the vocab-wide softmax and top-k does that work on bs
rows instead of bs * num_tokens_per_req. The draft-extend CUDA graph runs this inside the graph
(num_accept_tokens is one of its static inputs); the eager path runs the same function after
the forward, so both give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.utils.common import fast_topk


@dataclass
class NextDraftInput:
    # [bs, topk] float32: draft probabilities of each request's top-k next tokens
    topk_p: torch.Tensor
    # [bs, topk] int64
    topk_index: torch.Tensor
    # [bs, hidden] or None (draft models that do not capture hidden states)
    hidden_states: Optional[torch.Tensor]
    # [bs, vocab]: the selected rows' logits (for NaN checks)
    next_token_logits: torch.Tensor


def last_accepted_rows(
    num_accept_tokens: torch.Tensor, num_tokens_per_req: int
) -> torch.Tensor:
    """[bs] int64: row of each request's last accepted token in the verify-block layout."""
    bs = num_accept_tokens.shape[0]
    block_start = (
        torch.arange(bs, device=num_accept_tokens.device, dtype=torch.int64)
        * num_tokens_per_req
    )
    return block_start + num_accept_tokens.to(torch.int64) - 1


def select_next_draft_input(
    next_token_logits: torch.Tensor,
    hidden_states: Optional[torch.Tensor],
    num_accept_tokens: torch.Tensor,
    num_tokens_per_req: int,
    topk: int,
) -> NextDraftInput:
    """next_token_logits: [bs * num_tokens_per_req, vocab]; hidden_states: [bs *
    num_tokens_per_req, hidden] or None; num_accept_tokens: [bs], each in [1, num_tokens_per_req].
    Sync-free and shape-static (CUDA-graph safe)."""
    rows = last_accepted_rows(num_accept_tokens, num_tokens_per_req)
    logits = next_token_logits.index_select(0, rows)
    hidden = hidden_states.index_select(0, rows) if hidden_states is not None else None
    topk_p, topk_index = fast_topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    return NextDraftInput(topk_p, topk_index, hidden, logits)
