"""Compile triton kernels for an H100 (sm_90) on a host without a GPU.

Triton's interpreter runs a kernel's arithmetic on the CPU but not its compiler: a kernel can
pass every interpreter test and still fail to compile on the GPU host (e.g. an `if` whose two
branches give one variable different integer widths). `triton.compile` needs no GPU up to the
cubin, so CI catches those, with the argument types the server passes:

    compile_for_sm90(kernel, {"Q": "*bf16", ...}, {"BLOCK": 32})   # types spelled out
    with launches_compile_for_sm90() as compiled:                   # types of a real call
        wrapper(cpu_tensors...)     # each kernel[grid](...) compiles; nothing runs
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

H100 = GPUTarget("cuda", 90, 32)
# Launch options a kernel[grid](...) call may pass that are compile options, not arguments.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def compile_for_sm90(
    kernel,
    arg_types: Mapping[str, str],
    constexprs: Mapping[str, Any],
    default_type: str = "i32",
    options: Mapping[str, Any] = (),
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
    return triton.compile(source, target=H100, options=dict(options))


def compile_launch(kernel: JITFunction, args: tuple, kwargs: dict):
    """Compile `kernel` as `kernel[grid](*args, **kwargs)` would have it compiled: constexpr
    parameters (and None arguments, which triton makes constant) by value, the rest by the
    type of what is passed (a CPU tensor stands for a device tensor of its dtype)."""
    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
    # @triton.jit(debug=True) compiles its device asserts in.
    options["debug"] = bool(kernel.debug)
    bound = kernel.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arg_types, constexprs = {}, {}
    for param in kernel.params:
        value = bound.arguments[param.name]
        if param.is_constexpr or value is None:
            constexprs[param.name] = value
        else:
            arg_types[param.name] = mangle_type(value)
    return compile_for_sm90(kernel, arg_types, constexprs, options=options)


@contextlib.contextmanager
def launches_compile_for_sm90() -> Iterator[list[str]]:
    """Inside, `kernel[grid](...)` compiles the kernel for sm_90 and launches nothing; yields
    the names of the kernels compiled, in launch order. What the launches would have written
    stays unwritten: this checks that a wrapper's kernels compile, not what they compute.
    """
    compiled: list[str] = []

    def getitem(kernel, grid):
        def launch(*args, **kwargs):
            compile_launch(kernel, args, kwargs)
            compiled.append(kernel.__name__)

        return launch

    original = JITFunction.__getitem__
    JITFunction.__getitem__ = getitem
    try:
        yield compiled
    finally:
        JITFunction.__getitem__ = original
