"""spec_utils' verify-time KV-slot kernels against their plain-torch references
(spec_utils_cases.py): on CPU through triton's interpreter, and on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import spec_utils_cases

from specpatch.testing.interpret import interpreter_suite

HERE = Path(__file__).resolve().parent
NAMES = [f"test_kernels_match_references[{c.name}]" for c in spec_utils_cases.CASES]


interpreter_run, test_under_interpreter = interpreter_suite(
    HERE / "spec_utils_cases.py", NAMES
)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", spec_utils_cases.CASES, ids=[c.name for c in spec_utils_cases.CASES]
)
def test_kernels_match_references_on_cuda(case):
    spec_utils_cases.check(case, "cuda")
