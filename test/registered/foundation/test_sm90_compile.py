"""specpatch.testing.sm90_compile: triton kernels compiled for sm_90 on a host without a GPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.jit import JITFunction

from specpatch.testing.sm90_compile import compile_for_sm90, launches_compile_for_sm90


@triton.jit
def _widths_merge_kernel(a_ptr, b_ptr, out_ptr):
    # The loop variable `i` runs to an int64 bound in one branch and an int32 one in the
    # other when a_ptr holds int64: the (runtime) `if` cannot merge it.
    total = 0
    if tl.program_id(0) == 0:
        for i in range(0, tl.load(a_ptr)):
            total += 1
    else:
        for i in range(0, tl.load(b_ptr)):
            total += 1
    tl.store(out_ptr, total)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def test_what_the_gpu_host_refuses_fails_here():
    with pytest.raises(CompilationError, match="Mismatched type"):
        compile_for_sm90(
            _widths_merge_kernel,
            {"a_ptr": "*i64", "b_ptr": "*i32", "out_ptr": "*i32"},
            {},
        )
    compile_for_sm90(
        _widths_merge_kernel,
        {"a_ptr": "*i32", "b_ptr": "*i32", "out_ptr": "*i32"},
        {},
    )


def test_a_launch_compiles_with_the_types_of_its_arguments_and_runs_nothing():
    dst = torch.full((40,), 7, dtype=torch.int64)
    launcher = JITFunction.__getitem__
    with launches_compile_for_sm90() as compiled:
        _copy_kernel[(2,)](torch.arange(40), dst, 40, BLOCK=32, num_warps=1)
        with pytest.raises(CompilationError):
            _widths_merge_kernel[(1,)](
                torch.zeros(1, dtype=torch.int64),
                torch.zeros(1, dtype=torch.int32),
                dst,
            )
    assert compiled == ["_copy_kernel"]
    assert torch.equal(dst, torch.full((40,), 7, dtype=torch.int64))
    assert JITFunction.__getitem__ is launcher  # launches run again after the block


def test_unknown_arguments_are_refused():
    with pytest.raises(ValueError, match="not arguments"):
        compile_for_sm90(_copy_kernel, {"nope": "*i32"}, {"BLOCK": 32})
