"""What the shape policy could gain on a load, replayed from a benchmark's measured costs.

bench_e2e measures each fixed shape at a few batch sizes. From its rows this script prices a
decode step of each shape at any batch size (seconds per step = bs x accept length / tok/s,
linear between the measured sizes) and replays a load (requests arriving over time, each
decoding its own number of tokens) three ways: every fixed shape, and sglang's ShapePolicy
choosing before each step and learning costs and accept lengths as it goes, as it does in a
server. The result is the policy's margin over the best fixed shape with no engine spread,
no switch cost and no timing noise: what a GPU run of the same load can hope to show.

    python benchmark/spec/policy_sim.py --rows results.json --mixed-load 64:1.5:4x1024

Loads are bench_e2e's --mixed-load (REQUESTS:RAMP_SECONDS[:LONGxTOKENS]).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e  # noqa: E402

from sglang.srt.speculative.shape_policy import (  # noqa: E402
    NONE,
    PolicyConfig,
    Shape,
    ShapePolicy,
    StepCostTable,
)


@dataclass(frozen=True)
class MeasuredCosts:
    # seconds per decode step, by shape and measured batch size
    step_seconds: dict[Shape, dict[int, float]]
    # mean accept length over the measured batch sizes (1.0 for no speculation)
    accept_length: dict[Shape, float]

    def seconds(self, shape: Shape, bs: int) -> float:
        """Linear between measured sizes; past the ends, in proportion to bs."""
        points = sorted(self.step_seconds[shape].items())
        for (b0, s0), (b1, s1) in zip(points, points[1:]):
            if b0 <= bs <= b1:
                return s0 + (s1 - s0) * (bs - b0) / (b1 - b0)
        edge_bs, edge_s = points[0] if bs < points[0][0] else points[-1]
        return edge_s * bs / edge_bs if bs > edge_bs else edge_s


def measured_costs(rows: list[dict], backend: str = "triton") -> MeasuredCosts:
    """From bench_e2e rows at fixed batch sizes: its fixed spec v2 shapes on `backend`
    (bench_e2e.fixed_shape_rows, "tree" as bench_e2e's --tree set it) and "none"."""
    step_seconds: dict[Shape, dict[int, float]] = {}
    accepts: dict[Shape, list[float]] = {}
    plain = [
        (NONE.label, r)
        for r in rows
        if r["config"] == "none" and isinstance(r["bs"], int)
    ]
    for label, row in [*bench_e2e.fixed_shape_rows(rows, backend), *plain]:
        shape = Shape.parse(label)
        accept = row["accept_length"] if shape.speculates else 1.0
        step_seconds.setdefault(shape, {})[row["bs"]] = (
            row["bs"] * accept / row["tok_per_s"]
        )
        accepts.setdefault(shape, []).append(accept)
    return MeasuredCosts(step_seconds, {s: sum(a) / len(a) for s, a in accepts.items()})


@dataclass
class Replay:
    tok_per_s: float
    steps_by_shape: dict[str, int]


def replay(
    costs: MeasuredCosts,
    delays: list[float],
    tokens: list[int],
    choose: Callable[[int], Shape],
    observe: Optional[Callable[[Shape, int, float], None]] = None,
) -> Replay:
    """Decode the load step by step: each step runs choose(bs) on every request present, costs
    what the table says, and commits the shape's accept length to each request."""
    arrivals = sorted(zip(delays, tokens))
    left: dict[int, float] = {}
    now, arrived, finished, steps = 0.0, 0, 0, {}
    while finished < len(arrivals):
        while arrived < len(arrivals) and arrivals[arrived][0] <= now:
            left[arrived] = arrivals[arrived][1]
            arrived += 1
        if not left:
            now = arrivals[arrived][0]
            continue
        bs = len(left)
        shape = choose(bs)
        seconds = costs.seconds(shape, bs)
        if observe is not None:
            observe(shape, bs, seconds)
        now += seconds
        steps[shape.label] = steps.get(shape.label, 0) + 1
        for request in list(left):
            left[request] -= costs.accept_length[shape]
            if left[request] <= 0:
                del left[request]
                finished += 1
    return Replay(sum(tokens) / now, steps)


def replay_policy(
    costs: MeasuredCosts, shapes: list[Shape], delays: list[float], tokens: list[int]
) -> Replay:
    """The policy as a server runs it: no step costs given, first shape first, learning the
    cost and accept length of each step it runs."""
    config = PolicyConfig(shapes=tuple(shapes))
    policy = ShapePolicy(config, StepCostTable({}, config.ema_alpha), shapes[0])

    def observe(shape: Shape, bs: int, seconds: float) -> None:
        policy.observe_step_time(shape, bs, seconds)
        # The mean is what the policy keeps; one value carries it exactly.
        policy.observe_accept(shape, [costs.accept_length[shape]])

    return replay(costs, delays, tokens, policy.choose, observe)


def compare(
    costs: MeasuredCosts, shapes: list[Shape], delays: list[float], tokens: list[int]
) -> dict[str, Replay]:
    """Each fixed shape of the set, then "policy"."""
    runs = {
        s.label: replay(costs, delays, tokens, lambda bs, s=s: s)
        for s in shapes
        if s in costs.step_seconds
    }
    runs["policy"] = replay_policy(costs, shapes, delays, tokens)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", required=True, help="bench_e2e's --out JSON")
    parser.add_argument("--mixed-load", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", default="16,3,32")
    parser.add_argument(
        "--policy-shapes", default=" ".join(["16,3,32", "4,3,8", "1,3,4", "none"])
    )
    args = parser.parse_args()
    bench_e2e.set_tree_shape(*(int(x) for x in args.tree.split(",")))
    costs = measured_costs(json.loads(Path(args.rows).read_text()))
    shapes = [Shape.parse(s) for s in args.policy_shapes.split()]
    missing = [s.label for s in shapes if s not in costs.step_seconds]
    if missing:
        parser.error(f"--rows has no fixed-batch rows of {missing}")
    load = bench_e2e.MixedLoad.parse(args.mixed_load)
    delays, tokens = load.arrivals(args.max_new_tokens)
    runs = compare(costs, shapes, delays, tokens)
    best_label, best = max(
        ((k, r) for k, r in runs.items() if k != "policy"),
        key=lambda kv: kv[1].tok_per_s,
    )
    for label, run in runs.items():
        print(f"{label:>10} {run.tok_per_s:9.1f} tok/s  steps {run.steps_by_shape}")
    ratio = runs["policy"].tok_per_s / best.tok_per_s
    print(f"policy / best fixed ({best_label}): {ratio:.3f}")


if __name__ == "__main__":
    main()
