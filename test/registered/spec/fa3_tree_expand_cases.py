"""Cases for fa3_tree_expand, run under triton's CPU interpreter by test_fa3_tree_expand.py (and
on CUDA by its GPU tests): the kernel that attends each draft row to its visible draft slots and
merges into the prefix pass's state, against the plain-torch reference, on random trees.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sglang.srt.layers.attention import fa3_tree_expand


@dataclass(frozen=True)
class Case:
    name: str
    bs: int
    draft_tokens: int
    heads: int
    kv_heads: int
    dim: int
    # "tree": a random tree; "star": each row sees the root and itself; "chain": row i sees
    # rows 0..i; "none": rows see nothing (a row the expand pass leaves as it was).
    shape: str
    page_size: int = 1
    # Rows 0, 1, ... whose prefix had no keys, with the LSE FA3 gives them: +inf unsplit,
    # -inf split.
    empty_prefix_lse: tuple[float, ...] = ()


CASES = [
    Case("bs1_tree8_group4", 1, 8, 8, 2, 32, "tree"),
    Case("bs3_tree16_mha", 3, 16, 4, 4, 16, "tree"),
    Case("bs2_star8_group3", 2, 8, 6, 2, 16, "star"),
    Case("bs2_chain6_all_visible", 2, 6, 4, 1, 16, "chain"),
    Case("bs2_nothing_visible", 2, 4, 4, 2, 16, "none"),
    Case("dim_not_a_power_of_two", 2, 4, 4, 2, 24, "tree"),
    Case("pages_of_four", 2, 8, 4, 2, 16, "tree", page_size=4),
    Case(
        "empty_prefixes",
        1,
        4,
        4,
        2,
        16,
        "tree",
        empty_prefix_lse=(float("inf"), float("-inf")),
    ),
]


def visible_rows(case: Case, gen: torch.Generator) -> torch.Tensor:
    """[bs * draft_tokens, draft_tokens] bool: the draft tokens each draft row sees."""
    d = case.draft_tokens
    blocks = []
    for _ in range(case.bs):
        if case.shape == "none":
            blocks.append(torch.zeros(d, d, dtype=torch.bool))
            continue
        if case.shape == "chain":
            blocks.append(torch.ones(d, d).tril().bool())
            continue
        block = torch.eye(d, dtype=torch.bool)
        for i in range(1, d):
            parent = (
                0
                if case.shape == "star"
                else int(torch.randint(0, i, (1,), generator=gen))
            )
            block[i] |= block[parent]
        blocks.append(block)
    return torch.cat(blocks)


def make_inputs(case: Case, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """attend_and_merge's arguments: the draft tokens' K/V at scattered slots of a cache of
    [pages, page_size, kv_heads, dim]; each row's page-table row lists its visible slots first,
    then slots of draft tokens it does not see (read, they would change the result)."""
    gen = torch.Generator().manual_seed(seed)
    rows, d = case.bs * case.draft_tokens, case.draft_tokens
    slots = rows + 13 * case.page_size

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    draft_slots = torch.randperm(slots, generator=gen)[:rows].view(case.bs, d)
    visible = visible_rows(case, gen)
    order = torch.argsort((~visible).to(torch.int8), dim=1, stable=True)
    table = draft_slots.repeat_interleave(d, dim=0).gather(1, order)
    lse = torch.rand(case.heads, rows, generator=gen) * 6 - 2
    for row, value in enumerate(case.empty_prefix_lse):
        lse[:, row] = value
    pages = slots // case.page_size
    return dict(
        q=randn(rows, case.heads, case.dim),
        key_cache=randn(pages, case.page_size, case.kv_heads, case.dim),
        value_cache=randn(pages, case.page_size, case.kv_heads, case.dim),
        page_table=table.to(device=device, dtype=torch.int32),
        num_visible=visible.sum(1, dtype=torch.int32).to(device),
        out=randn(rows, case.heads, case.dim),
        lse=lse.to(device),
        sm_scale=case.dim**-0.5,
    )


def check(case: Case, device: str, seed: int = 0) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = make_inputs(case, device, dtype, seed)
    expected = fa3_tree_expand.attend_and_merge_reference(
        **{**x, "out": x["out"].clone()}
    )
    got = fa3_tree_expand.attend_and_merge(**{**x, "out": x["out"].clone()})
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    if case.shape == "none":  # only the prefix: the row as the prefix pass left it
        torch.testing.assert_close(got, x["out"], atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_reference(case):
    check(case, "cpu")
