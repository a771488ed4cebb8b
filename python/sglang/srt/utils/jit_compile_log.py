"""The Triton kernels a process compiles, and how long each took, collected until drained.

Triton compiles a kernel variant (or loads it from its on-disk cache) the first time a process
launches it with a new set of constexprs or argument specialisations. A decode step that does
so takes hundreds of milliseconds instead of a few, and nothing in the step says why. This log
hangs on Triton's own JIT hooks (`triton.knobs.runtime.jit_cache_hook`, called before a
variant is compiled or loaded, and `jit_post_compile_hook`, after) and keeps, per variant, the
kernel's name, its constexprs and the seconds between the two hooks; the shape policy's trace
writes them beside the step they fell in (shape_runtime.ShapeTrace).

Hooks that were installed before this log are still called, and their answer (a true return
from jit_cache_hook tells Triton to skip the compile) is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from triton import knobs


@dataclass(frozen=True)
class JitCompile:
    kernel: str  # the @triton.jit function's name, without its enclosing scopes
    constexprs: tuple[tuple[str, Any], ...]  # (parameter, value), in parameter order
    seconds: float  # compile, or load from Triton's cache, of this variant

    def label(self) -> str:
        args = ",".join(f"{name}={value}" for name, value in self.constexprs)
        return f"{self.kernel}[{args}]" if args else self.kernel


def constexpr_names(
    arg_names: list[str], constants: Mapping[tuple, Any]
) -> tuple[tuple[str, Any], ...]:
    """Triton keys a variant's constants by argument path, (index,) for a plain parameter;
    name them. Constants of nested (tuple) arguments keep their path."""
    named = []
    for path, value in sorted(constants.items()):
        name = arg_names[path[0]] if len(path) == 1 else str(path)
        named.append(
            (name, value if isinstance(value, (int, float, bool)) else str(value))
        )
    return tuple(named)


def kernel_name(fn_info: Any) -> str:
    """A hook's function by its own name: Triton passes the qualified one, which for a kernel
    defined in a function or class carries that scope ("outer.<locals>.fill")."""
    return fn_info.name.rsplit(".", 1)[-1]


class JitCompileLog:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._started: dict[tuple[str, str], float] = {}
        self._done: list[JitCompile] = []

    def install(self) -> "JitCompileLog":
        """Hang this log on Triton's JIT hooks of this process, after any already there."""
        before_previous = knobs.runtime.jit_cache_hook
        after_previous = knobs.runtime.jit_post_compile_hook

        def before(**hook_args) -> Optional[bool]:
            self.started(kernel_name(hook_args["fn"]), hook_args["key"])
            if before_previous is not None:
                return before_previous(**hook_args)
            return None

        def after(**hook_args) -> Optional[bool]:
            fn = hook_args["fn"]
            self.finished(
                kernel_name(fn),
                hook_args["key"],
                constexpr_names(
                    fn.jit_function.arg_names, hook_args["compile"]["constants"]
                ),
            )
            if after_previous is not None:
                return after_previous(**hook_args)
            return None

        knobs.runtime.jit_cache_hook = before
        knobs.runtime.jit_post_compile_hook = after
        return self

    def started(self, kernel: str, key: Any) -> None:
        self._started[kernel, str(key)] = self._clock()

    def finished(
        self, kernel: str, key: Any, constexprs: tuple[tuple[str, Any], ...]
    ) -> None:
        start = self._started.pop((kernel, str(key)), None)
        seconds = self._clock() - start if start is not None else float("nan")
        self._done.append(JitCompile(kernel, constexprs, seconds))

    def drain(self) -> list[JitCompile]:
        """The compiles finished since the last drain, in the order they finished."""
        done, self._done = self._done, []
        return done
