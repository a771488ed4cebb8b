"""tree_compaction's triton kernel against its plain-torch reference (tree_compaction_cases.py):
on CPU through triton's interpreter, and on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import tree_compaction_cases

from specpatch.testing.interpret import interpreter_suite

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
