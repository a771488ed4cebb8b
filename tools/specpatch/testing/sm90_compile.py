"""Compile a triton kernel for an H100 (sm_90) on a host without a GPU.

Triton's interpreter runs a kernel's arithmetic on the CPU but not its compiler: a kernel can
pass every interpreter test and still fail to compile on the GPU host (e.g. an `if` whose two
branches give one variable different integer widths). `triton.compile` needs no GPU up to the
cubin, so CI catches those, with the argument types the server passes.
"""

from __future__ import annotations

from typing import Any, Mapping

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H100 = GPUTarget("cuda", 90, 32)


def compile_for_sm90(
    kernel,
    arg_types: Mapping[str, str],
    constexprs: Mapping[str, Any],
    default_type: str = "i32",
):
    """Compile `kernel` (a @triton.jit function) to a cubin for sm_90. arg_types names
    triton's type of each pointer or scalar argument ("*bf16", "*i64", "fp32"); arguments it
    leaves out are `default_type` (strides and lengths); constexprs gives the constant ones.
    Raises triton's CompilationError where the GPU host would."""
    unknown = set(arg_types) | set(constexprs)
    unknown -= set(kernel.arg_names)
    if unknown:
        raise ValueError(f"not arguments of {kernel.__name__}: {sorted(unknown)}")
    signature = {
        name: ("constexpr" if name in constexprs else arg_types.get(name, default_type))
        for name in kernel.arg_names
    }
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={
            (kernel.arg_names.index(name),): value for name, value in constexprs.items()
        },
    )
    return triton.compile(source, target=H100)
