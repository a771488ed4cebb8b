"""The triton kernels against the reference on CPU, through triton's interpreter.

TRITON_INTERPRET must be set before triton compiles anything, and the rest of the suite runs
without it, so interpreter_cases.py runs once per session in a subprocess; each of its tests
is reported here as its own test."""

from __future__ import annotations

from pathlib import Path

import kernel_cases
import pytest
import torch

from sglang.srt.kv_canary import kernels
from specpatch.testing.interpret import interpreter_suite
from specpatch.testing.sm90_compile import launches_compile_for_sm90

CPU = torch.device("cpu")

HERE = Path(__file__).resolve().parent
INNER = HERE / "interpreter_cases.py"

INNER_TESTS = (
    [f"test_kernel_matches_reference[{c.name}]" for c in kernel_cases.CASES]
    + [
        f"test_stage_kernel_matches_reference[{c.name}]"
        for c in kernel_cases.STAGE_CASES
    ]
    + ["test_the_manager_picks_the_kernels_here"]
    + [f"test_simulated_run_is_clean_with_kernels[{f}]" for f in ("chain", "tree")]
    + [
        f"test_injected_faults_are_detected_with_kernels[{k}]"
        for k in ("corrupt_slot", "misroute_req_to_token", "free_in_use")
    ]
)


interpreter_run, test_under_interpreter = interpreter_suite(INNER, INNER_TESTS)


def test_every_interpreter_test_is_reported_here(interpreter_run):
    outcomes, _ = interpreter_run
    assert set(outcomes) == set(INNER_TESTS)


@pytest.mark.parametrize(
    "case", kernel_cases.CASES, ids=[c.name for c in kernel_cases.CASES]
)
def test_verify_and_write_kernels_compile_for_sm90(case):
    """Triton's compiler, which the interpreter does not run, takes each case's types. An
    empty batch launches nothing."""
    built = kernel_cases.build(case, CPU)
    with launches_compile_for_sm90() as compiled:
        kernel_cases.run(kernels, built)
    launched = ["_verify_kernel", "_write_kernel"] if case.name != "empty_batch" else []
    assert compiled == launched


@pytest.mark.parametrize(
    "case", kernel_cases.STAGE_CASES, ids=[c.name for c in kernel_cases.STAGE_CASES]
)
def test_stage_kernel_compiles_for_sm90(case):
    with launches_compile_for_sm90() as compiled:
        kernels.stage_plan(*kernel_cases.build_stage(case, CPU))
    assert compiled == ["_stage_kernel"]
