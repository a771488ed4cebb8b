"""tree_compaction's triton kernel against its plain-torch reference (tree_compaction_cases.py):
on CPU through triton's interpreter, and on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

import tree_compaction_cases
from specpatch.interpret import run_under_interpreter

HERE = Path(__file__).resolve().parent
NAMES = [f"test_kernel_matches_reference[{c.name}]" for c in tree_compaction_cases.CASES]


@pytest.fixture(scope="module")
def interpreter_run(tmp_path_factory):
    report = tmp_path_factory.mktemp("interp") / "junit.xml"
    try:
        return run_under_interpreter(HERE / "tree_compaction_cases.py", report, cwd=HERE.parents[2])
    except RuntimeError as err:
        pytest.fail(str(err))


@pytest.mark.parametrize("name", NAMES)
def test_under_interpreter(interpreter_run, name):
    outcomes, tail = interpreter_run
    assert outcomes.get(name) == "passed", f"{name}: {outcomes.get(name, 'did not run')}\n{tail}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", tree_compaction_cases.CASES, ids=[c.name for c in tree_compaction_cases.CASES])
def test_kernel_matches_reference_on_cuda(case):
    tree_compaction_cases.check(case, "cuda")
