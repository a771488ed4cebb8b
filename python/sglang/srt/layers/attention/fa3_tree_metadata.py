"""FA3 metadata for a tree verify and a tree draft step, each in two kernel launches.

FA3 has no custom-mask kernel, so a tree verify (topk > 1) runs as two attention passes whose
states are merged: every draft token attends to the request's prefix (the "prefix" metadata:
one row of slots per request), then to the draft tokens the tree mask shows it (the "expand"
metadata: one query row per draft token, whose page-table row lists the visible draft slots
first). Upstream builds the expand part on every CUDA-graph replay from a dozen small torch ops
(index arithmetic, a gather of the mask, a sort, two more gathers); each is a launch on the
host's critical path between two graph replays. Here one triton program per draft token reads
its mask row and writes its page-table row and visible count. A tree draft step's prefix half
(the same split, one query row per branch) takes upstream's fused decode-metadata kernel
instead of four ops.

Page size 1 only: spec v2 trees run at page size 1, and there a page-table entry is a KV slot.
Every replay's page-table copy, the chain draft decode's too, stays within a row's width
(page_table_columns).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from sglang.srt.utils.eager_jit import eager_jit


@eager_jit
def _tree_verify_expand_kernel(
    custom_mask,  # [sum over requests of D * (seq_len + D)], bool
    seq_lens,  # [bs]
    prefix_cu_seqlens,  # [bs + 1] int32: exclusive cumsum of seq_lens
    req_to_token,  # [pool rows, context len]
    req_to_token_stride,
    req_pool_indices,  # [bs]
    page_table,  # [>= bs * D, >= D] int32, written
    page_table_stride,
    cache_seqlens,  # [>= bs * D] int32, written
    num_masked_rows,  # rows backed by the mask: real requests * D
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    req = row // D
    token = row % D
    seq_len = tl.load(seq_lens + req).to(tl.int64)
    pool_row = tl.load(req_pool_indices + req).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    in_tree = cols < D

    # Request `req`'s mask block holds D rows of (seq_len + D) columns; row `token`'s last D
    # columns say which draft tokens it sees. Padding rows of a CUDA graph have no mask: they
    # see every draft token (their output is discarded).
    block = D * tl.load(prefix_cu_seqlens + req).to(tl.int64) + D * D * req
    mask_row = custom_mask + block + token * (seq_len + D) + seq_len
    has_mask = row < num_masked_rows
    seen = tl.load(mask_row + cols, mask=in_tree & has_mask, other=1).to(tl.int32)
    seen = tl.where(in_tree, seen != 0, 0).to(tl.int32)
    hidden = tl.where(in_tree, 1 - seen, 0)

    # Visible draft tokens first, in tree order, then the hidden ones: the order a stable sort
    # of (column if seen else column + D) gives.
    num_seen = tl.sum(seen, axis=0)
    rank_seen = tl.cumsum(seen, axis=0) - seen
    rank_hidden = tl.cumsum(hidden, axis=0) - hidden
    dest = tl.where(seen != 0, rank_seen, num_seen + rank_hidden)

    slots = tl.load(
        req_to_token + pool_row * req_to_token_stride + seq_len + cols, mask=in_tree
    )
    tl.store(page_table + row * page_table_stride + dest, slots, mask=in_tree)
    tl.store(cache_seqlens + row, num_seen)


def fill_tree_verify_expand(
    *,
    custom_mask: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_cu_seqlens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_masked_rows: int,
    num_draft_tokens: int,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_k: Optional[torch.Tensor] = None,
) -> None:
    """Write the expand metadata of `seq_lens.numel()` requests in place.

    page_table: [bs * num_draft_tokens, num_draft_tokens] visible draft slots first;
    cache_seqlens: [bs * num_draft_tokens] how many each row sees; cu_seqlens_k: its cumsum,
    with a leading 0, for FA3's expand pass (None: not written). prefix_cu_seqlens:
    [bs + 1], 0 then the cumsum of seq_lens (what the prefix metadata's cu_seqlens_k holds).
    """
    num_rows = seq_lens.numel() * num_draft_tokens
    _tree_verify_expand_kernel[(num_rows,)](
        custom_mask,
        seq_lens,
        prefix_cu_seqlens,
        req_to_token,
        req_to_token.stride(0),
        req_pool_indices,
        page_table,
        page_table.stride(0),
        cache_seqlens,
        num_masked_rows,
        D=num_draft_tokens,
        BLOCK_D=triton.next_power_of_2(num_draft_tokens),
    )
    if cu_seqlens_k is not None:
        torch.cumsum(
            cache_seqlens[:num_rows], dim=0, out=cu_seqlens_k[1 : num_rows + 1]
        )


def _fill_prefix(
    metadata,
    set_prefix: Callable[..., None],
    seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    strided_indices: torch.Tensor,
    max_seq_pages: int,
) -> None:
    """The prefix half: every query row of a request sees its seq_len prefix slots (no length
    delta, page size 1)."""
    columns = page_table_columns(max_seq_pages, metadata.page_table)
    set_prefix(
        metadata.cache_seqlens_int32,
        metadata.cu_seqlens_k,
        metadata.page_table,
        req_to_token,
        req_pool_indices,
        strided_indices,
        columns,
        seq_lens,
        0,
        1,
    )


def page_table_columns(max_seq_pages: int, page_table: torch.Tensor) -> int:
    """How many columns of each page-table row a replay fills: max_seq_pages, at most the
    row's width. Host lengths that are bounds (speculative/bounded_host_lens.py) can ask for a
    few pages past the width near the context length, where no real length reaches, and
    upstream's fused copy (normal_decode_set_metadata) would write them into the next row.
    """
    return min(max_seq_pages, page_table.shape[1])


def fill_tree_verify_metadata(
    metadata,
    metadata_expand,
    *,
    set_prefix: Callable[..., None],
    custom_mask: torch.Tensor,
    seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    strided_indices: torch.Tensor,
    max_seq_pages: int,
    num_masked_rows: int,
    num_draft_tokens: int,
) -> None:
    """Both halves of a tree verify's FA3 metadata, into the CUDA-graph buffers they view.

    set_prefix is flashattention_backend's normal_decode_set_metadata (one fused launch for
    cache_seqlens, cu_seqlens_k and the page-table gather), passed in to keep this module free
    of the backend's imports."""
    _fill_prefix(
        metadata,
        set_prefix,
        seq_lens,
        req_to_token,
        req_pool_indices,
        strided_indices,
        max_seq_pages,
    )
    fill_tree_verify_expand(
        custom_mask=custom_mask,
        seq_lens=seq_lens,
        prefix_cu_seqlens=metadata.cu_seqlens_k,
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        num_masked_rows=num_masked_rows,
        num_draft_tokens=num_draft_tokens,
        page_table=metadata_expand.page_table,
        cache_seqlens=metadata_expand.cache_seqlens_int32,
        cu_seqlens_k=metadata_expand.cu_seqlens_k,
    )


def fill_draft_decode_metadata(
    metadata,
    metadata_expand,
    *,
    set_prefix: Callable[..., None],
    seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    strided_indices: torch.Tensor,
    max_seq_pages: int,
    cache_loc: torch.Tensor,
    decode_length: int,
) -> None:
    """Both halves of a tree draft step's FA3 metadata (step decode_length - 1).

    cache_loc: [bs * topk, num_steps] the KV slots of each branch's draft tokens; a branch
    attends to the first decode_length of them after the prefix."""
    _fill_prefix(
        metadata,
        set_prefix,
        seq_lens,
        req_to_token,
        req_pool_indices,
        strided_indices,
        max_seq_pages,
    )
    metadata_expand.page_table[: cache_loc.shape[0], :decode_length].copy_(
        cache_loc[:, :decode_length]
    )


def tree_verify_expand_reference(
    custom_mask: torch.Tensor,
    seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_masked_rows: int,
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, one request and one draft token at a time: (page_table [bs * D, D],
    cache_seqlens [bs * D])."""
    D = num_draft_tokens
    rows, counts = [], []
    block = 0
    for req, seq_len in enumerate(seq_lens.tolist()):
        slots = req_to_token[req_pool_indices[req], seq_len : seq_len + D]
        for token in range(D):
            if req * D + token < num_masked_rows:
                start = block + token * (seq_len + D) + seq_len
                seen = custom_mask[start : start + D].bool()
            else:
                seen = torch.ones(D, dtype=torch.bool)
            order = [c for c in range(D) if seen[c]] + [
                c for c in range(D) if not seen[c]
            ]
            rows.append(slots[order])
            counts.append(int(seen.sum()))
        block += D * (seq_len + D)
    return torch.stack(rows).to(torch.int32), torch.tensor(counts, dtype=torch.int32)
