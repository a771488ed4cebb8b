"""Cases for fa3_tree_metadata, run under triton's CPU interpreter by test_fa3_tree_metadata.py.

The kernel is compared with the plain-torch reference, and the reference with upstream's own
replay arithmetic (the sort-based code in flashattention_backend), on random trees.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention import fa3_tree_metadata as fa3


def random_tree_masks(seq_lens: list[int], D: int, gen: torch.Generator, shape: str):
    """custom_mask as spec trees lay it out: per request, D rows of (seq_len + D) columns; a
    draft token sees the whole prefix and its ancestors in the tree, itself included."""
    blocks = []
    for seq_len in seq_lens:
        if (
            shape == "chain"
        ):  # everything visible that can be: each token's parent is the last
            parents = list(range(-1, D - 1))
        elif shape == "star":  # only the root and itself
            parents = [-1] + [0] * (D - 1)
        else:
            parents = [-1] + [
                int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, D)
            ]
        block = torch.zeros(D, seq_len + D, dtype=torch.bool)
        block[:, :seq_len] = True
        for token in range(D):
            node = token
            while node >= 0:
                block[token, seq_len + node] = True
                node = parents[node]
        blocks.append(block.flatten())
    return torch.cat(blocks)


def upstream_expand(custom_mask, seq_lens, req_to_token, req_pool_indices, D, num_real):
    """flashattention_backend's replay code for the expand half, as written there (its
    spec_info.positions.numel() is num_real * D)."""
    offsets = torch.arange(D).unsqueeze(0)
    cols = offsets.expand(seq_lens.numel(), -1) + seq_lens.unsqueeze(1)
    cum_len = torch.nn.functional.pad(
        torch.cumsum((seq_lens + D).repeat_interleave(D), dim=0), (1, 0)
    )[:-1]
    idx = (cols.repeat_interleave(D, dim=0) + cum_len[:, None]).view(1, -1)
    idx[:, num_real * D * D :].fill_(0)
    mask = custom_mask[idx].view(-1, D)
    col_indices = offsets.expand(mask.shape[0], D)
    keys = torch.where(mask, col_indices, col_indices + D)
    _, sort_order = torch.sort(keys, dim=1, stable=True)
    table = (
        req_to_token[req_pool_indices, :].gather(1, cols).repeat_interleave(D, dim=0)
    )
    return table.gather(1, sort_order).to(torch.int32), mask.sum(dim=1).to(torch.int32)


def make_batch(seq_lens, D, num_real, shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool_rows, context = 64, max(seq_lens) + D + 8
    req_to_token = torch.randperm(pool_rows * context, generator=gen)
    req_to_token = req_to_token.view(pool_rows, context).to(torch.int32)
    return SimpleNamespace(
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        req_to_token=req_to_token,
        req_pool_indices=torch.randperm(pool_rows, generator=gen)[: len(seq_lens)],
        custom_mask=random_tree_masks(seq_lens[:num_real], D, gen, shape),
        num_masked_rows=num_real * D,
        D=D,
    )


def fill_expand(b, page_table, cache_seqlens, cu_seqlens_k) -> None:
    """fill_tree_verify_expand on batch b (make_batch), with the prefix offsets the FA3
    backend passes (int32, a leading 0)."""
    prefix_cu = torch.nn.functional.pad(torch.cumsum(b.seq_lens, 0), (1, 0))
    fa3.fill_tree_verify_expand(
        custom_mask=b.custom_mask,
        seq_lens=b.seq_lens,
        prefix_cu_seqlens=prefix_cu.to(torch.int32),
        req_to_token=b.req_to_token,
        req_pool_indices=b.req_pool_indices,
        num_masked_rows=b.num_masked_rows,
        num_draft_tokens=b.D,
        page_table=page_table,
        cache_seqlens=cache_seqlens,
        cu_seqlens_k=cu_seqlens_k,
    )


CASES = [
    pytest.param([37], 4, 1, "random", id="bs1"),
    pytest.param([5, 120, 33], 8, 3, "random", id="ragged"),
    pytest.param([9, 17, 1, 1], 8, 2, "random", id="graph-padding"),
    pytest.param([12, 40], 16, 2, "chain", id="all-visible"),
    pytest.param([12, 40], 16, 2, "star", id="root-only"),
    pytest.param([64] * 6, 32, 6, "random", id="wide"),
    pytest.param([3, 7], 12, 2, "random", id="width-not-a-power-of-two"),
]


def attention_metadata(page_table: torch.Tensor) -> SimpleNamespace:
    """The FlashAttentionMetadata fields the fills write, zeroed, over `page_table` ([rows,
    columns], its own values kept so a test can see what was not written)."""
    rows = page_table.shape[0]
    return SimpleNamespace(
        cache_seqlens_int32=torch.zeros(rows, dtype=torch.int32),
        cu_seqlens_k=torch.zeros(rows + 1, dtype=torch.int32),
        page_table=page_table,
    )


@pytest.mark.parametrize("seq_lens,D,num_real,shape", CASES)
def test_kernel_matches_reference_and_upstream(seq_lens, D, num_real, shape):
    b = make_batch(seq_lens, D, num_real, shape)
    rows = len(seq_lens) * D
    page_table = torch.full((rows + 5, D + 3), -7, dtype=torch.int32)
    cache_seqlens = torch.full((rows + 5,), -7, dtype=torch.int32)
    cu_seqlens_k = torch.full((rows + 6,), -7, dtype=torch.int32)
    cu_seqlens_k[0] = 0
    fill_expand(b, page_table, cache_seqlens, cu_seqlens_k)
    ref_table, ref_counts = fa3.tree_verify_expand_reference(
        b.custom_mask,
        b.seq_lens,
        b.req_to_token,
        b.req_pool_indices,
        b.num_masked_rows,
        D,
    )
    assert torch.equal(page_table[:rows, :D], ref_table)
    assert torch.equal(cache_seqlens[:rows], ref_counts)
    assert cu_seqlens_k[: rows + 1].tolist() == [
        0,
        *torch.cumsum(ref_counts, 0).tolist(),
    ]
    # Nothing outside the batch's rows and columns is touched.
    assert (page_table[rows:] == -7).all() and (page_table[:, D:] == -7).all()
    assert (cache_seqlens[rows:] == -7).all() and (cu_seqlens_k[rows + 1 :] == -7).all()

    up_table, up_counts = upstream_expand(
        b.custom_mask, b.seq_lens, b.req_to_token, b.req_pool_indices, D, num_real
    )
    real = num_real * D
    assert torch.equal(ref_table[:real], up_table[:real])
    assert torch.equal(ref_counts[:real], up_counts[:real])
    if shape == "chain":
        assert ref_counts[:real].tolist() == list(range(1, D + 1)) * num_real
    if shape == "star":
        assert ref_counts[:real].tolist() == ([1] + [2] * (D - 1)) * num_real


def test_fill_tree_verify_metadata_writes_the_prefix_with_upstreams_fused_kernel():
    from sglang.srt.layers.attention.flashattention_backend import (
        normal_decode_set_metadata,
    )

    b = make_batch([9, 30, 2], 8, 2, "random", seed=4)
    bs, D, width = 3, 8, b.req_to_token.shape[1]
    prefix = attention_metadata(torch.full((bs, width), -1, dtype=torch.int32))
    expand = attention_metadata(torch.zeros(bs * D, D, dtype=torch.int32))
    max_pages = 30
    fa3.fill_tree_verify_metadata(
        prefix,
        expand,
        set_prefix=normal_decode_set_metadata,
        custom_mask=b.custom_mask,
        seq_lens=b.seq_lens,
        req_to_token=b.req_to_token,
        req_pool_indices=b.req_pool_indices,
        strided_indices=torch.arange(width),
        max_seq_pages=max_pages,
        num_masked_rows=b.num_masked_rows,
        num_draft_tokens=D,
    )
    assert prefix.cache_seqlens_int32.tolist() == [9, 30, 2]
    assert prefix.cu_seqlens_k.tolist() == [0, 9, 39, 41]
    assert torch.equal(
        prefix.page_table[:, :max_pages], b.req_to_token[b.req_pool_indices, :max_pages]
    )
    ref_table, ref_counts = fa3.tree_verify_expand_reference(
        b.custom_mask, b.seq_lens, b.req_to_token, b.req_pool_indices, 2 * D, D
    )
    assert torch.equal(expand.page_table, ref_table)
    assert torch.equal(expand.cache_seqlens_int32, ref_counts)


def fill_draft_step(
    prefix,
    expand,
    seq_lens,
    req_to_token,
    req_pool_indices,
    max_seq_pages,
    cache_loc,
    step,
):
    """fill_draft_decode_metadata for draft step `step` (cache_loc: [bs * topk, num_steps])
    with upstream's fused prefix kernel, the strided indices covering every req_to_token
    column."""
    from sglang.srt.layers.attention.flashattention_backend import (
        normal_decode_set_metadata,
    )

    fa3.fill_draft_decode_metadata(
        prefix,
        expand,
        set_prefix=normal_decode_set_metadata,
        seq_lens=seq_lens,
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        strided_indices=torch.arange(req_to_token.shape[1]),
        max_seq_pages=max_seq_pages,
        cache_loc=cache_loc,
        decode_length=step + 1,
    )


def test_fill_draft_decode_metadata_matches_upstreams_replay():
    gen = torch.Generator().manual_seed(2)
    bs, topk, steps, width = 3, 4, 3, 64
    req_to_token = torch.randperm(8 * width, generator=gen).view(8, width)
    req_to_token = req_to_token.to(torch.int32)
    req_pool_indices = torch.tensor([5, 0, 2])
    seq_lens = torch.tensor([7, 33, 1])
    cache_loc = torch.randint(0, 999, (bs * topk, steps), generator=gen)
    for step in range(steps):
        prefix = attention_metadata(torch.full((bs, width), -1, dtype=torch.int32))
        expand = SimpleNamespace(
            page_table=torch.zeros(bs * topk, step + 2, dtype=torch.int32)
        )
        fill_draft_step(
            prefix,
            expand,
            seq_lens,
            req_to_token,
            req_pool_indices,
            33,
            cache_loc,
            step,
        )
        # Upstream's replay at page size 1.
        assert torch.equal(prefix.cache_seqlens_int32, seq_lens.to(torch.int32))
        assert torch.equal(
            prefix.page_table[:, :33], req_to_token[req_pool_indices, :33]
        )
        assert (prefix.page_table[:, 33:] == -1).all()
        assert torch.equal(
            expand.page_table[:, : step + 1],
            cache_loc[:, : step + 1].to(torch.int32),
        )
        assert (expand.page_table[:, step + 1 :] == 0).all()


def test_prefix_pages_stay_within_the_page_table_row():
    """Bounds on the host lengths may ask for pages past a row's width near the context
    length: the copy stops at the width (the row below the table keeps its values) and every
    real page is there."""
    bs, topk, steps, width = 2, 2, 3, 16
    req_to_token = torch.arange(4 * (width + 8), dtype=torch.int32).view(4, width + 8)
    req_pool_indices = torch.tensor([3, 1])
    seq_lens = torch.tensor([width - 1, 5])
    below = torch.full((bs + 1, width), -7, dtype=torch.int32)
    prefix = attention_metadata(below[:bs])
    expand = SimpleNamespace(page_table=torch.zeros(bs * topk, 2, dtype=torch.int32))
    cache_loc = torch.zeros(bs * topk, steps, dtype=torch.int64)
    bound_past_the_row = width + 6
    fill_draft_step(
        prefix,
        expand,
        seq_lens,
        req_to_token,
        req_pool_indices,
        bound_past_the_row,
        cache_loc,
        step=0,
    )
    assert torch.equal(prefix.page_table, req_to_token[req_pool_indices, :width])
    assert (below[bs] == -7).all(), "a row's copy ran past the table"
    assert fa3.page_table_columns(width + 6, prefix.page_table) == width
    assert fa3.page_table_columns(3, prefix.page_table) == 3
