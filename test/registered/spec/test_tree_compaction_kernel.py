"""tree_compaction's triton kernel against its plain-torch reference (tree_compaction_cases.py):
on CPU through triton's interpreter, and on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import tree_compaction_cases

from sglang.srt.speculative.tree_compaction import (
    _compact_accepted_path_kernel,
    compact_path_rows_triton,
)
from specpatch.testing.interpret import interpreter_suite
from specpatch.testing.sm90_compile import launches_compile_for_sm90
from specpatch.testing.triton_keys import specialisation

HERE = Path(__file__).resolve().parent
NAMES = [
    f"test_kernel_matches_reference[{c.name}]" for c in tree_compaction_cases.CASES
]


interpreter_run, test_under_interpreter = interpreter_suite(
    HERE / "tree_compaction_cases.py", NAMES
)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    tree_compaction_cases.CASES,
    ids=[c.name for c in tree_compaction_cases.CASES],
)
def test_kernel_matches_reference_on_cuda(case):
    tree_compaction_cases.check(case, "cuda")


@pytest.mark.parametrize(
    "case",
    tree_compaction_cases.CASES,
    ids=[c.name for c in tree_compaction_cases.CASES],
)
def test_kernel_compiles_for_sm90(case):
    """Triton's compiler, which the interpreter does not run, takes each case's types."""
    (accept_index, out_cache_loc, predict, hidden), caches = (
        tree_compaction_cases._inputs(case, "cpu")
    )
    with launches_compile_for_sm90() as compiled:
        compact_path_rows_triton(
            accept_index,
            case.num_draft_tokens,
            out_cache_loc,
            predict,
            hidden,
            tree_compaction_cases._capture_views(case, caches),
        )
    assert compiled == ["_compact_accepted_path_kernel"]


def test_the_path_kernel_compiles_once_for_every_shape_and_slot_slice():
    """The verify's KV slots (a slice of the allocator's free list, aligned or not) and the
    path's lengths (max_accept, num_draft_tokens: 4, 8, 32 for a policy's chain, narrow and
    wide tree) select no compile of their own; the row tensors' alignment still does."""
    slots = torch.zeros(64, dtype=torch.int64)
    keys = {
        specialisation(
            _compact_accepted_path_kernel,
            slots,
            out_cache_loc_ptr=loc,
            num_draft_tokens=n,
            max_accept=4,
        )
        for loc in (slots, slots[1:], slots[3:])
        for n in (4, 8, 32)
    }
    assert len(keys) == 1
    rows = {
        specialisation(_compact_accepted_path_kernel, slots, rows0_ptr=r)
        for r in (slots, slots[1:])
    }
    assert len(rows) == 2, "the row tensors' alignment no longer specialises"
