"""Which Python frames one engine's scheduler spends more samples in than another's.

Input: py-spy's collapsed stacks ("frame;frame;...;frame COUNT" per line), e.g. the
stacks-CONFIG-PID.txt files of `bench_e2e --side-by-side --py-spy DIR`. Engines side by side
ran the same runs at the same sampling rate, so a frame's sample count is its host time for
the same work: samples of B minus samples of A, over the rate, are the seconds B spent there
beyond A. Prints each file's busiest frames (self, i.e. on top of the stack) and, for each
file after the first, the frames (inclusive) whose count differs most from the first's.

    python benchmark/spec/stack_diff.py DIR/stacks-chain-*.txt DIR/stacks-policy-*.txt

The samples cover every measured run, the first included: a kernel one engine runs and the
carried Triton cache lacks is compiled there, once per specialisation, and counts as that
engine's host time (session 61: a new kernel's launch frame took 4.8 % of one engine's
samples, where warm it costs 27 us a step). Compare engines whose kernels are all in the
cache (a call after one that collected it), or time the frames in question warm
(benchmark/spec/host_op_costs.py).
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass
from pathlib import Path


@dataclass
class StackProfile:
    """One process's samples: in all, per frame anywhere on the stack (inclusive; a
    recursive frame counts once per sample) and per frame on top of it (self)."""

    total: int
    inclusive: collections.Counter
    self_samples: collections.Counter


def parse_collapsed(text: str) -> StackProfile:
    inclusive, self_samples, total = collections.Counter(), collections.Counter(), 0
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        for frame in set(frames):
            inclusive[frame] += n
        self_samples[frames[-1]] += n
    return StackProfile(total, inclusive, self_samples)


def frame_differences(
    base: StackProfile, other: StackProfile
) -> list[tuple[str, int, int]]:
    """(frame, base's inclusive samples, other's), the largest difference either way first;
    ties by frame name."""
    frames = set(base.inclusive) | set(other.inclusive)
    rows = [(f, base.inclusive[f], other.inclusive[f]) for f in frames]
    return sorted(rows, key=lambda r: (-abs(r[2] - r[1]), r[0]))


def report(paths: list[Path], top: int) -> str:
    profiles = {p: parse_collapsed(p.read_text()) for p in paths}
    lines = []
    for path, prof in profiles.items():
        lines.append(
            f"== {path}: {prof.total} samples; busiest frames (self, inclusive)"
        )
        for frame, n in prof.self_samples.most_common(top):
            lines.append(
                f"  {n:7d} {n / prof.total:6.1%}  {prof.inclusive[frame]:7d}  {frame}"
            )
    base_path = paths[0]
    base = profiles[base_path]
    for path in paths[1:]:
        other = profiles[path]
        lines.append(
            f"== {path} against {base_path}: {other.total - base.total:+d} samples in all; "
            "frames by inclusive samples, most different first"
        )
        for frame, a, b in frame_differences(base, other)[:top]:
            lines.append(f"  {b - a:+7d}  ({a} -> {b})  {frame}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="the first is the base")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    print(report(args.files, args.top))


if __name__ == "__main__":
    main()
