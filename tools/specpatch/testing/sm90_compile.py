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
from typing import Any, Collection, Iterator, Mapping, Optional

import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, native_specialize_impl

H100 = GPUTarget("cuda", 90, 32)
# Launch options a kernel[grid](...) call may pass that are compile options, not arguments.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def compile_for_sm90(
    kernel,
    arg_types: Mapping[str, str],
    constexprs: Mapping[str, Any],
    default_type: str = "i32",
    options: Mapping[str, Any] = (),
    aligned: Collection[str] = (),
):
    """Compile `kernel` (a @triton.jit function) to a cubin for sm_90. arg_types names
    triton's type of each pointer or scalar argument ("*bf16", "*i64", "fp32"); arguments it
    leaves out are `default_type` (strides and lengths); constexprs gives the constant ones;
    `aligned` names the arguments known to be multiples of 16 (pointers: 16-byte aligned).
    Raises triton's CompilationError where the GPU host would."""
    unknown = set(arg_types) | set(constexprs) | set(aligned)
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
        attrs={
            (kernel.arg_names.index(name),): BaseBackend.parse_attr("D")
            for name in aligned
        },
    )
    return triton.compile(source, target=H100, options=dict(options))


def compile_launch(kernel: JITFunction, args: tuple, kwargs: dict):
    """Compile `kernel` as `kernel[grid](*args, **kwargs)` compiles it on the GPU host:
    constexpr parameters (and None arguments, which triton makes constant) by value, the rest
    specialised as triton's launcher specialises them: an integer 1 becomes a constant, and
    integers that are multiples of 16 and 16-byte aligned pointers are marked so (a CPU tensor
    stands for a device tensor of its dtype and alignment). The marks are what lets triton
    pipeline a loop's loads through shared memory (cp.async), so a kernel compiled without
    them is not the kernel the GPU runs: it has neither its stages nor their shared memory.
    """
    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
    # @triton.jit(debug=True) compiles its device asserts in.
    options["debug"] = bool(kernel.debug)
    bound = kernel.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arg_types, constexprs, aligned = {}, {}, []
    for param in kernel.params:
        value = bound.arguments[param.name]
        if param.is_constexpr or value is None:
            constexprs[param.name] = value
            continue
        ty, spec = native_specialize_impl(
            BaseBackend,
            value,
            param.is_const,
            not param.do_not_specialize,
            not param.do_not_specialize_on_alignment,
        )
        if ty == "constexpr":
            constexprs[param.name] = spec
            continue
        arg_types[param.name] = ty
        if spec == "D":
            aligned.append(param.name)
    return compile_for_sm90(
        kernel, arg_types, constexprs, options=options, aligned=aligned
    )


@contextlib.contextmanager
def launches_compile_for_sm90(
    binaries: Optional[list] = None,
) -> Iterator[list[str]]:
    """Inside, `kernel[grid](...)` compiles the kernel for sm_90 and launches nothing; yields
    the names of the kernels compiled, in launch order, and appends each compiled kernel
    (triton's CompiledKernel: its asm and metadata) to `binaries` where given. What the
    launches would have written stays unwritten: this checks that a wrapper's kernels
    compile, not what they compute.
    """
    compiled: list[str] = []

    def getitem(kernel, grid):
        def launch(*args, **kwargs):
            binary = compile_launch(kernel, args, kwargs)
            compiled.append(kernel.__name__)
            if binaries is not None:
                binaries.append(binary)

        return launch

    original = JITFunction.__getitem__
    JITFunction.__getitem__ = getitem
    try:
        yield compiled
    finally:
        JITFunction.__getitem__ = original
