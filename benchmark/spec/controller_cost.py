"""What the shape policy's controller costs the scheduler per decode step, on the CPU alone.

At large batch on a small target a speculating engine is bound by its scheduler's host loop,
so every microsecond the controller spends choosing a shape and learning from a result is
taken from the decode loop. This drives sglang's ShapeController through a run of decode
steps at one batch size, as the scheduler does (before_decode, after_decode, then the result
of the step before under the overlap scheduler), with a worker that applies nothing and a
step clock that advances by a fixed device time per shape, and prints the Python function
calls and the wall time per step, with the trace file off and on:

    python benchmark/spec/controller_cost.py --bs 48 --steps 20000

Calls per step are exact and do not depend on the host; microseconds do (compare two builds
on one host, in one run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from sglang.srt.speculative import shape_runtime as rt
from sglang.srt.speculative.shape_policy import Shape

SHAPES = ("16,3,32", "4,3,8", "1,3,4", "none")
# Device seconds a step of each shape takes in this run (the 1.21B target's at bs 48, about):
# what makes the policy settle on one shape and probe the others, as in a server.
STEP_SECONDS = {"16,3,32": 9e-3, "4,3,8": 4.8e-3, "1,3,4": 3.9e-3, "none": 2.1e-3}


class _Worker:
    """Builds and applies nothing: the controller's own cost is measured."""

    def build_shape_runtime_state(self, shape: Shape) -> rt.ShapeRuntimeState:
        return rt.ShapeRuntimeState(shape, None, None)

    def apply_shape_runtime_state(self, state: rt.ShapeRuntimeState) -> None:
        pass


class _Clock:
    """A StepClock whose marks are the device time it shows."""

    def __init__(self):
        self.now = 0.0

    def mark(self) -> float:
        return self.now

    def seconds(self, start: float, end: float) -> float:
        return end - start


@dataclass
class Cost:
    calls_per_step: float
    us_per_step: float
    steps_by_shape: dict[str, int]


def _controller(trace: bool, workdir: str) -> tuple[rt.ShapeController, _Clock]:
    raw: dict[str, object] = {"shapes": list(SHAPES)}
    if trace:
        raw["trace"] = os.path.join(workdir, "trace.jsonl")
    path = os.path.join(workdir, "policy.json")
    with open(path, "w") as f:
        json.dump(raw, f)
    config = rt.read_shape_policy(path)
    clock = _Clock()
    initial = Shape.parse(SHAPES[0])
    controller = rt.ShapeController(
        _Worker(),
        config,
        initial,
        clock=clock,
        trace=rt.ShapeTrace(open(os.devnull, "w")) if trace else None,
    )
    controller.register(rt.ShapeRuntimeState(initial, None, None))
    controller.init_states()
    return controller, clock


def measure(bs: int, steps: int, trace: bool, warm_up: int = 1000) -> Cost:
    """Run warm_up steps (the policy settles), then `steps` measured ones."""
    with tempfile.TemporaryDirectory() as workdir:
        controller, clock = _controller(trace, workdir)
        # Every request commits one token more than its drafts accepted: 1.5 drafts a step.
        result = [1, 2] * (bs // 2) + [1] * (bs % 2)
        launched = 0

        def step(first: bool) -> None:
            nonlocal launched
            launched += 1
            # Replies of 1000 tokens in turn: each request's context grows 2.5 tokens a step
            # from 60, as the worker reports it (seq_lens_sum), then starts over.
            context = 60 + 2.5 * (launched % 400)
            shape = controller.before_decode(bs, seq_lens_sum=int(bs * context))
            clock.now += STEP_SECONDS[shape.label]
            controller.after_decode()
            if not first:  # the step before's result, read while this one runs
                controller.on_verify_complete(result)

        for i in range(warm_up):
            step(first=i == 0)
        calls = 0

        def count(frame, event, arg) -> None:
            nonlocal calls
            if event in ("call", "c_call"):
                calls += 1

        sys.setprofile(count)
        try:
            for _ in range(steps):
                step(first=False)
        finally:
            sys.setprofile(None)
        start = time.perf_counter()
        for _ in range(steps):
            step(first=False)
        seconds = time.perf_counter() - start
        return Cost(
            calls_per_step=calls / steps,
            us_per_step=seconds / steps * 1e6,
            steps_by_shape=dict(controller.policy.counters.steps),
        )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bs", type=int, default=48)
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args(argv)
    print(f"bs {args.bs}, {args.steps} steps after 1000 to settle, shapes {SHAPES}")
    for trace in (False, True):
        cost = measure(args.bs, args.steps, trace)
        print(
            f"trace {'on ' if trace else 'off'}: {cost.calls_per_step:6.1f} calls/step "
            f"(Python and C), {cost.us_per_step:6.1f} us/step; "
            f"steps by shape {cost.steps_by_shape}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
