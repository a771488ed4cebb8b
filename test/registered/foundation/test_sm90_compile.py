"""specpatch.testing.sm90_compile: triton kernels compiled for sm_90 on a host without a GPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.jit import JITFunction

from specpatch.testing.sm90_compile import (
    compile_for_sm90,
    compile_launch,
    launches_compile_for_sm90,
)


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


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, stride, K: tl.constexpr, BLOCK_K: tl.constexpr):
    # A reduction loop over K whose loads triton pipelines through shared memory when it
    # knows x_ptr and stride are multiples of 16.
    rows = tl.arange(0, 16)
    acc = tl.zeros((16, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride + ks[None, :])
        acc = tl.dot(x, tl.trans(x), acc)
    tl.store(out_ptr + rows[:, None] * 16 + rows[None, :], acc)


def _pipelined_loads(compiled) -> int:
    return compiled.asm["ttgir"].count("async_copy_global_to_local")


def test_a_launch_is_specialised_as_the_gpu_hosts_launcher_does():
    x, out = torch.zeros(16, 256, dtype=torch.bfloat16), torch.zeros(16, 16)
    kwargs = dict(K=256, BLOCK_K=32, num_warps=4, num_stages=3)

    # A stride of 256 and aligned pointers: the loop's loads run in three stages.
    launched = compile_launch(_row_sums_kernel, (x, out, 256), dict(kwargs))
    assert _pipelined_loads(launched) == 3
    # Without the marks (an odd stride) triton keeps one buffer and loads through
    # registers: what every kernel compiled here looked like before the marks were passed.
    odd = compile_launch(_row_sums_kernel, (x, out, 255), dict(kwargs))
    assert _pipelined_loads(odd) == 0
    # An integer 1 becomes a constant, as on the GPU host.
    one = compile_launch(_row_sums_kernel, (x, out, 1), dict(kwargs))
    assert one.src.constants[(2,)] == 1


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
