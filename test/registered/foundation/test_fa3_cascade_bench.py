"""benchmark/spec/fa3_cascade.py: the inputs of FA3's cascade verify attend as the verify does.

The benchmark times FA3 kernels on these inputs on a GPU; here the cascade's three steps run in
plain torch on the same inputs and must equal the plain-torch extend attention of the batch
they were built from, for a chain and for a tree mask.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import bench_verify_attention  # noqa: E402
import fa3_cascade  # noqa: E402

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
