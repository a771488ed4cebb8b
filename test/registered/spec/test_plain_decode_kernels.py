"""plain_decode_kernels' triton kernels against their plain-torch references
(plain_decode_kernel_cases.py): on CPU through triton's interpreter, and on CUDA."""

from __future__ import annotations

from pathlib import Path

import plain_decode_kernel_cases as cases
import pytest
import torch

from sglang.srt.speculative.plain_decode_kernels import (
    decode_inputs_triton,
    push_rows_triton,
)
from specpatch.testing.interpret import interpreter_suite
from specpatch.testing.sm90_compile import launches_compile_for_sm90

HERE = Path(__file__).resolve().parent
IDS = [c.name for c in cases.CASES]
NAMES = [
    f"test_{kernel}_kernel_matches_reference[{name}]"
    for kernel in ("decode_inputs", "push_rows")
    for name in IDS
]


interpreter_run, test_under_interpreter = interpreter_suite(
    HERE / "plain_decode_kernel_cases.py", NAMES
)


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases.CASES, ids=IDS)
def test_decode_inputs_kernel_matches_reference_on_cuda(case):
    cases.check_decode_inputs(case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases.CASES, ids=IDS)
def test_push_rows_kernel_matches_reference_on_cuda(case):
    cases.check_push_rows(case, "cuda")


@pytest.mark.parametrize("case", cases.CASES, ids=IDS)
def test_kernels_compile_for_sm90(case):
    """Triton's compiler, which the interpreter does not run, takes each case's types."""
    req_to_token, slots, seq_lens, bonus = cases._batch(case, "cpu")
    hidden = torch.zeros(case.bs, case.hidden_size, dtype=case.hidden_dtype)
    ring = cases._rings(case, cases.num_slots_of(case), torch.Generator())
    with launches_compile_for_sm90() as compiled:
        decode_inputs_triton(req_to_token, slots, seq_lens, bonus)
        push_rows_triton(*ring, slots, hidden, torch.zeros_like(slots))
    assert compiled == ["_decode_inputs_kernel", "_push_rows_kernel"]
