"""benchmark/spec/fa3_cascade.py and flashinfer_verify.py: the inputs of the FA3 and
FlashInfer verifies the benchmark times attend as the verify does.

The benchmark times FA3 and FlashInfer kernels on these inputs on a GPU; here the cascade's
three steps, and FlashInfer's masked call, run in plain torch on the same inputs and must equal
the plain-torch extend attention of the batch they were built from, for a chain and for a tree
mask.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import bench_verify_attention  # noqa: E402
import fa3_cascade  # noqa: E402
import flashinfer_verify  # noqa: E402

from sglang.srt.layers.attention.triton_split_prefix import (  # noqa: E402
    reference_extend_attention,
)

HEADS, KV_HEADS, DIM = 4, 2, 16


def extend_reference(batch: dict) -> torch.Tensor:
    return reference_extend_attention(
        *(
            batch[k]
            for k in (
                "q_extend",
                "k_extend",
                "v_extend",
                "k_buffer",
                "v_buffer",
                "qo_indptr",
                "kv_indptr",
                "kv_indices",
                "custom_mask",
                "is_causal",
                "mask_indptr",
                "k_scale",
                "v_scale",
            )
        ),
        sm_scale=DIM**-0.5,
    )


@pytest.mark.parametrize(
    "bs,prefix_len,parents",
    [
        (1, 7, [-1, 0, 1, 2]),  # bs 1, a chain
        (3, 5, [-1, 0, 0, 1, 1, 2]),  # a tree, two branches at each level
        (2, 1, [-1, 0]),  # one prefix token
    ],
)
def test_the_cascade_inputs_attend_as_the_verify_does(bs, prefix_len, parents):
    torch.manual_seed(bs)
    batch = bench_verify_attention.verify_batch(
        bs, prefix_len, len(parents), HEADS, KV_HEADS, DIM, dev="cpu"
    )
    batch = bench_verify_attention.with_tree_mask(batch, parents)
    inputs = fa3_cascade.cascade_inputs(batch)

    got = fa3_cascade.reference_cascade(inputs, sm_scale=DIM**-0.5)
    wide = fa3_cascade.with_wide_prefix_table(inputs, 64)

    expected = extend_reference(batch)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(
        fa3_cascade.reference_cascade(wide, sm_scale=DIM**-0.5), expected
    )
    # each draft row reads exactly its ancestors and itself, its visible slots first
    ancestors = []
    for j in range(len(parents)):
        count, node = 0, j
        while node >= 0:
            count, node = count + 1, parents[node]
        ancestors.append(count)
    assert inputs.expand.lens.tolist() == ancestors * bs
    pool = batch["k_buffer"].shape[0]
    last_row = inputs.expand.page_table[len(parents) - 1]  # request 0's last draft row
    path = [len(parents) - 1]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    assert sorted(last_row[: ancestors[-1]].tolist()) == sorted(pool + j for j in path)


@pytest.mark.parametrize("bs,prefix_len,parents", [(3, 5, [-1, 0, 0, 1, 1, 2])])
def test_the_triton_expand_variant_attends_as_the_verify_does(bs, prefix_len, parents):
    """The benchmark's triton_expand variant hands the expand inputs and the prefix pass's
    state (FA3's [heads, rows] LSE) to fa3_tree_expand: its reference, on them, is the
    verify's attention."""
    from sglang.srt.layers.attention import fa3_tree_expand

    torch.manual_seed(bs)
    batch = bench_verify_attention.verify_batch(
        bs, prefix_len, len(parents), HEADS, KV_HEADS, DIM, dev="cpu"
    )
    batch = bench_verify_attention.with_tree_mask(batch, parents)
    inputs = fa3_cascade.cascade_inputs(batch)
    prefix_out, prefix_lse = fa3_cascade._paged_attention_reference(
        inputs, inputs.prefix, DIM**-0.5
    )
    got = fa3_tree_expand.attend_and_merge_reference(
        inputs.q,
        inputs.k_cache,
        inputs.v_cache,
        inputs.expand.page_table,
        inputs.expand.lens,
        prefix_out,
        prefix_lse,
        DIM**-0.5,
    )
    torch.testing.assert_close(
        got.to(inputs.q.dtype), extend_reference(batch), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize(
    "bs,prefix_len,parents",
    [(1, 7, [-1, 0, 1, 2]), (3, 5, [-1, 0, 0, 1, 1, 2]), (2, 1, [-1, 0])],
)
def test_the_masked_flashinfer_call_reads_what_the_verify_reads(
    bs, prefix_len, parents
):
    """FlashInfer's masked verify reads each request's KV as masked_kv lays it out (its
    prefix, then its draft tokens) under the batch's custom mask: attended in plain torch
    over those slots, the rows equal the verify's."""
    torch.manual_seed(bs)
    batch = bench_verify_attention.verify_batch(
        bs, prefix_len, len(parents), HEADS, KV_HEADS, DIM, dev="cpu"
    )
    batch = bench_verify_attention.with_tree_mask(batch, parents)
    inputs = fa3_cascade.cascade_inputs(batch)
    kv = flashinfer_verify.masked_kv(inputs)

    draft, width = len(parents), prefix_len + len(parents)
    assert kv.kv_indptr.tolist() == list(range(0, bs * width + 1, width))
    masks = batch["custom_mask"].view(bs, draft, width)
    group = HEADS // KV_HEADS
    rows = []
    for b in range(bs):
        slots = kv.kv_indices[b * width : (b + 1) * width].long()
        keys = inputs.k_cache[slots, 0].float().repeat_interleave(group, dim=1)
        values = inputs.v_cache[slots, 0].float().repeat_interleave(group, dim=1)
        q = inputs.q[b * draft : (b + 1) * draft].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * DIM**-0.5
        scores = scores.masked_fill(~masks[b].unsqueeze(0), float("-inf"))
        rows.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
    got = torch.cat(rows).to(inputs.q.dtype)
    torch.testing.assert_close(got, extend_reference(batch), atol=2e-2, rtol=2e-2)


def test_the_expand_reads_flashinfers_lse_where_it_lies():
    """FlashInfer's LSE is base 2 and [rows, heads]; fa3_tree_expand takes it as its
    transposed view with lse_scale ln 2 and merges as with FA3's natural-log [heads, rows].
    """
    from sglang.srt.layers.attention import fa3_tree_expand

    torch.manual_seed(0)
    rows, heads, dim = 5, 4, 8
    scores = torch.randn(rows, heads, 11)
    natural = torch.logsumexp(scores, dim=-1)  # [rows, heads]
    base2 = torch.log2(torch.exp2(scores * 1.4426950408889634).sum(-1))
    q, out = torch.randn(rows, heads, dim), torch.randn(rows, heads, dim)
    cache = torch.randn(16, 1, 2, dim), torch.randn(16, 1, 2, dim)
    table = torch.randint(0, 16, (rows, 3), dtype=torch.int32)
    visible = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    args = (q, *cache, table, visible)

    fa3 = fa3_tree_expand.attend_and_merge_reference(
        *args, out.clone(), natural.T.contiguous(), dim**-0.5
    )
    flashinfer = fa3_tree_expand.attend_and_merge_reference(
        *args, out.clone(), base2.T, dim**-0.5, lse_scale=math.log(2.0)
    )
    torch.testing.assert_close(flashinfer, fa3)


@pytest.mark.parametrize("draft_tokens,steps", [(32, 3), (8, 1), (64, 5)])
def test_the_benchmarks_trees_are_eagles_shape(draft_tokens, steps):
    """--tree-steps: parents come before their children and no node is more than `steps`
    below the root, so a verify row sees at most steps + 1 draft tokens."""
    parents = bench_verify_attention.random_tree(draft_tokens, steps, seed=draft_tokens)
    assert len(parents) == draft_tokens and parents[0] == -1
    depth = [0]
    for j, parent in enumerate(parents[1:], start=1):
        assert 0 <= parent < j
        depth.append(depth[parent] + 1)
    assert max(depth) == steps  # 31 nodes over three levels reach the third
    batch = bench_verify_attention.verify_batch(
        2, 3, draft_tokens, HEADS, KV_HEADS, DIM, dev="cpu"
    )
    inputs = fa3_cascade.cascade_inputs(
        bench_verify_attention.with_tree_mask(batch, parents)
    )
    assert inputs.expand.lens.max() == steps + 1
    assert inputs.expand.lens.tolist() == [d + 1 for d in depth] * 2


@pytest.mark.parametrize("bs,prefix_len,draft,pieces", [(1, 7, 8, 8), (3, 5, 8, 2)])
def test_a_row_split_prefix_pass_reads_each_requests_prefix_in_row_order(
    bs, prefix_len, draft, pieces
):
    """rows_split_kv: sequence i is `draft // pieces` consecutive draft rows of request
    i // pieces over that request's whole prefix, so the rows come out in the prefix pass's
    order; attended in plain torch that way, they equal the prefix pass's attention."""
    torch.manual_seed(bs)
    batch = bench_verify_attention.verify_batch(
        bs, prefix_len, draft, HEADS, KV_HEADS, DIM, dev="cpu"
    )
    inputs = fa3_cascade.cascade_inputs(batch)
    kv = flashinfer_verify.rows_split_kv(inputs.prefix, pieces)

    piece = draft // pieces
    assert kv.qo_indptr.tolist() == list(range(0, bs * draft + 1, piece))
    assert kv.kv_indptr.tolist() == list(
        range(0, bs * pieces * prefix_len + 1, prefix_len)
    )
    group = HEADS // KV_HEADS

    def attend(q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        keys = inputs.k_cache[slots.long(), 0].float().repeat_interleave(group, dim=1)
        values = inputs.v_cache[slots.long(), 0].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * DIM**-0.5
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)

    split = torch.cat(
        [
            attend(
                inputs.q[kv.qo_indptr[i] : kv.qo_indptr[i + 1]],
                kv.kv_indices[kv.kv_indptr[i] : kv.kv_indptr[i + 1]],
            )
            for i in range(bs * pieces)
        ]
    )
    whole = torch.cat(
        [
            attend(
                inputs.q[b * draft : (b + 1) * draft],
                inputs.prefix.page_table[b, :prefix_len],
            )
            for b in range(bs)
        ]
    )
    torch.testing.assert_close(split, whole)
    with pytest.raises(ValueError, match="3 pieces do not divide 8"):
        flashinfer_verify.rows_split_kv(inputs.prefix, 3)
