"""Cases for triton_split_prefix, run under triton's CPU interpreter by
test_triton_split_prefix.py (and on CUDA by its GPU test): the two-launch split-prefix attention
against the plain-torch reference on random verify and extend inputs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from sglang.srt.layers.attention import triton_split_prefix as sp


@dataclass(frozen=True)
class Case:
    name: str
    prefix_lens: tuple[int, ...]
    # Rows per request; a verify has num_draft_tokens for every request.
    extend_lens: tuple[int, ...]
    heads: int
    kv_heads: int
    dim: int
    # "tree": a random tree's custom mask; "star": each row sees the root and itself;
    # "causal": no custom mask, causal.
    mask: str
    num_splits: Optional[int] = None  # None: what plan_split_prefix picks
    k_scale: float = 1.0
    v_scale: float = 1.0


CASES = [
    Case("bs1_one_row_no_prefix", (0,), (1,), 4, 2, 16, "causal"),
    Case("bs1_tree32_group4", (300,), (32,), 8, 2, 32, "tree"),
    Case("bs1_chain4_prefix_below_splits", (5,), (4,), 8, 2, 16, "causal", 16),
    Case("bs1_star8_one_split", (70,), (8,), 4, 1, 16, "star", 1),
    Case("bs2_tree8_mha", (33, 64), (8, 8), 2, 2, 16, "tree"),
    Case("bs3_group3_causal_uneven", (40, 1, 97), (1, 4, 3), 6, 2, 16, "causal", 4),
    Case("bs2_scaled_kv", (50, 20), (4, 4), 4, 2, 16, "tree", 2, 0.5, 2.0),
    # 20 x 16 heads: a batch the short tile took before the split applied at every size.
    Case(
        "bs20_large_batch_one_split",
        tuple(range(3, 63, 3)),
        (4,) * 20,
        16,
        4,
        16,
        "tree",
    ),
]


def tree_block(n: int, gen: torch.Generator, mask: str) -> torch.Tensor:
    """[n, n] bool: row i sees its ancestors and itself (a random tree, or the star)."""
    block = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        parent = 0 if mask == "star" else int(torch.randint(0, i, (1,), generator=gen))
        block[i] |= block[parent]
    return block


def make_inputs(case: Case, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    total_prefix, tokens = sum(case.prefix_lens), sum(case.extend_lens)
    pool = total_prefix + 16

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    custom_mask, mask_indptr = None, torch.zeros(
        len(case.prefix_lens) + 1, dtype=torch.int64
    )
    if case.mask != "causal":
        blocks = []
        for p, n in zip(case.prefix_lens, case.extend_lens):
            full = torch.ones(n, p + n, dtype=torch.bool)
            full[:, p:] = tree_block(n, gen, case.mask)
            blocks.append(full.flatten())
        custom_mask = torch.cat(blocks).to(device)
        sizes = [n * (p + n) for p, n in zip(case.prefix_lens, case.extend_lens)]
        mask_indptr[1:] = torch.tensor(sizes).cumsum(0)
    kv_indptr = torch.zeros(len(case.prefix_lens) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor(case.prefix_lens).cumsum(0)
    # int64 as the triton backend's CUDA-graph buffers hold it; kv_indptr is int32 there.
    qo_indptr = torch.zeros(len(case.extend_lens) + 1, dtype=torch.int64)
    qo_indptr[1:] = torch.tensor(case.extend_lens).cumsum(0)
    return dict(
        q_extend=randn(tokens, case.heads, case.dim),
        k_extend=randn(tokens, case.kv_heads, case.dim),
        v_extend=randn(tokens, case.kv_heads, case.dim),
        k_buffer=randn(pool, case.kv_heads, case.dim),
        v_buffer=randn(pool, case.kv_heads, case.dim),
        qo_indptr=qo_indptr.to(device),
        kv_indptr=kv_indptr.to(device),
        # Scattered slots, as the KV pool hands them out.
        kv_indices=torch.randperm(pool, generator=gen)[:total_prefix].to(device),
        custom_mask=custom_mask,
        is_causal=case.mask == "causal",
        mask_indptr=mask_indptr.to(device),
        k_scale=case.k_scale,
        v_scale=case.v_scale,
        sm_scale=case.dim**-0.5,
    )


def upstream_extend(x: dict, out: torch.Tensor, **overrides) -> torch.Tensor:
    """Upstream's extend_attention_fwd on make_inputs' inputs (any of them overridden, e.g.
    k_extend), written into out: the split prefix, on by default, is switched off for it.
    """
    from sglang.srt.layers.attention.triton_ops.extend_attention import (
        extend_attention_fwd,
    )

    x = {**x, **overrides}
    extend_lens = x["qo_indptr"][1:] - x["qo_indptr"][:-1]
    saved, sp._ENABLED = sp._ENABLED, False
    try:
        extend_attention_fwd(
            x["q_extend"],
            x["k_extend"],
            x["v_extend"],
            out,
            x["k_buffer"],
            x["v_buffer"],
            x["qo_indptr"],
            x["kv_indptr"],
            x["kv_indices"],
            x["custom_mask"],
            x["is_causal"],
            x["mask_indptr"],
            int(extend_lens.max()),
            x["k_scale"],
            x["v_scale"],
            sm_scale=x["sm_scale"],
        )
    finally:
        sp._ENABLED = saved
    return out


def plan_for(case: Case) -> sp.SplitPlan:
    saved, sp._ENABLED = sp._ENABLED, True
    try:
        plan = sp.plan_split_prefix(
            max(case.extend_lens),
            len(case.extend_lens),
            case.heads,
            case.kv_heads,
            case.dim,
            case.dim,
        )
    finally:
        sp._ENABLED = saved
    assert plan is not None, case
    if case.num_splits is not None:
        plan = dataclasses.replace(plan, num_splits=case.num_splits)
    return plan


def check(case: Case, device: str, seed: int = 0) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = make_inputs(case, device, dtype, seed)
    expected = sp.reference_extend_attention(**x)
    out = torch.full_like(x["q_extend"], float("nan"))
    sp.split_prefix_extend_attention(plan_for(case), o_extend=out, **x)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_reference(case):
    check(case, "cpu")


# Splits past these prefixes see no key (a chunk is at least BLOCK_N tokens).
EMPTY_SPLIT_CASES = [c for c in CASES if c.name.startswith(("bs1_chain4", "bs3_"))]


@pytest.mark.parametrize(
    "case", EMPTY_SPLIT_CASES, ids=[c.name for c in EMPTY_SPLIT_CASES]
)
def test_splits_without_keys_are_not_read(case, monkeypatch):
    """The partial buffers start as NaN: a split that saw no key must not store its output
    and the merge must not read it (a read of one NaN would poison the row)."""
    allocate = sp._partial_buffers

    def poisoned(*args):
        partial_o, partial_lse = allocate(*args)
        return partial_o.fill_(float("nan")), partial_lse.fill_(float("nan"))

    monkeypatch.setattr(sp, "_partial_buffers", poisoned)
    check(case, "cpu", seed=1)
