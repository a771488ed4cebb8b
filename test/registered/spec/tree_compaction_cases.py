"""The accepted-path compaction kernel against its plain-torch reference.

Each case is a verify batch (accept_index, verify slots, predict, hidden states, per-token
captures); `check` runs tree_compaction's triton kernel and its torch reference on copies and
compares every output.
Collected by test_tree_compaction_kernel.py: on CUDA directly, on CPU through triton's
interpreter (this file's own test, which only runs with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from sglang.srt.speculative.tree_compaction import (
    compact_path_rows_reference,
    compact_path_rows_triton,
)


@dataclass
class Case:
    name: str
    # [bs, max_accept] flat rows of each accepted path, root first, -1 past its end
    accept_index: torch.Tensor
    num_draft_tokens: int
    hidden_size: Optional[int]  # None: hidden states not captured
    predict_dtype: torch.dtype = torch.int32
    strided_hidden: bool = False  # hidden states as a column slice of a wider buffer
    # Per-token captures, each (num_layers, k, device_k): int32 rows [rows, num_layers, k], a
    # column slice of a [rows, num_layers, device_k] device cache as the capturers hand it
    # out (device_k > k: fused shared experts' columns, dropped for the host).
    captures: tuple[tuple[int, int, int], ...] = ()


def paths(
    lengths: list[int], num_draft_tokens: int, max_accept: int, seed: int, deepest=False
):
    """Increasing tree nodes from the root per request (what verify returns), -1 padded;
    deepest=True takes the last nodes of the block, so every row but the root moves."""
    rng = random.Random(seed)
    accept_index = torch.full((len(lengths), max_accept), -1, dtype=torch.int32)
    for b, n in enumerate(lengths):
        later = (
            list(range(num_draft_tokens - n + 1, num_draft_tokens))
            if deepest
            else sorted(rng.sample(range(1, num_draft_tokens), n - 1))
        )
        accept_index[b, :n] = torch.tensor([0] + later) + b * num_draft_tokens
    return accept_index


def _random_lengths(bs: int, max_accept: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, max_accept) for _ in range(bs)]


CASES = [
    Case("bs1-nothing-accepted", paths([1], 8, 4, 0), 8, 64),
    Case("bs1-everything-accepted", paths([4], 8, 4, 0, deepest=True), 8, 64),
    Case("bs1-chain-prefix", torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), 8, 64),
    Case(
        "ragged-skip",
        torch.tensor(
            [[0, 2, 3, -1], [4, -1, -1, -1], [8, 9, 11, -1]], dtype=torch.int32
        ),
        4,
        33,
    ),
    Case("all-nothing-accepted-bs5", paths([1] * 5, 16, 6, 1), 16, 300),
    Case("all-deepest-bs7", paths([6] * 7, 16, 6, 2, deepest=True), 16, 300),
    Case("random-bs3-d64", paths(_random_lengths(3, 6, 3), 64, 6, 3), 64, 520),
    Case(
        "random-bs48-d8-int64",
        paths(_random_lengths(48, 4, 4), 8, 4, 4),
        8,
        256,
        torch.int64,
    ),
    Case("random-bs16-no-hidden", paths(_random_lengths(16, 4, 5), 8, 4, 5), 8, None),
    Case(
        "random-bs9-strided-hidden",
        paths(_random_lengths(9, 5, 6), 32, 5, 6),
        32,
        130,
        strided_hidden=True,
    ),
    Case("block-equals-path", paths(_random_lengths(6, 3, 7), 3, 3, 7), 3, 17),
    # Captures: routed experts [rows, layers, topk] and the NSA indexer's top-k.
    Case(
        "captures-bs1-nothing-accepted",
        paths([1], 8, 4, 8),
        8,
        64,
        captures=((2, 4, 4),),
    ),
    Case(
        "captures-bs1-everything-accepted",
        paths([4], 8, 4, 8, deepest=True),
        8,
        64,
        captures=((2, 4, 4),),
    ),
    Case(
        "captures-ragged-skip",
        torch.tensor(
            [[0, 2, 3, -1], [4, -1, -1, -1], [8, 9, 11, -1]], dtype=torch.int32
        ),
        4,
        33,
        captures=((3, 2, 3),),
    ),
    Case(
        "captures-random-bs48-with-hidden",
        paths(_random_lengths(48, 4, 9), 8, 4, 9),
        8,
        256,
        captures=((4, 8, 8), (2, 16, 16)),
    ),
    Case(
        "captures-without-hidden",
        paths(_random_lengths(5, 6, 10), 16, 6, 10),
        16,
        None,
        captures=((2, 2, 2),),
    ),
    # Columns over several tiles of a small hidden size (an indexer keeps 2048 per layer).
    Case(
        "capture-wider-than-hidden",
        paths(_random_lengths(3, 4, 11), 8, 4, 11),
        8,
        40,
        captures=((3, 200, 200),),
    ),
    Case(
        "captures-sliced-from-wider-cache",
        paths(_random_lengths(7, 5, 12), 32, 5, 12),
        32,
        130,
        strided_hidden=True,
        captures=((3, 4, 5), (2, 6, 8)),
    ),
    # Four row tensors: one more than the kernel fuses; the last moves by torch.
    Case(
        "captures-more-than-fused",
        paths(_random_lengths(6, 4, 13), 8, 4, 13),
        8,
        64,
        captures=((2, 4, 4), (2, 2, 3), (1, 3, 3)),
    ),
]


def _inputs(case: Case, device):
    gen = torch.Generator().manual_seed(len(case.name))
    bs = case.accept_index.shape[0]
    rows = bs * case.num_draft_tokens
    # Verify slots are scattered over the pool, as the allocator leaves them.
    out_cache_loc = torch.randperm(rows * 3, generator=gen)[:rows]
    predict = torch.randint(0, 32000, (rows,), generator=gen).to(case.predict_dtype)
    hidden = None
    if case.hidden_size is not None:
        width = case.hidden_size * 2 if case.strided_hidden else case.hidden_size
        hidden = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
        if case.strided_hidden:
            hidden = hidden[:, 1::2]
    # [rows, num_layers, device_k] device caches, each compacted through its [..., :k] view
    caches = [
        torch.randint(
            0, 1 << 20, (rows, num_layers, device_k), generator=gen, dtype=torch.int32
        )
        for num_layers, _, device_k in case.captures
    ]
    inputs = [
        x.to(device) if x is not None else None
        for x in (case.accept_index, out_cache_loc, predict, hidden)
    ]
    return inputs, [cache.to(device) for cache in caches]


def _capture_views(case: Case, caches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [cache[:, :, :k] for cache, (_, k, _) in zip(caches, case.captures)]


def check(case: Case, device) -> None:
    (accept_index, out_cache_loc, predict, hidden), caches = _inputs(case, device)
    # The reference works in place on CPU copies.
    ref_predict = predict.cpu().clone()
    ref_hidden = hidden.cpu().clone() if hidden is not None else None
    ref_caches = [cache.cpu().clone() for cache in caches]
    ref_tgt, ref_src, ref_bonus = compact_path_rows_reference(
        accept_index.cpu(),
        case.num_draft_tokens,
        out_cache_loc.cpu(),
        ref_predict,
        ref_hidden,
        _capture_views(case, ref_caches),
    )

    tgt, src, bonus = compact_path_rows_triton(
        accept_index,
        case.num_draft_tokens,
        out_cache_loc,
        predict,
        hidden,
        _capture_views(case, caches),
    )

    assert tgt.dtype == src.dtype == torch.int64
    assert torch.equal(tgt.cpu(), ref_tgt) and torch.equal(src.cpu(), ref_src)
    assert bonus.dtype == ref_bonus.dtype == torch.int32
    assert torch.equal(bonus.cpu(), ref_bonus)
    assert torch.equal(predict.cpu(), ref_predict)
    if hidden is not None:
        assert torch.equal(hidden.cpu(), ref_hidden)
    for i, (cache, ref_cache) in enumerate(zip(caches, ref_caches)):
        # The whole device cache: the columns past the view are left as they were.
        assert torch.equal(cache.cpu(), ref_cache), f"capture {i} differs"


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="run by test_tree_compaction_kernel.py with TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_reference(case):
    check(case, "cpu")
