"""Host microseconds per call of the small device ops a decode step launches, on one CPU.

On a host-bound target a decode step's time is the host's, launch by launch, so whether a
triton kernel pays for itself against the torch ops it replaces, or what timing a step with
CUDA events costs, is a question of host microseconds on the GPU host's CPU. Each op runs
--calls times after a warm-up (so no first-use compile is counted), the device never waited
for; the table and --out JSON give host microseconds per call.

    taskset -c 3 python3 benchmark/spec/host_op_costs.py --out host_op_costs.json

Needs torch and triton only (not sglang): plain_decode_kernels is loaded from its file, and
each of its kernels is timed against its torch reference.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Callable

import torch

KERNELS = (
    Path(__file__).resolve().parents[2]
    / "python/sglang/srt/speculative/plain_decode_kernels.py"
)


def host_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / calls * 1e6


def load_kernels():
    spec = importlib.util.spec_from_file_location("plain_decode_kernels", KERNELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(calls: int, hidden: int, width: int, slots: int) -> dict[str, float]:
    dev = "cuda"
    kernels = load_kernels()
    req_to_token = torch.randint(
        0, 1 << 20, (slots, 4096), dtype=torch.int32, device=dev
    )
    ring_hidden = torch.zeros(slots, width, hidden, dtype=torch.bfloat16, device=dev)
    ring_tokens = torch.zeros(slots, width, dtype=torch.int64, device=dev)
    lag = torch.zeros(slots, dtype=torch.int64, device=dev)
    timed = torch.cuda.Event(enable_timing=True)
    first, last = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    first.record()
    last.record()

    def push_torch(rows, hidden_rows, tokens):
        # push_rows_reference's four indexed ops, the fill not advanced, so that every call
        # writes inside the rings.
        column = lag[rows]
        ring_hidden[rows, column] = hidden_rows
        ring_tokens[rows, column] = tokens
        lag[rows] = column

    results = {
        "event created and recorded": host_us(
            lambda: torch.cuda.Event(enable_timing=True).record(), calls
        ),
        "event recorded again": host_us(timed.record, calls),
        "event query": host_us(last.query, calls),
        "event elapsed_time": host_us(lambda: first.elapsed_time(last), calls),
        "lag.zero_()": host_us(lag.zero_, calls),
    }
    for bs in (1, 16, 64):
        rows = torch.randperm(slots - 1, device=dev)[:bs] + 1
        seq_lens = torch.randint(0, 4000, (bs,), device=dev)
        bonus = torch.randint(0, 32000, (bs,), dtype=torch.int32, device=dev)
        hidden_rows = torch.randn(bs, hidden, dtype=torch.bfloat16, device=dev)

        def push_triton():
            kernels.push_rows_triton(
                ring_hidden, ring_tokens, lag, rows, hidden_rows, seq_lens
            )
            lag.zero_()  # keeps every ring below its width; subtract "lag.zero_()"

        results |= {
            f"bs {bs}: x + 1": host_us(lambda: seq_lens + 1, calls),
            f"bs {bs}: decode inputs, torch": host_us(
                lambda: kernels.decode_inputs_reference(
                    req_to_token, rows, seq_lens, bonus
                ),
                calls,
            ),
            f"bs {bs}: decode inputs, triton": host_us(
                lambda: kernels.decode_inputs_triton(
                    req_to_token, rows, seq_lens, bonus
                ),
                calls,
            ),
            f"bs {bs}: ring push, torch": host_us(
                lambda: push_torch(rows, hidden_rows, seq_lens), calls
            ),
            f"bs {bs}: ring push, triton + lag.zero_()": host_us(push_triton, calls),
        }
    return {name: round(us, 2) for name, us in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--hidden", type=int, default=2048, help="the 1.21B target's")
    parser.add_argument("--width", type=int, default=32, help="ring rows per slot")
    parser.add_argument("--slots", type=int, default=65, help="request slots")
    parser.add_argument("--out")
    args = parser.parse_args()
    results = measure(args.calls, args.hidden, args.width, args.slots)
    for name, us in results.items():
        print(f"{name:45s} {us:8.2f} us")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
