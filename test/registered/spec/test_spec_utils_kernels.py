"""spec_utils' verify-time KV-slot kernels against their plain-torch references
(spec_utils_cases.py): on CPU through triton's interpreter, and on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import spec_utils_cases
from specpatch.interpret import run_under_interpreter

HERE = Path(__file__).resolve().parent
NAMES = [f"test_kernels_match_references[{c.name}]" for c in spec_utils_cases.CASES]


@pytest.fixture(scope="module")
def interpreter_run(tmp_path_factory):
    report = tmp_path_factory.mktemp("interp") / "junit.xml"
    try:
        return run_under_interpreter(HERE / "spec_utils_cases.py", report, cwd=HERE.parents[2])
    except RuntimeError as err:
        pytest.fail(str(err))


@pytest.mark.parametrize("name", NAMES)
def test_under_interpreter(interpreter_run, name):
    outcomes, tail = interpreter_run
    assert outcomes.get(name) == "passed", f"{name}: {outcomes.get(name, 'did not run')}\n{tail}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", spec_utils_cases.CASES, ids=[c.name for c in spec_utils_cases.CASES])
def test_kernels_match_references_on_cuda(case):
    spec_utils_cases.check(case, "cuda")
