"""Cases for flashinfer_tree_cascade, run under triton's CPU interpreter (the KV slot list and
the expand table are built by triton kernels) by test_flashinfer_tree_cascade.py.

The plan FlashInfer is handed (flashinfer_host_plan_cases.RecordingWrapper keeps it) must be
each request's prefix alone, unmasked; the expand table each draft row's visible draft slots;
and attending the prefix as planned, then merging the draft rows by fa3_tree_expand with
FlashInfer's base-2 LSE, must equal one masked softmax over prefix and draft block, which is
what the masked verify computes.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from flashinfer_host_plan_cases import POOL_LEN, RecordingWrapper, shuffled_req_to_token

from sglang.srt.layers.attention import fa3_tree_expand
from sglang.srt.layers.attention import flashinfer_tree_cascade as cascade
from sglang.srt.layers.attention.fa3_tree_metadata import tree_verify_expand_reference

HEADS, KV_HEADS, DIM = 8, 2, 16


def random_parents(width: int, gen: torch.Generator) -> list[int]:
    return [-1] + [
        int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, width)
    ]


def tree_block(parents: list[int]) -> torch.Tensor:
    """[width, width] bool: draft token j sees its ancestors and itself."""
    width = len(parents)
    seen = torch.zeros(width, width, dtype=torch.bool)
    for j in range(width):
        node = j
        while node >= 0:
            seen[j, node] = True
            node = parents[node]
    return seen


def make_verify(bs: int, width: int, seed: int, padding: int = 0):
    """A verify of bs real requests (prefixes of 1..40 tokens, some shorter than `width`) and
    `padding` CUDA-graph padding requests (seq_len 1, no mask): its spec_info, seq_lens, the
    pool rows and each real request's tree."""
    gen = torch.Generator().manual_seed(seed)
    rows = bs + padding + 3
    req_to_token = shuffled_req_to_token(rows, gen)
    req_pool_indices = torch.randperm(rows, generator=gen)[: bs + padding]
    prefix = torch.randint(1, 41, (bs,), generator=gen)
    seq_lens = torch.cat([prefix, torch.ones(padding, dtype=torch.int64)])
    trees = [tree_block(random_parents(width, gen)) for _ in range(bs)]
    mask = torch.cat(
        [
            torch.cat([torch.ones(width, int(n), dtype=torch.bool), t], dim=1).flatten()
            for n, t in zip(prefix, trees)
        ]
    )
    spec_info = SimpleNamespace(
        custom_mask=mask, draft_token_num=width, positions=torch.empty(bs * width)
    )
    return SimpleNamespace(
        spec_info=spec_info,
        seq_lens=seq_lens,
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        trees=trees,
    )


def updater(req_to_token, heads=HEADS, kv_heads=KV_HEADS, dim=DIM):
    """What TreeCascade.plan reads of the backend's FlashInferIndicesUpdaterPrefill."""
    return SimpleNamespace(
        num_qo_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        q_data_type=torch.bfloat16,
        data_type=torch.bfloat16,
        req_to_token=req_to_token,
    )


def plan(tree_cascade, wrapper, verify, kv_indices_buf=None, row_buffers=None):
    bs = verify.seq_lens.shape[0]
    if row_buffers is not None:
        kv_indptr_buf = row_buffers.kv_indptr
    else:
        kv_indptr_buf = torch.zeros(bs * verify.spec_info.draft_token_num + 1).int()
    tree_cascade.plan(
        wrapper,
        updater(verify.req_to_token),
        kv_indptr_buf=kv_indptr_buf,
        req_pool_indices=verify.req_pool_indices,
        seq_lens=verify.seq_lens,
        seq_lens_cpu=verify.seq_lens.clone(),
        spec_info=verify.spec_info,
        kv_indices_buf=kv_indices_buf,
        host_lens_are_bounds=False,
        row_buffers=row_buffers,
    )


def expected_table(verify, bs, width):
    return tree_verify_expand_reference(
        verify.spec_info.custom_mask,
        verify.seq_lens,
        verify.req_to_token,
        verify.req_pool_indices,
        num_masked_rows=bs * width,
        num_draft_tokens=width,
    )


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_a_small_batchs_rows_are_split_into_sequences_over_the_whole_prefix(cuda_graph):
    """bs 2 of 32 rows, 2 KV heads of 4 query heads, 64 SMs: each request's rows become 8
    sequences of 4 (16 query rows a KV head, the smallest tile), each over the request's
    whole prefix, planned unsplit; a graphed verify's wrapper points at the backend's longer
    buffers. The expand table is the same as unsplit rows'."""
    bs, width, pieces = 2, 32, 8
    verify = make_verify(bs, width, seed=11)
    tree_cascade = cascade.TreeCascade(serves=True, num_sms=64)
    row_buffers, slots = None, None
    if cuda_graph:
        slots = torch.zeros(pieces * bs * POOL_LEN, dtype=torch.int32)
        row_buffers = cascade.RowPieceBuffers(
            qo_indptr=torch.zeros(65, dtype=torch.int32),
            kv_indptr=torch.zeros(65, dtype=torch.int32),
            last_page_len=torch.ones(64, dtype=torch.int32),
        )
        wrapper = RecordingWrapper(
            True, kv_indptr_buf=row_buffers.kv_indptr[: bs + 1], kv_indices_buf=slots
        )
        wrapper._fixed_batch_size = bs
    else:
        wrapper = RecordingWrapper(cuda_graph=False)
    plan(tree_cascade, wrapper, verify, kv_indices_buf=slots, row_buffers=row_buffers)

    got = wrapper.planned
    lens = verify.seq_lens.repeat_interleave(pieces).tolist()
    assert got.qo_indptr.tolist() == list(range(0, bs * width + 1, width // pieces))
    assert got.kv_indptr.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    expected_slots = torch.cat(
        [
            verify.req_to_token[r, :n]
            for r, n in zip(verify.req_pool_indices.tolist(), verify.seq_lens.tolist())
            for _ in range(pieces)
        ]
    )
    assert torch.equal(got.kv_indices, expected_slots)
    assert got.kwargs["disable_split_kv"] is True
    if cuda_graph:
        assert wrapper._fixed_batch_size == bs * pieces
        assert wrapper._paged_kv_indptr_buf.numel() == bs * pieces + 1
        assert wrapper._paged_kv_last_page_len_buf.numel() == bs * pieces
    table, counts = expected_table(verify, bs, width)
    assert torch.equal(tree_cascade.table.num_visible, counts)
    for row, n in enumerate(counts.tolist()):
        assert torch.equal(tree_cascade.table.page_table[row, :n], table[row, :n])


def test_a_graph_too_wide_for_the_backends_buffers_keeps_its_rows_whole():
    bs, width = 2, 32
    verify = make_verify(bs, width, seed=12)
    slots = torch.zeros(8 * bs * POOL_LEN, dtype=torch.int32)
    row_buffers = cascade.RowPieceBuffers(  # room for 8 sequences, not 16
        qo_indptr=torch.zeros(9, dtype=torch.int32),
        kv_indptr=torch.zeros(9, dtype=torch.int32),
        last_page_len=torch.ones(8, dtype=torch.int32),
    )
    wrapper = RecordingWrapper(
        True, kv_indptr_buf=row_buffers.kv_indptr[: bs + 1], kv_indices_buf=slots
    )
    tree_cascade = cascade.TreeCascade(serves=True, num_sms=64)
    plan(tree_cascade, wrapper, verify, kv_indices_buf=slots, row_buffers=row_buffers)
    assert wrapper.planned.qo_indptr.tolist() == [0, 32, 64]
    assert "disable_split_kv" not in wrapper.planned.kwargs


@pytest.mark.parametrize("bs,width,padding", [(1, 8, 0), (3, 32, 0), (4, 16, 2)])
def test_the_prefix_pass_plans_each_prefix_unmasked(bs, width, padding):
    verify = make_verify(bs, width, seed=bs + width, padding=padding)
    wrapper = RecordingWrapper(cuda_graph=False)
    tree_cascade = cascade.TreeCascade(serves=True)
    plan(tree_cascade, wrapper, verify)

    got = wrapper.planned
    lens = verify.seq_lens.tolist()  # not lifted to the width: rows see the prefix only
    assert got.qo_indptr.tolist() == [b * width for b in range(len(lens) + 1)]
    assert got.kv_indptr.tolist() == [sum(lens[:b]) for b in range(len(lens) + 1)]
    expected_slots = torch.cat(
        [
            verify.req_to_token[r, :n]
            for r, n in zip(verify.req_pool_indices.tolist(), lens)
        ]
    )
    assert torch.equal(got.kv_indices, expected_slots)
    assert wrapper._custom_mask_buf is None, "the prefix pass reads no mask"

    table, counts = tree_verify_expand_reference(
        verify.spec_info.custom_mask,
        verify.seq_lens,
        verify.req_to_token,
        verify.req_pool_indices,
        num_masked_rows=bs * width,
        num_draft_tokens=width,
    )
    assert torch.equal(tree_cascade.table.num_visible, counts)
    for row, n in enumerate(counts.tolist()):  # the visible slots first, in tree order
        assert torch.equal(tree_cascade.table.page_table[row, :n], table[row, :n])
    assert counts[: bs * width].max() <= width and counts[bs * width :].eq(width).all()


def test_a_graph_replays_into_the_table_it_was_captured_with():
    capture = make_verify(4, 16, seed=1)
    replay = make_verify(4, 16, seed=2)
    slots = torch.zeros(4 * POOL_LEN, dtype=torch.int32)
    indptr = torch.zeros(5, dtype=torch.int32)
    wrapper = RecordingWrapper(True, kv_indptr_buf=indptr, kv_indices_buf=slots)
    tree_cascade = cascade.TreeCascade(serves=True)
    plan(tree_cascade, wrapper, capture, kv_indices_buf=slots)
    captured = tree_cascade.table
    tree_cascade.reset()
    assert tree_cascade.table is None
    plan(tree_cascade, wrapper, replay, kv_indices_buf=slots)
    assert tree_cascade.table is captured
    _, counts = tree_verify_expand_reference(
        replay.spec_info.custom_mask,
        replay.seq_lens,
        replay.req_to_token,
        replay.req_pool_indices,
        num_masked_rows=64,
        num_draft_tokens=16,
    )
    assert torch.equal(captured.num_visible, counts)
    # an eager verify of the same shape gets a table of its own
    plan(tree_cascade, RecordingWrapper(cuda_graph=False), replay)
    assert tree_cascade.table is not captured


def attend_planned_prefix(q, k_slots, v_slots, planned, width):
    """What FlashInfer's unmasked paged prefill returns for the recorded plan: out [rows,
    heads, dim] and its base-2 LSE [rows, heads]."""
    group = HEADS // KV_HEADS
    outs, lses = [], []
    for b in range(planned.qo_indptr.shape[0] - 1):
        slots = planned.kv_indices[
            planned.kv_indptr[b] : planned.kv_indptr[b + 1]
        ].long()
        keys = k_slots[slots].repeat_interleave(group, dim=1)
        values = v_slots[slots].repeat_interleave(group, dim=1)
        rows = q[planned.qo_indptr[b] : planned.qo_indptr[b + 1]]
        scores = torch.einsum("qhd,khd->qhk", rows, keys)
        scores = scores * DIM**-0.5
        lses.append(scores.logsumexp(-1) / math.log(2.0))
        outs.append(torch.einsum("qhk,khd->qhd", scores.softmax(-1), values))
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("bs,width,num_sms", [(1, 8, 0), (3, 16, 0), (2, 16, 64)])
def test_the_cascade_attends_as_the_masked_verify(bs, width, num_sms):
    """num_sms 64: each request's rows as 4 sequences over its prefix (row_pieces)."""
    verify = make_verify(bs, width, seed=7 * bs)
    wrapper = RecordingWrapper(cuda_graph=False)
    tree_cascade = cascade.TreeCascade(serves=True, num_sms=num_sms)
    plan(tree_cascade, wrapper, verify)
    assert wrapper.planned.qo_indptr.numel() == bs * (4 if num_sms else 1) + 1

    gen = torch.Generator().manual_seed(bs)
    slots = verify.req_to_token.numel()
    k_slots = torch.randn(slots, KV_HEADS, DIM, generator=gen)
    v_slots = torch.randn(slots, KV_HEADS, DIM, generator=gen)
    q = torch.randn(bs * width, HEADS, DIM, generator=gen)
    out, lse = attend_planned_prefix(q, k_slots, v_slots, wrapper.planned, width)
    got = fa3_tree_expand.attend_and_merge(
        q,
        k_slots,
        v_slots,
        tree_cascade.table.page_table,
        tree_cascade.table.num_visible,
        out,
        lse.T,
        DIM**-0.5,
        lse_scale=math.log(2.0),
    )

    group = HEADS // KV_HEADS
    expected, start = [], 0
    for b in range(bs):
        n = int(verify.seq_lens[b])
        row_slots = verify.req_to_token[verify.req_pool_indices[b], : n + width].long()
        keys = k_slots[row_slots].repeat_interleave(group, dim=1)
        values = v_slots[row_slots].repeat_interleave(group, dim=1)
        mask = verify.spec_info.custom_mask[start : start + width * (n + width)]
        start += width * (n + width)
        scores = torch.einsum("qhd,khd->qhk", q[b * width : (b + 1) * width], keys)
        scores = (scores * DIM**-0.5).masked_fill(
            ~mask.view(width, 1, n + width), float("-inf")
        )
        expected.append(torch.einsum("qhk,khd->qhd", scores.softmax(-1), values))
    torch.testing.assert_close(got, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_a_capture_without_positions_shows_every_row_the_whole_block():
    """A CUDA graph's capture hands a spec_info without positions and a placeholder mask:
    no row reads the mask, each sees the whole draft block (its output is discarded)."""
    verify = make_verify(2, 8, seed=5)
    verify.spec_info.positions = None
    verify.spec_info.custom_mask = torch.zeros(1, dtype=torch.bool)  # never read
    tree_cascade = cascade.TreeCascade(serves=True)
    plan(tree_cascade, RecordingWrapper(cuda_graph=False), verify)
    assert tree_cascade.table.num_visible.eq(8).all()
