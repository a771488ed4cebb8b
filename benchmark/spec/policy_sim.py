"""What the shape policy could gain on a load, replayed from a benchmark's measured costs.

bench_e2e measures each fixed shape at a few batch sizes. From its rows this script prices a
decode step of each shape at any batch size (seconds per step = bs x accept length / tok/s,
linear between the measured sizes) and replays a load (requests arriving over time, each
decoding its own number of tokens) three ways: every fixed shape, and sglang's ShapePolicy
choosing before each step and learning costs and accept lengths as it goes, as it does in a
server. The result is the policy's margin over the best fixed shape with no engine spread,
no switch cost and no timing noise: what a GPU run of the same load can hope to show.

    python benchmark/spec/policy_sim.py --rows results.json --mixed-load 64:1.5:4x1024
    python benchmark/spec/policy_sim.py --rows results.json --batch-sizes 1,4,16,48,64 --seeds 20

Loads are bench_e2e's --mixed-load (REQUESTS:RAMP_SECONDS[:LONGxTOKENS], or the closed loop
LEVELxREQUESTS,...), or its fixed batch
sizes as bench_e2e runs them (--repeats batches of each size in turn, one policy throughout).
With --seeds, each request's accepted tokens in a step are a random draw around the shape's
measured mean, as on a GPU, where they are what the policy learns accept lengths from; the
table then gives the policy's worst and mean ratio over the seeds. With --step-noise SIGMA each
step also takes 1 + SIGMA x |N(0, 1)| times its measured cost (a step waits on the host or a
compile at times, and never does less than its work), for every config, and the policy learns
from those times; --confirm-replace prices a shape's provisional point by its second step
alone, as StepCostTable did before it kept the cheaper of the two.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
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
    seconds: float = 0.0


# One request's accepted tokens in a step of a speculating shape.
AcceptDraw = Callable[[Shape], float]


def binomial_draws(costs: MeasuredCosts, rng: random.Random) -> AcceptDraw:
    """1 + Binomial(num_steps, q) tokens, q making the mean the shape's measured accept
    length: a request accepts 0 .. num_steps drafts and the bonus token."""

    def draw(shape: Shape) -> float:
        q = (costs.accept_length[shape] - 1) / shape.num_steps
        return 1 + sum(rng.random() < q for _ in range(shape.num_steps))

    return draw


# What a step takes, given what it costs: the measured seconds, or those with noise.
StepNoise = Callable[[float], float]


def one_sided_noise(sigma: float, rng: random.Random) -> StepNoise:
    """A step takes 1 + sigma x |N(0, 1)| times its cost."""
    return lambda seconds: seconds * (1 + sigma * abs(rng.gauss(0.0, 1.0)))


def replay(
    costs: MeasuredCosts,
    delays: list[float],
    tokens: list[int],
    choose: Callable[[int], Shape],
    observe: Optional[Callable[[Shape, int, float, list[float]], None]] = None,
    draw: Optional[AcceptDraw] = None,
    noise: Optional[StepNoise] = None,
    levels: Optional[list[int]] = None,
) -> Replay:
    """Decode the load step by step: each step runs choose(bs) on every request present, costs
    what the table says (with noise, what noise makes of it), and commits to each request the
    shape's accept length (or, with draw, a draw of it per request). Requests arrive at their
    delays or, with levels (a closed loop, bench_e2e.StairLoad), in order, request i once
    fewer than levels[i] are present."""
    if levels is None:
        arrivals = sorted(zip(delays, tokens))
    else:
        arrivals = list(zip(delays, tokens))

    def admits(i: int, present: int, now: float) -> bool:
        if levels is None:
            return arrivals[i][0] <= now
        return present < levels[i]

    left: dict[int, float] = {}
    now, arrived, finished, steps = 0.0, 0, 0, {}
    while finished < len(arrivals):
        while arrived < len(arrivals) and admits(arrived, len(left), now):
            left[arrived] = arrivals[arrived][1]
            arrived += 1
        if not left:
            now = arrivals[arrived][0]
            continue
        bs = len(left)
        shape = choose(bs)
        seconds = costs.seconds(shape, bs)
        if noise is not None:
            seconds = noise(seconds)
        now += seconds
        steps[shape.label] = steps.get(shape.label, 0) + 1
        accepted = [
            draw(shape) if draw and shape.speculates else costs.accept_length[shape]
            for _ in left
        ]
        if observe is not None:
            observe(shape, bs, seconds, accepted)
        for request, n in zip(list(left), accepted):
            left[request] -= n
            if left[request] <= 0:
                del left[request]
                finished += 1
    return Replay(sum(tokens) / now, steps, now)


def server_policy(shapes: list[Shape], confirm_cheaper: bool = True) -> ShapePolicy:
    """The policy as a server starts it: no step costs given, first shape first."""
    config = PolicyConfig(shapes=tuple(shapes))
    table = StepCostTable({}, config.ema_alpha, confirm_cheaper=confirm_cheaper)
    return ShapePolicy(config, table, shapes[0])


def policy_observer(policy: ShapePolicy):
    def observe(shape: Shape, bs: int, seconds: float, accepted: list[float]) -> None:
        policy.observe_step_time(shape, bs, seconds)
        policy.observe_accept(shape, accepted)

    return observe


def replay_policy(
    costs: MeasuredCosts,
    shapes: list[Shape],
    delays: list[float],
    tokens: list[int],
    draw: Optional[AcceptDraw] = None,
    noise: Optional[StepNoise] = None,
    confirm_cheaper: bool = True,
    levels: Optional[list[int]] = None,
) -> Replay:
    """The policy as a server runs it, learning the cost and accept length of each step it
    runs."""
    policy = server_policy(shapes, confirm_cheaper)
    observe = policy_observer(policy)
    return replay(costs, delays, tokens, policy.choose, observe, draw, noise, levels)


def compare(
    costs: MeasuredCosts,
    shapes: list[Shape],
    delays: list[float],
    tokens: list[int],
    draw: Optional[AcceptDraw] = None,
    noise: Optional[StepNoise] = None,
    confirm_cheaper: bool = True,
    levels: Optional[list[int]] = None,
) -> dict[str, Replay]:
    """Each fixed shape of the set, then "policy"."""
    runs = {
        s.label: replay(
            costs,
            delays,
            tokens,
            lambda bs, s=s: s,
            draw=draw,
            noise=noise,
            levels=levels,
        )
        for s in shapes
        if s in costs.step_seconds
    }
    runs["policy"] = replay_policy(
        costs, shapes, delays, tokens, draw, noise, confirm_cheaper, levels
    )
    return runs


def best_at_each_size(costs: MeasuredCosts, shapes: list[Shape]):
    """choose(bs) of an oracle: the shape of `shapes` with the most tokens a second at bs by
    the measured table (mean accept length over the step's price), which no policy that has
    to learn prices can beat on the same table."""

    def choose(bs: int) -> Shape:
        priced = [s for s in shapes if s in costs.step_seconds]
        return max(priced, key=lambda s: costs.accept_length[s] / costs.seconds(s, bs))

    return choose


def compare_batch_sizes(
    costs: MeasuredCosts,
    shapes: list[Shape],
    batch_sizes: list[int],
    repeats: int,
    max_new_tokens: int,
    draw: Optional[AcceptDraw] = None,
    noise: Optional[StepNoise] = None,
    confirm_cheaper: bool = True,
) -> dict[str, dict[int, float]]:
    """tok/s by config and batch size on bench_e2e's fixed-size load: at each size in turn,
    one untimed batch of bs requests of max_new_tokens each (bench_e2e's warm-up round; only
    the policy learns from it) and `repeats` timed ones. One policy runs them all, so what it
    learnt at one size is what it starts the next with, as in an engine."""
    fixed = [s for s in shapes if s in costs.step_seconds]
    policy = server_policy(shapes, confirm_cheaper)
    observe = policy_observer(policy)
    result: dict[str, dict[int, float]] = {s.label: {} for s in fixed}
    result["policy"] = {}
    for bs in batch_sizes:
        delays, tokens = [0.0] * bs, [max_new_tokens] * bs
        runs: dict[str, list[Replay]] = {label: [] for label in result}
        replay(costs, delays, tokens, policy.choose, observe, draw, noise)  # untimed
        for _ in range(repeats):
            for s in fixed:
                runs[s.label].append(
                    replay(
                        costs, delays, tokens, lambda b, s=s: s, draw=draw, noise=noise
                    )
                )
            runs["policy"].append(
                replay(costs, delays, tokens, policy.choose, observe, draw, noise)
            )
        for label, replays in runs.items():
            seconds = sum(r.seconds for r in replays)
            result[label][bs] = repeats * bs * max_new_tokens / seconds
    return result


def print_batch_sizes(tables: list[dict[str, dict[int, float]]]) -> None:
    """Mean tok/s per config and size over the seeds' tables, and the policy's ratio to the
    best fixed shape: worst seed and mean."""
    labels = list(tables[0])
    sizes = list(tables[0]["policy"])
    print(
        "  bs "
        + "".join(f"{label:>10}" for label in labels)
        + "   policy/best (worst, mean)"
    )
    for bs in sizes:
        means = {l: statistics.mean(t[l][bs] for t in tables) for l in labels}
        ratios = [
            t["policy"][bs] / max(t[l][bs] for l in labels if l != "policy")
            for t in tables
        ]
        cells = "".join(f"{means[l]:10.1f}" for l in labels)
        print(f"{bs:4d} {cells}   {min(ratios):.3f} {statistics.mean(ratios):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", required=True, help="bench_e2e's --out JSON")
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--mixed-load")
    load.add_argument(
        "--batch-sizes", help="bench_e2e's fixed sizes, e.g. 1,4,16,48,64"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--seeds",
        type=int,
        default=0,
        help="draw each request's accepted tokens, over this many seeds (0: the mean)",
    )
    parser.add_argument(
        "--step-noise",
        type=float,
        default=0.0,
        metavar="SIGMA",
        help="each step takes 1 + SIGMA x |N(0, 1)| times its cost (0: no noise)",
    )
    parser.add_argument(
        "--confirm-replace",
        action="store_true",
        help="a provisional price is replaced by its second step (the rule before)",
    )
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
    seeds = range(max(args.seeds, 1))
    draws = [
        binomial_draws(costs, random.Random(seed)) if args.seeds else None
        for seed in seeds
    ]
    noises = [
        (
            one_sided_noise(args.step_noise, random.Random(1000 + seed))
            if args.step_noise
            else None
        )
        for seed in seeds
    ]
    confirm_cheaper = not args.confirm_replace
    if args.batch_sizes:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        print_batch_sizes(
            [
                compare_batch_sizes(
                    costs,
                    shapes,
                    sizes,
                    args.repeats,
                    args.max_new_tokens,
                    draw,
                    noise,
                    confirm_cheaper,
                )
                for draw, noise in zip(draws, noises)
            ]
        )
        return
    load = bench_e2e.parse_load(args.mixed_load)
    if isinstance(load, bench_e2e.StairLoad):
        tokens, levels = load.tokens(args.max_new_tokens), load.levels()
        delays = [0.0] * len(tokens)
    else:
        (delays, tokens), levels = load.arrivals(args.max_new_tokens), None
    for draw, noise in zip(draws, noises):
        runs = compare(
            costs, shapes, delays, tokens, draw, noise, confirm_cheaper, levels
        )
        best_label, best = max(
            ((k, r) for k, r in runs.items() if k != "policy"),
            key=lambda kv: kv[1].tok_per_s,
        )
        runs["oracle"] = replay(
            costs,
            delays,
            tokens,
            best_at_each_size(costs, shapes),
            draw=draw,
            noise=noise,
            levels=levels,
        )
        for label, run in runs.items():
            print(f"{label:>10} {run.tok_per_s:9.1f} tok/s  steps {run.steps_by_shape}")
        ratio = runs["policy"].tok_per_s / best.tok_per_s
        print(f"policy / best fixed ({best_label}): {ratio:.3f}")
        # The oracle: the best shape at each step's size by the table, known from the start.
        print(
            f"policy / oracle: {runs['policy'].tok_per_s / runs['oracle'].tok_per_s:.3f}"
        )


if __name__ == "__main__":
    main()
