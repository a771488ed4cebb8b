"""Triton's specialisation key of a launch, computed on a host without a GPU.

Triton compiles a kernel once per key: the constexpr values and, for runtime arguments, what it
specialises them on (a pointer's 16-byte alignment, an integer being 1 or a multiple of 16).
The key comes from the binder Triton's launcher runs before looking a compiled kernel up, so
tests that compare keys follow Triton's rules rather than restating them.
"""

from __future__ import annotations

from triton.backends import BaseBackend
from triton.runtime.jit import create_function_from_signature


def specialisation(kernel, value, constexpr: int = 4, **overrides) -> tuple:
    """The key of a launch of `kernel` (a @triton.jit function) passing `value` (a tensor or
    an int) for every runtime argument and `constexpr` for every constexpr, but `overrides`
    by name."""
    binder = create_function_from_signature(
        kernel.signature, kernel.params, BaseBackend
    )
    args = {p.name: constexpr if p.is_constexpr else value for p in kernel.params}
    args.update((name, v) for name, v in overrides.items() if name in args)
    return tuple(binder(**args)[1])
