"""Draft-phase time of EagleDraftWorker.draft_forward with topk=1: chain fast path vs general path.

Runs the real draft_forward (both paths) on a GPU with a dense fake draft model that reads the
weight bytes of one EAGLE layer plus the lm_head per step, eager and under a CUDA graph (as the
draft CUDA-graph runner does), and prints both paths side by side from one run.

    python benchmark/spec/bench_chain_draft.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from specpatch.testing.fake_draft import (  # noqa: E402
    DenseDraftRunner,
    make_draft_worker,
    make_forward_batch,
)


def time_ms(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True
    )
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()

    runner = DenseDraftRunner(args.hidden, args.intermediate, args.vocab)
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        row = {"bs": bs}
        outputs = {}
        for path in ("chain", "general"):
            worker = make_draft_worker(
                EagleDraftWorker,
                runner,
                num_steps=args.num_steps,
                max_bs=64,
                chain=path == "chain",
                device="cuda",
            )
            batch = make_forward_batch(
                bs,
                args.num_steps,
                vocab_size=args.vocab,
                hidden=args.hidden,
                device="cuda",
                dtype=torch.bfloat16,
            )
            positions, out_cache_loc, hidden = (
                batch.positions.clone(),
                batch.out_cache_loc,
                batch.spec_info.hidden_states,
            )

            def step():
                # draft_forward advances these in place, as in production (the graph runner restores them too)
                batch.positions.copy_(positions)
                batch.out_cache_loc, batch.spec_info.hidden_states = (
                    out_cache_loc,
                    hidden,
                )
                return worker.draft_forward(batch)

            outputs[path] = [t.clone() for t in step()]
            row[f"{path}_eager_ms"] = time_ms(step, args.iters)
            row[f"{path}_graph_ms"] = time_ms(graphed(step), args.iters)
        row["same_outputs"] = all(
            torch.equal(a.long(), b.long())
            for a, b in zip(outputs["chain"], outputs["general"])
        )
        row["eager_speedup"] = row["general_eager_ms"] / row["chain_eager_ms"]
        row["graph_speedup"] = row["general_graph_ms"] / row["chain_graph_ms"]
        rows.append(row)

    print(
        f"draft_forward, topk=1, num_steps={args.num_steps}, dense fake draft h={args.hidden} vocab={args.vocab}"
    )
    print(
        f"{'bs':>4} {'chain eager':>12} {'general eager':>14} {'speedup':>8} {'chain graph':>12} {'general graph':>14} {'speedup':>8} same"
    )
    for r in rows:
        print(
            f"{r['bs']:>4} {r['chain_eager_ms']:>10.3f}ms {r['general_eager_ms']:>12.3f}ms {r['eager_speedup']:>7.2f}x "
            f"{r['chain_graph_ms']:>10.3f}ms {r['general_graph_ms']:>12.3f}ms {r['graph_speedup']:>7.2f}x {r['same_outputs']}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
