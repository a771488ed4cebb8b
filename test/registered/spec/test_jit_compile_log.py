"""sglang.srt.utils.jit_compile_log: the Triton kernel variants a process compiles (or loads
from Triton's cache), named with their constexprs and timed between Triton's JIT hooks, and
written into the shape policy's trace beside the step they delayed.

On the CPU the hooks are called through Triton's own hook call (JITFunction._call_hook, with
the arguments its launcher passes), so a Triton that changes what its hooks receive fails here.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.nvidia.compiler import CUDAOptions
from triton.runtime.jit import compute_cache_key

from sglang.srt.speculative import shape_runtime as rt
from sglang.srt.speculative.shape_policy import Shape
from sglang.srt.utils.jit_compile_log import JitCompile, JitCompileLog
from specpatch.testing.triton_keys import specialisation


@triton.jit
def _slots_kernel(slots, n, bs_upper: tl.constexpr, PAGE: tl.constexpr):
    pass


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def own_hooks(monkeypatch):
    """Triton's hooks as this test leaves them are put back afterwards."""
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)


def compile_through_hooks(kernel, clock: Clock, seconds: float, **constexprs) -> object:
    """What JITFunction._do_compile does around a compile, without compiling: the cache hook,
    `seconds` on the clock, the post-compile hook. Returns the cache hook's answer."""
    specialization = list(specialisation(kernel, torch.zeros(4), **constexprs))
    options = CUDAOptions()
    key = compute_cache_key({}, specialization, options)
    signature = {p.name: "*fp32" for p in kernel.params if not p.is_constexpr}
    constants = {(p.num,): constexprs[p.name] for p in kernel.params if p.is_constexpr}
    hook_args = (key, signature, 0, constants, options, [{}], False)
    answer = kernel._call_hook(knobs.runtime.jit_cache_hook, *hook_args)
    clock.now += seconds
    kernel._call_hook(knobs.runtime.jit_post_compile_hook, *hook_args)
    return answer


def test_a_compile_is_named_with_its_constexprs_and_timed(own_hooks):
    log = JitCompileLog(clock=(clock := Clock())).install()

    compile_through_hooks(_slots_kernel, clock, 0.25, bs_upper=32, PAGE=1)
    compile_through_hooks(_slots_kernel, clock, 0.004, bs_upper=64, PAGE=1)

    assert log.drain() == [
        JitCompile("_slots_kernel", (("bs_upper", 32), ("PAGE", 1)), 0.25),
        JitCompile(
            "_slots_kernel", (("bs_upper", 64), ("PAGE", 1)), pytest.approx(0.004)
        ),
    ]
    assert log.drain() == []


def test_a_kernel_defined_in_a_function_is_named_without_its_scope(own_hooks):
    """Triton names a hook's function by its qualified name; the log keeps the last part."""

    @triton.jit
    def fill(out, BLOCK: tl.constexpr):
        pass

    log = JitCompileLog(clock=(clock := Clock())).install()
    compile_through_hooks(fill, clock, 0.5, BLOCK=64)

    (compiled,) = log.drain()
    assert compiled.label() == "fill[BLOCK=64]"


def test_the_label_names_kernel_and_constexprs():
    assert (
        JitCompile("_slots_kernel", (("bs_upper", 32), ("PAGE", 1)), 0.25).label()
        == "_slots_kernel[bs_upper=32,PAGE=1]"
    )
    assert JitCompile("plain", (), 0.1).label() == "plain"


def test_hooks_already_installed_are_still_called_and_answered(own_hooks):
    seen = []

    def skip_compiles(**hook_args):
        seen.append(("before", hook_args["fn"].name))
        return True  # Triton then skips the compile

    def after(**hook_args):
        seen.append(("after", hook_args["fn"].name))

    knobs.runtime.jit_cache_hook = skip_compiles
    knobs.runtime.jit_post_compile_hook = after
    log = JitCompileLog(clock=(clock := Clock())).install()

    answer = compile_through_hooks(_slots_kernel, clock, 0.1, bs_upper=8, PAGE=16)

    assert answer is True
    assert seen == [("before", "_slots_kernel"), ("after", "_slots_kernel")]
    assert [c.label() for c in log.drain()] == ["_slots_kernel[bs_upper=8,PAGE=16]"]


def test_the_shape_trace_lists_compiles_on_the_next_line_only():
    log = JitCompileLog(clock=(clock := Clock()))
    stream = io.StringIO()
    trace = rt.ShapeTrace(stream, log)
    wide, narrow = Shape(16, 3, 32), Shape(4, 3, 8)

    log.started("_slots_kernel", "key")
    clock.now += 0.3125
    log.finished("_slots_kernel", "key", (("bs_upper", 32),))
    trace.switch(7, wide, narrow, 27)
    trace.switch(8, narrow, wide, 12)

    first, second = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert first == {
        "step": 7,
        "switch": ["16,3,32", "4,3,8"],
        "bs": 27,
        "compiles": [["_slots_kernel[bs_upper=32]", 312.5]],
    }
    assert "compiles" not in second


@pytest.mark.gpu
def test_a_launch_that_compiles_is_logged_on_the_gpu(own_hooks):
    """On the GPU: a kernel launched with a constexpr this process has not compiled shows up
    once, with the time its compile took; launching it again adds nothing."""

    @triton.jit
    def fill(out, value, BLOCK: tl.constexpr):
        tl.store(out + tl.arange(0, BLOCK), tl.full((BLOCK,), value, tl.int32))

    log = JitCompileLog().install()
    out = torch.zeros(64, dtype=torch.int32, device="cuda")
    fill[(1,)](out, 7, BLOCK=64)
    fill[(1,)](out, 8, BLOCK=64)
    torch.cuda.synchronize()

    (compiled,) = log.drain()
    assert compiled.label() == "fill[BLOCK=64]"
    assert compiled.seconds > 0
    assert int(out[0]) == 8
