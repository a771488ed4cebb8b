"""Summarise a shape policy trace (the "trace" file of --speculative-adaptive-config, as
bench_e2e.py --policy-trace writes it): what the policy ran at each batch size, how long its
steps took, where it switched, and its slow steps with the Triton compiles logged beside them.
A step's time is its device span (first launch to last), of the steps the policy timed (all of
them until a shape's price at a batch size is confirmed, then one in "time_every"); where the
trace has the host's clock per result ("t"), each cell also gets its period: the median
interval between results of consecutive steps of one shape at one batch size, host work
included.

    python benchmark/spec/policy_trace.py trace.jsonl [--slow-ms 30]

With --prices-at STEP ..., the step cost table the policy had before each of those steps'
results: the trace's measured step times (result lines with "seconds", less the first step
after each switch, which the controller does not price) replayed in order into sglang's
StepCostTable, each shape's seconds at --prices-bs, a first step's provisional price marked
"*": why a shape was passed over. A step whose batch size differs from the step before is
left out as the controller leaves it out (--resize-rule confirmed: where the shape has a
confirmed price within a factor 2; main since b40df68), or where it has any price there
(any: session 62's reverted rule), or never (none: before either).

With --runs, one line per run of the benchmark's batches (a batch that jumped to a size and
drained from it): its steps, tokens per second from the host's clock, the shapes it ran at
its full size, and the device spans of its main shape by quarter of the run. A step's span
grows with the context through a run; a first quarter dearer than other runs' says the host
was slow then (a host-bound step's span waits for its launches).

With --loads, one block per run of a mixed load (bench_e2e --mixed-load), which
--runs cannot cut (its batch grows step by step): runs are cut where the host's clock
shows the engine idle for more than --load-gap seconds. Each says its size at most, its
seconds and tokens per second by the host's clock, its switches, its steps by shape, and
the stretches of one shape with the sizes each began and ended at: a run of a mixed load
is a few seconds, and which shapes the policy ran through its long tail is most of it.

CPU only; reads plain or gzipped JSON lines (docs/benchmarks/*.jsonl.gz).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TraceSummary:
    # (bs, shape label) -> decode steps with a result, timed or not
    steps: collections.Counter = field(default_factory=collections.Counter)
    # (bs, shape label) -> device seconds of each measured step
    step_seconds: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    # (bs, shape label) -> host seconds from the result of the step before (same shape and
    # batch size, the step numbered one less, no switch between) to this step's result
    periods: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    switches: list[tuple[int, str, str, int]] = field(default_factory=list)
    # (step, bs, shape, milliseconds, compiles logged on that line and the one before)
    slow_steps: list[tuple[int, int, str, float, list]] = field(default_factory=list)
    compiles: list[tuple[int, str, float]] = field(default_factory=list)


def read_lines(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(lines: list[dict], slow_ms: float = 30.0) -> TraceSummary:
    """Under the overlap scheduler a step's result line is written after the next step has
    launched, and a line lists the compiles finished since the line before it: those made
    while a step launched are on the line written before that step's own line. A slow step
    is shown with the compiles of both lines."""
    summary = TraceSummary()
    previous_compiles: list = []
    previous_result = None
    for line in lines:
        compiles = line.get("compiles", [])
        for kernel, ms in compiles:
            summary.compiles.append((line["step"], kernel, ms))
        nearby, previous_compiles = previous_compiles + compiles, compiles
        if "switch" in line:
            old, new = line["switch"]
            summary.switches.append((line["step"], old, new, line["bs"]))
            previous_result = None
            continue
        period = step_period(previous_result, line)
        if period is not None:
            summary.periods.setdefault((line["bs"], line["shape"]), []).append(period)
        previous_result = line
        key = (line["bs"], line["shape"])
        summary.steps[key] += 1
        seconds = line.get("seconds")
        if seconds is None:
            continue
        summary.step_seconds.setdefault(key, []).append(seconds)
        if seconds * 1000 > slow_ms:
            summary.slow_steps.append(
                (
                    line["step"],
                    line["bs"],
                    line["shape"],
                    seconds * 1000,
                    nearby,
                )
            )
    return summary


def step_period(previous: dict | None, line: dict) -> float | None:
    """Host seconds between two result lines of consecutive steps of one shape at one batch
    size (None otherwise, or without the host's clock)."""
    if previous is None or "t" not in line or "t" not in previous:
        return None
    if (previous["shape"], previous["bs"]) != (line["shape"], line["bs"]):
        return None
    if line["step"] != previous["step"] + 1:
        return None
    return line["t"] - previous["t"]


def print_summary(summary: TraceSummary, min_steps: int = 5) -> None:
    print(
        "steps by batch size and shape (count, how many timed, their device span median "
        "and max ms, period median ms where the trace has the host's clock):"
    )
    for (bs, shape), count in sorted(summary.steps.items()):
        if count < min_steps:
            continue
        seconds = summary.step_seconds.get((bs, shape), [])
        periods = summary.periods.get((bs, shape), [])
        row = f"  bs {bs:>3} {shape:>8}: {count:>4} steps, {len(seconds):>4} timed"
        if seconds:
            row += (
                f", median {statistics.median(seconds) * 1000:7.2f}, "
                f"max {max(seconds) * 1000:8.1f}"
            )
        if periods:
            row += f", period {statistics.median(periods) * 1000:7.2f}"
        print(row)
    shapes = collections.Counter()
    for (_, shape), count in summary.steps.items():
        shapes[shape] += count
    print("steps by shape: " + ", ".join(f"{s} {n}" for s, n in shapes.most_common()))
    print(f"switches ({len(summary.switches)}):")
    for step, old, new, bs in summary.switches:
        print(f"  step {step}: {old} -> {new} at bs {bs}")
    print(f"slow steps ({len(summary.slow_steps)}):")
    for step, bs, shape, ms, compiles in summary.slow_steps:
        names = ", ".join(f"{kernel} {c_ms:.0f} ms" for kernel, c_ms in compiles)
        print(
            f"  step {step}: bs {bs} {shape} {ms:.1f} ms"
            + (f" | compiled: {names}" if names else "")
        )
    total = sum(ms for _, _, ms in summary.compiles)
    print(f"Triton compiles logged: {len(summary.compiles)}, {total:.0f} ms in all")


# Which steps after a resize replay_prices leaves out (the module's docstring).
RESIZE_RULES = ("confirmed", "any", "none")


def replay_prices(
    lines: list[dict],
    steps: list[int],
    batch_sizes: list[int],
    ema_alpha: float = 0.2,
    resize_rule: str = "confirmed",
) -> dict[int, dict[str, dict[int, tuple[float, bool]]]]:
    """{step: {shape label: {bs: (seconds, provisional)}}}: the cost table as it was when the
    result line of each given step came, before that line's own price."""
    from sglang.srt.speculative.shape_policy import Shape, StepCostTable

    if resize_rule not in RESIZE_RULES:
        raise ValueError(f"resize_rule must be one of {RESIZE_RULES}: {resize_rule!r}")
    table = StepCostTable({}, ema_alpha)
    priced_near = {
        "confirmed": table.confirmed_near,
        "any": table.measured_near,
        "none": lambda shape, bs: False,
    }[resize_rule]
    shapes = sorted({line["shape"] for line in lines if "shape" in line})
    wanted, prices, last_bs = set(steps), {}, 0

    def snapshot() -> dict[str, dict[int, tuple[float, bool]]]:
        return {
            label: {
                bs: (
                    table.seconds(Shape.parse(label), bs),
                    table.provisional(Shape.parse(label), bs),
                )
                for bs in batch_sizes
            }
            for label in shapes
        }

    for line in lines:
        if "shape" not in line:
            continue
        if line["step"] in wanted and line["step"] not in prices:
            prices[line["step"]] = snapshot()
        shape, bs, seconds = Shape.parse(line["shape"]), line["bs"], line.get("seconds")
        resized = last_bs not in (0, bs)
        last_bs = bs
        if seconds is None or line.get("after_switch"):
            continue
        if resized and priced_near(shape, bs):
            continue
        table.observe(shape, bs, seconds)
    return prices


def print_prices(prices: dict[int, dict[str, dict[int, tuple[float, bool]]]]) -> None:
    for step, by_shape in sorted(prices.items()):
        print(f"prices (ms) before step {step}'s result:")
        for label, by_bs in by_shape.items():
            cells = ", ".join(
                f"bs {bs} {seconds * 1000:.2f}{'*' if provisional else ''}"
                for bs, (seconds, provisional) in by_bs.items()
            )
            print(f"  {label:>8}: {cells}")


# A batch size this much above the step before's starts a run: requests arrived together.
RUN_JUMP = 2


@dataclass
class Run:
    """A run of result lines: from a batch that jumped up to `bs` until it next grew."""

    first_step: int
    bs: int  # the size it jumped to
    lines: list[dict]

    @property
    def full(self) -> list[dict]:
        """Its steps at the size it jumped to (before requests left)."""
        return [line for line in self.lines if line["bs"] == self.bs]

    @property
    def main_shape(self) -> str:
        return collections.Counter(line["shape"] for line in self.full).most_common(1)[
            0
        ][0]

    def tokens_per_second(self) -> float | None:
        """Tokens committed from the first result to the last over the host's time between
        them (None without the host's clock)."""
        if len(self.lines) < 2 or any("t" not in line for line in self.lines):
            return None
        seconds = self.lines[-1]["t"] - self.lines[0]["t"]
        tokens = sum(line["bs"] * line["accept"] for line in self.lines[1:])
        return tokens / seconds if seconds > 0 else None

    def span_quarters(self) -> list[float]:
        """Median device span (seconds) of the main shape's timed steps at full size, by
        quarter of them; empty with fewer than 8."""
        spans = [
            line["seconds"]
            for line in self.full
            if line["shape"] == self.main_shape and line.get("seconds") is not None
        ]
        if len(spans) < 8:
            return []
        q = len(spans) // 4
        return [statistics.median(spans[i * q : (i + 1) * q]) for i in range(4)]


def split_runs(lines: list[dict]) -> list[Run]:
    """The result lines (switch lines left out) cut where the batch size jumps up by more
    than RUN_JUMP; a trace's first result starts the first run."""
    runs: list[Run] = []
    for line in lines:
        if "shape" not in line:
            continue
        if not runs or line["bs"] > runs[-1].lines[-1]["bs"] + RUN_JUMP:
            runs.append(Run(line["step"], line["bs"], []))
        runs[-1].lines.append(line)
    return runs


def print_runs(runs: list[Run], min_steps: int = 8) -> None:
    print(
        "runs (first step, size, steps at that size and in all, tok/s by the host's clock, "
        "shapes at full size, main shape's span medians ms by quarter):"
    )
    for run in runs:
        full = run.full
        if len(full) < min_steps:
            continue
        shapes = collections.Counter(line["shape"] for line in full)
        rate = run.tokens_per_second()
        quarters = " / ".join(f"{s * 1000:.2f}" for s in run.span_quarters())
        print(
            f"  step {run.first_step:>6}: bs {run.bs:>3}, {len(full):>4} of "
            f"{len(run.lines):>4} steps, "
            + (f"{rate:8.0f} tok/s, " if rate is not None else "")
            + ", ".join(f"{s} {n}" for s, n in shapes.most_common())
            + (f" | {run.main_shape} {quarters}" if quarters else "")
        )


# Between two runs of a mixed load an engine side by side waits while the others run
# theirs (seconds); inside a run the longest pause is a compile or a first replay (well
# under a second).
LOAD_GAP_S = 2.0


@dataclass
class Stretch:
    """Consecutive result lines of one shape."""

    shape: str
    steps: int
    first_bs: int
    last_bs: int
    end_s: float  # host seconds from the load's first result to this stretch's last


@dataclass
class Load:
    """The result and switch lines of one run of a mixed load, in order."""

    lines: list[dict]

    @property
    def results(self) -> list[dict]:
        return [line for line in self.lines if "shape" in line]

    @property
    def switches(self) -> int:
        return sum("switch" in line for line in self.lines)

    @property
    def max_bs(self) -> int:
        return max(line["bs"] for line in self.results)

    @property
    def seconds(self) -> float:
        results = self.results
        return results[-1]["t"] - results[0]["t"]

    def tokens_per_second(self) -> float | None:
        """Tokens committed after the first result over the host's time from it to the
        last (as Run.tokens_per_second); None for a run of one result."""
        results = self.results
        tokens = sum(line["bs"] * line["accept"] for line in results[1:])
        return tokens / self.seconds if self.seconds > 0 else None

    def stretches(self) -> list[Stretch]:
        start = self.results[0]["t"]
        out: list[Stretch] = []
        for line in self.results:
            if out and out[-1].shape == line["shape"]:
                last = out[-1]
                last.steps += 1
                last.last_bs = line["bs"]
                last.end_s = line["t"] - start
            else:
                out.append(
                    Stretch(line["shape"], 1, line["bs"], line["bs"], line["t"] - start)
                )
        return out


def split_loads(lines: list[dict], gap_s: float = LOAD_GAP_S) -> list[Load]:
    """The trace cut into runs where consecutive results are more than `gap_s` apart on
    the host's clock (a switch line goes with the result after it). Needs "t" on every
    result line: ValueError naming the step otherwise."""
    loads: list[Load] = []
    pending: list[dict] = []
    previous_t = None
    for line in lines:
        if "shape" not in line:
            pending.append(line)
            continue
        if "t" not in line:
            raise ValueError(
                f"--loads: step {line['step']}'s result has no host clock (\"t\"); "
                "the trace predates it"
            )
        if previous_t is None or line["t"] - previous_t > gap_s:
            loads.append(Load([]))
        loads[-1].lines.extend(pending + [line])
        pending = []
        previous_t = line["t"]
    return loads


def print_loads(loads: list[Load], min_steps: int = 3) -> None:
    """A block per load; stretches shorter than `min_steps` are folded into one count."""
    print(
        "loads (size at most, host seconds, tok/s by the host's clock, switches, steps by "
        "shape; then each stretch of one shape: steps, sizes, seconds at its end):"
    )
    for i, load in enumerate(loads):
        rate = load.tokens_per_second()
        shapes = collections.Counter(line["shape"] for line in load.results)
        print(
            f"  load {i}: bs <= {load.max_bs}, {load.seconds:.2f} s, "
            + (f"{rate:.0f} tok/s, " if rate is not None else "")
            + f"{load.switches} switches, "
            + ", ".join(f"{s} {n}" for s, n in shapes.most_common())
        )
        short = 0
        for stretch in load.stretches():
            if stretch.steps < min_steps:
                short += stretch.steps
                continue
            print(
                f"    {stretch.shape:>8} x{stretch.steps:<4} bs {stretch.first_bs:>3} -> "
                f"{stretch.last_bs:<3} to {stretch.end_s:.2f} s"
            )
        if short:
            print(f"    (and {short} steps in stretches under {min_steps})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--slow-ms", type=float, default=30.0)
    p.add_argument(
        "--min-steps", type=int, default=5, help="list (bs, shape) cells this full"
    )
    p.add_argument("--prices-at", type=int, nargs="+", default=[], metavar="STEP")
    p.add_argument("--prices-bs", default="1,4,16,48,64")
    p.add_argument("--resize-rule", choices=RESIZE_RULES, default="confirmed")
    p.add_argument("--runs", action="store_true")
    p.add_argument("--loads", action="store_true")
    p.add_argument("--load-gap", type=float, default=LOAD_GAP_S, metavar="SECONDS")
    args = p.parse_args()
    lines = read_lines(args.trace)
    if args.prices_at:
        batch_sizes = [int(bs) for bs in args.prices_bs.split(",")]
        prices = replay_prices(
            lines, args.prices_at, batch_sizes, resize_rule=args.resize_rule
        )
        print_prices(prices)
        return
    if args.runs:
        print_runs(split_runs(lines))
        return
    if args.loads:
        try:
            print_loads(split_loads(lines, args.load_gap))
        except ValueError as e:
            raise SystemExit(str(e))
        return
    print_summary(summarise(lines, args.slow_ms), args.min_steps)


if __name__ == "__main__":
    main()
