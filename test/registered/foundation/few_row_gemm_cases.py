"""sglang.srt.layers.few_row_gemm's kernel against its plain-torch reference.

Each case is one linear layer's GEMM: rows (a decode's bs or a verify's bs x draft tokens),
output columns and reduction length, at sizes that leave partial tiles on every axis.
Collected by test_verify_gemm_bench.py: on CUDA directly (bf16, as a target's weights are), on
CPU through triton's interpreter (this file's own tests, which only run with
TRITON_INTERPRET=1; in fp16, since the interpreter's tl.dot reads bf16 tiles wrong).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from sglang.srt.layers import few_row_gemm


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    out_features: int
    in_features: int


CASES = [
    Case("one-row", 1, 40, 96),  # a chain's decode at bs 1: one row in a 16-row tile
    Case("rows-under-a-tile", 5, 64, 128),
    Case("partial-k-and-n", 33, 48, 200),  # neither axis a multiple of its tile
    Case("one-full-row-tile", 128, 64, 192),  # tree 16,3,32 at bs 4
    Case(
        "two-row-tiles", 130, 32, 64
    ),  # past 128 rows: a second, nearly empty row tile
    # 11 reduction steps of 64: split 4 ways 3 + 3 + 3 + 2, split 8 ways 2 each for five
    # splits, one for the sixth, none for the last two
    Case("uneven-splits", 64, 200, 704),
]


def check(case: Case, device: str, dtype: torch.dtype) -> None:
    """Every tiling the benchmark tries computes what the reference does: the same fp32 sums
    rounded once, so at most one rounding step apart; a split tiling gives the same bits on
    a second call and leaves its arrival counts at zero (the state its next call, or a CUDA
    graph's next replay, starts from)."""
    g = torch.Generator().manual_seed(case.rows * 7919 + case.out_features)
    x = torch.randn(case.rows, case.in_features, generator=g).to(dtype).to(device)
    weight = (
        (torch.randn(case.out_features, case.in_features, generator=g) * 0.05)
        .to(dtype)
        .to(device)
    )
    want = few_row_gemm.reference_linear(x, weight).float()
    # One unit in the last place of the largest output, the most one rounding can differ by.
    ulp = want.abs().max().item() * torch.finfo(dtype).eps
    for tiling in few_row_gemm.tilings_for(case.rows):
        needs = few_row_gemm.split_needs(case.rows, case.out_features, tiling)
        workspace = few_row_gemm.SplitWorkspace.allocate(device, *needs)
        got = few_row_gemm.few_row_linear(x, weight, tiling, workspace).float()
        assert got.shape == want.shape
        err = (got - want).abs().max().item()
        assert err <= ulp, f"{tiling.label}: off by {err} (one ulp {ulp})"
        if tiling.split_k > 1:
            again = few_row_gemm.few_row_linear(x, weight, tiling, workspace).float()
            assert torch.equal(again, got), tiling.label
            assert int(workspace.arrivals.count_nonzero()) == 0, tiling.label


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="run by test_verify_gemm_bench.py with TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_reference(case):
    check(case, "cpu", torch.float16)
