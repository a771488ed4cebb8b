"""Where a speculative decode iteration spends its time: one torch-profiler window per config,
summarised side by side (GPU busy fraction, kernel and graph launches per iteration, the
kernels and CPU ops that differ most between configs).

    python benchmark/spec/profile_decode.py --preset bench --configs chain,tree,tree-v1 \
        --bs 1 --steps 40 --out summary.json

With --with-stack it also prints where the first two configs' host time per step differs, by
Python function (e.g. --configs tree,tree-v1: what spec v2 does on the host that v1 does not).

Each config also gets its GPU idle time split by the host call whose launch ended each gap
(named by Python frames with --with-stack): the host work the GPU waited for.

Config names are bench_e2e's (tree@flashinfer: the tree on FlashInfer). The summary, not the trace, is the output: traces are tens of MB.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import gzip
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_e2e  # noqa: E402

from specpatch.testing import engine as eng  # noqa: E402
from specpatch.testing import synth  # noqa: E402

SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernelEx",
)
GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")
# Host calls into CUDA: the runtime API (torch) and the driver API (triton launches kernels
# with cuLaunchKernelEx).
HOST_CUDA_CALLS = ("cuda_runtime", "cuda_driver")


def summarise_trace(path: Path, num_steps: int, top: int = 25) -> dict:
    """Per-iteration counts and the busiest kernels / CPU ops of one chrome trace."""
    events = json.load(gzip.open(path))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    runtime = [e for e in events if e.get("cat") in HOST_CUDA_CALLS]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    # GPU busy time: the union of kernel intervals, so overlapping streams count once.
    busy, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = k["ts"], k["ts"] + k["dur"]
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)

    def per_step(counter: collections.Counter) -> list:
        return [(name, round(n / num_steps, 2)) for name, n in counter.most_common(top)]

    kernel_time = collections.Counter()
    for k in kernels:
        kernel_time[k["name"][:90]] += k["dur"]
    op_time = collections.Counter()
    for op in cpu_ops:
        op_time[op["name"]] += op["dur"]
    return {
        "gpu_span_us_per_step": span / num_steps,
        "gpu_busy_fraction": busy / span,
        "kernels_per_step": len(kernels) / num_steps,
        "kernel_launches_per_step": sum(e["name"] in LAUNCH_CALLS for e in runtime)
        / num_steps,
        "graph_launches_per_step": sum(e["name"] == "cudaGraphLaunch" for e in runtime)
        / num_steps,
        "syncs_per_step": sum("Synchronize" in e["name"] for e in runtime) / num_steps,
        "memcpy_per_step": sum("Memcpy" in e["name"] for e in runtime) / num_steps,
        "kernel_count_per_step": per_step(
            collections.Counter(k["name"][:90] for k in kernels)
        ),
        "kernel_us_per_step": per_step(kernel_time),
        "cpu_op_count_per_step": per_step(
            collections.Counter(op["name"] for op in cpu_ops)
        ),
        "cpu_op_us_per_step": per_step(op_time),
        "cpu_ops_per_step": len(cpu_ops) / num_steps,
        "sync_us_per_step": sum(e["dur"] for e in runtime if e["name"] in SYNC_CALLS)
        / num_steps,
        "sync_sites": collections.Counter(
            e["name"] for e in runtime if e["name"] in SYNC_CALLS
        ).most_common(),
        "sync_callers_us_per_step": sync_callers(events, runtime, num_steps),
        "gpu_idle_by_launch_site_us_per_step": gpu_idle_by_launch_site(
            events, num_steps
        ),
        "kernel_us_by_launch_site_per_step": kernel_time_by_launch_site(
            events, num_steps, top
        ),
        "kernel_us_by_site_per_step": kernel_time_by_site(events, num_steps),
        "python_us_per_step": python_frames(events, num_steps, 3 * top),
        "python_self_us_per_step": python_self_time(events, num_steps, 3 * top),
        # The scheduler thread alone (idle threads' waits would swamp a comparison), deeper
        # than the rest: host_time_differences compares two configs' lists.
        "scheduler_self_us_per_step": python_self_time(
            scheduler_thread_events(events), num_steps, 10 * top
        ),
        "kv_canary_us_per_step": outermost_time(events, "kv_canary/", num_steps),
    }


def python_frames(events: list, num_steps: int, top: int) -> list:
    """Inclusive host time per sglang Python function (with_stack traces only; a recursive
    function counts once per level)."""
    inclusive = collections.Counter()
    for e in events:
        if e.get("cat") == "python_function" and "sglang" in e["name"]:
            inclusive[e["name"].split("sglang/")[-1]] += e["dur"]
    return [(name, round(us / num_steps, 1)) for name, us in inclusive.most_common(top)]


def frame_name(event: dict) -> str:
    """A Python frame's name without the sglang/ prefix and without the object address that
    built-in methods carry ("<built-in method copy_ of Tensor object at 0x7f...>"), so the
    same function has the same name in two traces."""
    return re.sub(r" at 0x[0-9a-f]+", "", event["name"].split("sglang/")[-1])


def scheduler_thread_events(events: list) -> list:
    """The events of the thread(s) that run the scheduler's event loop."""
    tids = {
        e["tid"]
        for e in events
        if e.get("cat") == "python_function"
        and "scheduler.py" in e["name"]
        and "event_loop" in e["name"]
    }
    return [e for e in events if e.get("tid") in tids]


def python_self_time(events: list, num_steps: int, top: int) -> list:
    """Exclusive host time per Python function (its own lines and the torch ops it calls, not
    its Python callees), per step: where the host's time goes, summed to the whole loop.
    with_stack traces only."""
    frames_by_tid = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function":
            frames_by_tid[e["tid"]].append(e)
    exclusive = collections.Counter()
    for frames in frames_by_tid.values():
        # Frames nest per thread: sorted by start (outer first on ties), a stack of open
        # frames gives each frame's parent, whose exclusive time loses the child's duration.
        frames.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for f in frames:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= f["ts"]:
                stack.pop()
            exclusive[frame_name(f)] += f["dur"]
            if stack:
                exclusive[frame_name(stack[-1])] -= f["dur"]
            stack.append(f)
    return [(name, round(us / num_steps, 1)) for name, us in exclusive.most_common(top)]


def host_time_differences(a: list, b: list, top: int = 15) -> list:
    """Per Python frame, exclusive host us per step of config a, of config b, and a - b, the
    largest differences first: which functions make one config's step cost more host time.
    a and b are python_self_us_per_step lists; a frame missing from one (below its top) counts
    as 0 there."""
    us_a, us_b = dict(a), dict(b)
    rows = [
        (name, us_a.get(name, 0.0), us_b.get(name, 0.0))
        for name in dict.fromkeys([*us_a, *us_b])
    ]
    rows = [(name, x, y, round(x - y, 1)) for name, x, y in rows]
    return sorted(rows, key=lambda r: -abs(r[3]))[:top]


def host_op_slowdown(a: dict, b: dict) -> tuple[float, int]:
    """How much longer config a's host ops take than config b's, call for call: the median,
    over the ops in both summaries' top lists (by count and by time), of the ratio of their
    mean us per call, and how many ops that median is over (0: none in common, ratio 1.0).
    Two engines that run the same ops with a ratio far from 1 ran them on hosts of different
    speed (the CPU their scheduler ran on, or what their process holds), not different
    work."""
    per_call_a, per_call_b = _us_per_call(a), _us_per_call(b)
    ratios = [
        us / per_call_b[name] for name, us in per_call_a.items() if per_call_b.get(name)
    ]
    return (statistics.median(ratios) if ratios else 1.0), len(ratios)


def _us_per_call(summary: dict) -> dict[str, float]:
    counts = dict(summary["cpu_op_count_per_step"])
    us = dict(summary["cpu_op_us_per_step"])
    return {name: us[name] / n for name, n in counts.items() if name in us and n > 0}


def outermost_time(events: list, needle: str, num_steps: int) -> float:
    """Host time inside Python frames whose name contains `needle`, nested ones counted once."""
    frames = sorted(
        (
            e
            for e in events
            if e.get("cat") == "python_function" and needle in e["name"]
        ),
        key=lambda e: (e["tid"], e["ts"]),
    )
    total, tid, end = 0.0, None, float("-inf")
    for f in frames:
        if f["tid"] != tid:
            tid, end = f["tid"], float("-inf")
        stop = f["ts"] + f["dur"]
        if stop > end:
            total += stop - max(f["ts"], end)
            end = stop
    return round(total / num_steps, 1)


def events_by_thread(events: list, keep) -> tuple[dict, dict]:
    """The events `keep` accepts, per thread, sorted by start, and their start times (for
    bisect)."""
    by_tid = collections.defaultdict(list)
    for e in events:
        if keep(e):
            by_tid[e.get("tid")].append(e)
    for kept in by_tid.values():
        kept.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in kept] for tid, kept in by_tid.items()}
    return by_tid, starts


def sglang_frames_by_thread(events: list) -> tuple[dict, dict]:
    """sglang Python frames per thread, sorted by start, and their start times (for bisect)."""
    return events_by_thread(
        events, lambda e: e.get("cat") == "python_function" and "sglang" in e["name"]
    )


def enclosing(call: dict, by_tid: dict, starts: dict, depth: int) -> list:
    """The innermost `depth` events of the call's thread that enclose it, innermost first."""
    candidates = by_tid.get(call.get("tid"), [])
    found = []
    # Enclosing events start before the call and end after it; the innermost start last.
    for e in reversed(
        candidates[: bisect.bisect_right(starts.get(call.get("tid"), []), call["ts"])][
            -20000:
        ]
    ):
        if e["ts"] + e["dur"] >= call["ts"] + call["dur"]:
            found.append(e)
            if len(found) == depth:
                break
    return found


def call_site(call: dict, frames_by_tid: dict, starts: dict, depth: int) -> str:
    """The innermost `depth` sglang frames enclosing a runtime call, innermost first."""
    frames = enclosing(call, frames_by_tid, starts, depth)
    return " <- ".join(f["name"].split("sglang/")[-1] for f in frames)


def launches_by_correlation(events: list) -> dict:
    """Host CUDA calls (kernel and graph launches, copies) by the correlation id their GPU
    activity carries."""
    return {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in HOST_CUDA_CALLS and "correlation" in e.get("args", {})
    }


def sync_callers(events: list, runtime: list, num_steps: int, depth: int = 3) -> list:
    """Host waits (syncs and blocking copies, by duration) per innermost sglang Python frames.
    Needs a trace recorded with_stack; empty otherwise."""
    frames_by_tid, starts = sglang_frames_by_thread(events)
    waits = collections.Counter()
    for call in runtime:
        if call["name"] not in SYNC_CALLS and not (
            "Memcpy" in call["name"] and call["dur"] > 20
        ):
            continue
        waits[call_site(call, frames_by_tid, starts, depth) or "?"] += call["dur"]
    return [(site, round(us / num_steps, 1)) for site, us in waits.most_common(15)]


def gpu_idle_by_launch_site(
    events: list, num_steps: int, depth: int = 2, top: int = 15
) -> list:
    """GPU idle time per step, by what the GPU was waiting for.

    Each gap in GPU activity (kernels, copies and memsets on any stream) is charged to the host
    call that launched the activity ending it, named by its innermost sglang frames (with_stack
    traces; the runtime call's name otherwise). If that call had returned before the gap
    opened, the work was queued and the GPU waited on a dependency, not on the host: the site
    is prefixed "queued: ". In an overlap scheduler that keeps the GPU fed, the host-launch
    gaps are small; where they are not, the site names the host work on the critical path.
    """
    activity = sorted(
        (e for e in events if e.get("cat") in GPU_ACTIVITY), key=lambda e: e["ts"]
    )
    launches = launches_by_correlation(events)
    frames_by_tid, starts = sglang_frames_by_thread(events)
    idle = collections.Counter()
    end = None
    for a in activity:
        if end is not None and a["ts"] > end:
            call = launches.get(a.get("args", {}).get("correlation"))
            if call is None:
                site = "?"
            else:
                site = call_site(call, frames_by_tid, starts, depth) or call["name"]
                if call["ts"] + call["dur"] <= end:
                    site = "queued: " + site
            idle[site] += a["ts"] - end
        end = a["ts"] + a["dur"] if end is None else max(end, a["ts"] + a["dur"])
    return [(site, round(us / num_steps, 1)) for site, us in idle.most_common(top)]


def kernel_time_by_launch_site(events: list, num_steps: int, top: int = 25) -> list:
    """GPU time per step of each kernel, by who launched it: [kernel, torch op, site, us].

    A kernel's launch is its host CUDA call (same correlation id); the torch op is the
    innermost one enclosing that call (empty for triton kernels and graph replays), the
    site its innermost sglang frames (with_stack traces), prefixed "graph: " when the kernel
    ran inside a replayed CUDA graph. The kernel name is kept whole: the summary's other
    lists cut it to 90 characters, where templated torch kernels all look alike.
    """
    return [
        [name, op, site, round(us / num_steps, 1)]
        for (name, op, site), us in _kernel_time(events).most_common(top)
    ]


def kernel_time_by_site(events: list, num_steps: int, top: int = 12) -> list:
    """GPU kernel time per step by launch site alone, [site, us]: a step's phases (each
    replayed graph, e.g. the draft decode, the verify and the draft extend, and the eager
    work between them), which with the idle time add up to the step's GPU span."""
    by_site = collections.Counter()
    for (_, _, site), us in _kernel_time(events).items():
        by_site[site] += us
    return [[site, round(us / num_steps, 1)] for site, us in by_site.most_common(top)]


def _kernel_time(events: list) -> collections.Counter:
    """Kernel microseconds by (kernel name, torch op, launch site), as
    kernel_time_by_launch_site describes them."""
    launches = launches_by_correlation(events)
    frames_by_tid, frame_starts = sglang_frames_by_thread(events)
    ops_by_tid, op_starts = events_by_thread(events, lambda e: e.get("cat") == "cpu_op")
    by_site = collections.Counter()
    for k in events:
        if k.get("cat") != "kernel":
            continue
        call = launches.get(k.get("args", {}).get("correlation"))
        if call is None:
            op, site = "", "?"
        else:
            ops = enclosing(call, ops_by_tid, op_starts, 1)
            op = ops[0]["name"] if ops else ""
            site = call_site(call, frames_by_tid, frame_starts, 2) or call["name"]
            if call["name"] == "cudaGraphLaunch":
                site = "graph: " + site
        by_site[(k["name"], op, site)] += k["dur"]
    return by_site


def engine_settings(target, draft, name: str, bs: int) -> dict:
    """bench_e2e's engine of config `name` (the policy's config file included), with CUDA
    graphs at the profiled size only: capturing sglang's default list is most of start-up.
    """
    kwargs = bench_e2e.engine_settings(
        target, draft, name, [bs], eng.BUNDLE_FLAGS["attention_backend"]
    )
    kwargs["max_running_requests"] = max(bs, 4)
    return kwargs


def profile_config(
    target,
    draft,
    name: str,
    bs: int,
    num_steps: int,
    vocab: int,
    out_dir: Path,
    with_stack: bool = False,
    extra_env: dict[str, str] | None = None,
    settle_seconds: float = 0.05,
    first_tokens: int = 0,
    freeze_gc: bool = False,
) -> dict:
    """The profile summary of `num_steps` decode steps of config `name` at batch size bs;
    with first_tokens > 0, of that many batches of the same prompts run to their first
    token one after another instead (prefill of target and draft, the first sampled token
    and whatever the scheduler launches before it sees the requests finished), "per step"
    then meaning per batch. After the warm-up the prompts are in the radix cache, so each
    prefill extends a cached prefix by the prompt's last token."""
    config, _, _ = bench_e2e.split_config(name, eng.BUNDLE_FLAGS["attention_backend"])
    spec, env = bench_e2e.CONFIGS[config]
    env = {**env, **(extra_env or {})}
    trace_dir = out_dir / name
    with (
        bench_e2e.scoped_env(env),
        eng.engine(**engine_settings(target, draft, name, bs)) as e,
    ):
        if freeze_gc:  # as bench_e2e --freeze-gc
            e.freeze_gc()
        prompts = eng.random_prompts(bs, vocab, seed=bs)
        warm = eng.best_of(e, prompts, 256, 1)

        async def decode_under_profiler():
            # The profiler opens at the forward after settle_seconds and closes num_steps
            # forwards later; the generation outlasts it on both ends. Past the batch's
            # prefill (a large batch's prefill and its radix-cache inserts would otherwise
            # count as decode steps), the window is steady-state decode.
            params = dict(temperature=0.0, max_new_tokens=1024, ignore_eos=True)
            generation = asyncio.ensure_future(
                e.async_generate(input_ids=prompts, sampling_params=params)
            )
            await asyncio.sleep(settle_seconds)
            await e.tokenizer_manager.start_profile(
                output_dir=str(trace_dir),
                num_steps=num_steps,
                activities=["CPU", "GPU"],
                with_stack=with_stack,
                record_shapes=False,
            )
            await generation

        if first_tokens:
            profile_first_tokens(e, prompts, first_tokens, trace_dir, with_stack)
        else:
            e.loop.run_until_complete(decode_under_profiler())
        traces = sorted(trace_dir.glob("*.trace.json.gz"))
        if not traces:
            raise RuntimeError(f"{name}: the profiler wrote no trace under {trace_dir}")
        summary = summarise_trace(traces[-1], first_tokens or num_steps)
    summary.update(
        config=name,
        bs=bs,
        tok_per_s=warm.tok_per_s,
        accept_length=warm.accept_length if spec else 1.0,
    )
    return summary


def profile_first_tokens(
    e, prompts: list[list[int]], count: int, trace_dir: Path, with_stack: bool
) -> None:
    """Profile `count` batches of `prompts`, each run to its first token, back to back.
    The window is closed by hand: a batch that ends at its first token may run fewer
    forwards than a step count would wait for."""
    eng.generate(e, prompts, 1)  # this path's own first-use costs, outside the window
    e.start_profile(
        output_dir=str(trace_dir),
        activities=["CPU", "GPU"],
        with_stack=with_stack,
        record_shapes=False,
    )
    for _ in range(count):
        eng.generate(e, prompts, 1)
    e.stop_profile()


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="bench", choices=sorted(synth.PRESETS))
    p.add_argument("--agreement", type=float, default=0.7)
    p.add_argument("--configs", default="chain,tree,tree-v1")
    p.add_argument("--tree", default="4,3,8")
    p.add_argument("--bs", type=int, default=1)
    p.add_argument(
        "--policy-shapes",
        default=" ".join(bench_e2e.POLICY_SHAPES),
        help='shapes of the "policy" config, as bench_e2e takes them',
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--settle-seconds",
        type=float,
        default=0.05,
        help="start profiling this long after submitting the batch, so that at a large "
        "batch size the window is past its prefill",
    )
    p.add_argument(
        "--first-tokens",
        type=int,
        default=0,
        metavar="N",
        help="profile N batches run to their first token instead of decode steps (a "
        "speculating engine's prefill path); per-step numbers are then per batch",
    )
    p.add_argument(
        "--with-stack", action="store_true", help="Python frames: names the sync sites"
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set for every config's engine, e.g. SGLANG_KV_CANARY=raise (repeatable)",
    )
    p.add_argument(
        "--freeze-gc",
        action="store_true",
        help="sglang's freeze_gc once each engine is up (bench_e2e --freeze-gc)",
    )
    p.add_argument("--models")
    p.add_argument("--out")
    args = p.parse_args()
    bench_e2e.set_tree_shape(*(int(x) for x in args.tree.split(",")))
    bench_e2e.set_policy_shapes(args.policy_shapes.split())
    target, draft = bench_e2e.ensure_pair(args.models, args.preset, args.agreement)
    vocab = synth.load_meta(target)["spec"]["vocab"]
    out_dir = Path(tempfile.mkdtemp())
    results = []
    for name in args.configs.split(","):
        s = profile_config(
            target,
            draft,
            name,
            args.bs,
            args.steps,
            vocab,
            out_dir,
            args.with_stack,
            parse_env(args.env),
            args.settle_seconds,
            args.first_tokens,
            freeze_gc=args.freeze_gc,
        )
        results.append(s)
        print(
            f"{name:>14} bs {args.bs}: {s['tok_per_s']:.0f} tok/s accept {s['accept_length']:.2f} | "
            f"GPU span {s['gpu_span_us_per_step']:.0f} us/step, busy {s['gpu_busy_fraction']:.0%}, "
            f"{s['kernels_per_step']:.0f} kernels, {s['kernel_launches_per_step']:.0f} launches, "
            f"{s['graph_launches_per_step']:.1f} graphs, {s['syncs_per_step']:.1f} syncs "
            f"({s['sync_us_per_step']:.0f} us), "
            f"{s['memcpy_per_step']:.1f} memcpys per step",
            flush=True,
        )
        print("  GPU idle us per step, by the launch that ended the gap:")
        for site, us in s["gpu_idle_by_launch_site_us_per_step"][:8]:
            print(f"  {us:>8.1f}  {site}")
        print(
            "  kernel us per step, by launch site (graphs and the eager work between):"
        )
        for site, us in s["kernel_us_by_site_per_step"][:8]:
            print(f"  {us:>8.1f}  {site}")
        print("  kernel us per step, by torch op and launch site:")
        for kernel, op, site, us in s["kernel_us_by_launch_site_per_step"][:10]:
            print(f"  {us:>8.1f}  {kernel[:100]} | {op or '-'} | {site}")
        if args.out:  # after every config, so a call cut short keeps what finished
            Path(args.out).write_text(json.dumps(results, indent=1))
    if len(results) >= 2:
        print_host_comparison(results[0], results[1], args.with_stack)


def print_host_comparison(a: dict, b: dict, with_stack: bool) -> None:
    """The first two configs' host ops side by side and, with stacks, the Python frames
    whose exclusive time differs most."""
    ratio, ops = host_op_slowdown(a, b)
    print(
        f"host ops: {a['config']} {a['cpu_ops_per_step']:.0f} a step, "
        f"{b['config']} {b['cpu_ops_per_step']:.0f}; per call {a['config']} takes "
        f"{ratio:.2f}x {b['config']}'s (median over {ops} ops)"
    )
    if with_stack:
        print(
            f"exclusive host us per step, {a['config']} - {b['config']} (largest differences):"
        )
        for name, x, y, diff in host_time_differences(
            a["scheduler_self_us_per_step"], b["scheduler_self_us_per_step"]
        ):
            print(f"  {diff:>+8.1f}  ({x:>7.1f} vs {y:>7.1f})  {name}")


if __name__ == "__main__":
    main()
