"""benchmark/spec/fa3_cascade.py and flashinfer_verify.py: the inputs of the FA3 and
FlashInfer verifies the benchmark times attend as the verify does.

The benchmark times FA3 and FlashInfer kernels on these inputs on a GPU; here the cascade's
three steps, and FlashInfer's masked call, run in plain torch on the same inputs and must equal
the plain-torch extend attention of the batch they were built from, for a chain and for a tree
mask.
"""

from __future__ import annotations

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


def with_tree_mask(batch: dict, parents: list[int]) -> dict:
    """The batch's extend blocks replaced by a tree's: draft token j sees itself and its
    ancestors (parents[j], -1 for the root)."""
    draft = len(parents)
    visible = torch.zeros(draft, draft, dtype=torch.bool)
    for j in range(draft):
        node = j
        while node >= 0:
            visible[j, node] = True
            node = parents[node]
    bs = batch["qo_indptr"].shape[0] - 1
    masks = batch["custom_mask"].view(bs, draft, -1).clone()
    masks[:, :, -draft:] = visible
    return dict(batch, custom_mask=masks.flatten(), is_causal=False)


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
    batch = with_tree_mask(batch, parents)
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
    batch = with_tree_mask(batch, parents)
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
    batch = with_tree_mask(batch, parents)
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


def test_flashinfer_lse_converts_to_fa3s():
    """FlashInfer's LSE is base 2 and [rows, heads]; fa3_tree_expand reads FA3's, natural log
    and [heads, rows]."""
    torch.manual_seed(0)
    scores = torch.randn(5, 3, 11)  # [rows, heads, keys]
    base2 = torch.log2(torch.exp2(scores * 1.4426950408889634).sum(-1))
    natural = torch.logsumexp(scores, dim=-1)
    converted = flashinfer_verify.fa3_lse(base2)
    assert converted.shape == (3, 5)
    torch.testing.assert_close(converted, natural.T)
