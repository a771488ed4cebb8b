"""triton.jit for the small index kernels a decode step launches eagerly, around its CUDA-graph
replays: compiled once per set of constexpr values.

Triton compiles a kernel once per specialisation of its arguments, not once per constexpr set:
each pointer argument is specialised on whether its address is 16-byte aligned, each integer on
whether it is 1 or a multiple of 16. The decode loop's index kernels (KV slot assignment, KV
index building, KV moves, split counts) take slices whose alignment changes from step to step
(the second row of a [2, bs] int32 tensor is aligned only when bs % 4 == 0; an allocator's
slice starts where the free list happens to be) and counts that change with the batch, so a
running server keeps meeting specialisations it has not compiled. Each one is a compile in the
middle of a decode step; a fresh process loads the ones Triton's on-disk cache holds, but a
warm-up cannot reach every combination of alignments, powers of two and counts. These kernels
do a few loads and stores per program: what the hints could save them is small next to one
compile, so they give the hints up.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

import triton


def eager_jit(fn: Optional[Callable] = None, **jit_kwargs):
    """@eager_jit or @eager_jit(debug=True): triton.jit with no specialisation on the
    alignment of pointer arguments or on the values of integer ones (constexprs still
    specialise, as they must)."""

    def decorate(fn: Callable):
        # Triton refuses constexprs in these lists; it takes a parameter whose annotation
        # names constexpr for one (triton.runtime.jit.KernelParam.is_constexpr).
        runtime = [
            name
            for name, param in inspect.signature(fn).parameters.items()
            if "constexpr" not in str(param.annotation)
        ]
        return triton.jit(
            do_not_specialize=runtime,
            do_not_specialize_on_alignment=runtime,
            **jit_kwargs,
        )(fn)

    return decorate if fn is None else decorate(fn)
