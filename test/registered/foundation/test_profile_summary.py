"""benchmark/spec/profile_decode.py's trace summary, on a hand-made chrome trace."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import profile_decode  # noqa: E402


def _kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def _frame(name, ts, dur, tid=1):
    return {"cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid}


def _runtime(name, ts=0, dur=1):
    return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur}


def test_summary_counts_per_step_and_merges_overlapping_kernels(tmp_path):
    events = [
        # Two steps over 0..100 us; kernels on two streams overlap at 10..20.
        _kernel("gemm", 0, 20),
        _kernel("topk", 10, 20),
        _kernel("gemm", 60, 20),
        _kernel("copy", 90, 10),
        _runtime("cudaLaunchKernel"),
        _runtime("cudaLaunchKernel"),
        _runtime("cudaLaunchKernel"),
        _runtime("cudaGraphLaunch"),
        _runtime("cudaStreamSynchronize"),
        _runtime("cudaMemcpyAsync"),
        {**_runtime("cuLaunchKernelEx"), "cat": "cuda_driver"},  # triton's launches
        {"cat": "cpu_op", "name": "aten::topk", "ts": 0, "dur": 8},
        {"cat": "cpu_op", "name": "aten::topk", "ts": 50, "dur": 4},
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)

    s = profile_decode.summarise_trace(path, num_steps=2)

    assert s["gpu_span_us_per_step"] == 50.0
    assert s["gpu_busy_fraction"] == 0.6  # 0..30 and 60..80 and 90..100 of 0..100
    assert s["kernels_per_step"] == 2.0
    assert s["kernel_launches_per_step"] == 2.0
    assert s["graph_launches_per_step"] == 0.5
    assert s["syncs_per_step"] == 0.5 and s["memcpy_per_step"] == 0.5
    assert s["kernel_count_per_step"][0] == ("gemm", 1.0)
    assert s["cpu_op_us_per_step"] == [("aten::topk", 6.0)]
    assert s["cpu_ops_per_step"] == 1.0
    assert s["sync_sites"] == [("cudaStreamSynchronize", 1)]
    assert s["sync_us_per_step"] == 0.5


def test_sync_callers_are_the_innermost_enclosing_sglang_frames():
    events = [
        _frame("sglang/srt/managers/scheduler.py(10): event_loop", 0, 1000),
        _frame("sglang/srt/speculative/eagle_worker_v2.py(50): verify", 100, 300),
        _frame(
            "torch/cuda/streams.py(9): synchronize", 150, 100
        ),  # not sglang: skipped
        _frame(
            "sglang/srt/speculative/eagle_worker_v2.py(70): draft", 500, 100
        ),  # after: not enclosing
        _frame("sglang/srt/other.py(1): elsewhere", 160, 20, tid=2),  # other thread
    ]
    runtime = [
        {
            "cat": "cuda_runtime",
            "name": "cudaStreamSynchronize",
            "ts": 160,
            "dur": 80,
            "tid": 1,
        }
    ]

    callers = profile_decode.sync_callers(
        events + runtime, runtime, num_steps=2, depth=2
    )

    assert callers == [
        (
            "srt/speculative/eagle_worker_v2.py(50): verify <- "
            "srt/managers/scheduler.py(10): event_loop",
            40.0,
        )
    ]


def test_env_pairs_are_parsed_and_bad_ones_refused():
    assert profile_decode.parse_env(["SGLANG_KV_CANARY=raise", "X=a=b", "EMPTY="]) == {
        "SGLANG_KV_CANARY": "raise",
        "X": "a=b",
        "EMPTY": "",
    }
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        profile_decode.parse_env(["SGLANG_KV_CANARY"])


def test_python_frames_rank_sglang_functions_by_inclusive_time():
    events = [
        _frame("sglang/srt/a.py(1): outer", 0, 100),
        _frame("sglang/srt/b.py(2): inner", 10, 30),
        _frame("sglang/srt/b.py(2): inner", 50, 30),
        _frame("torch/x.py(3): not_ours", 0, 500),
    ]
    assert profile_decode.python_frames(events, num_steps=2, top=5) == [
        ("srt/a.py(1): outer", 50.0),
        ("srt/b.py(2): inner", 30.0),
    ]


def test_outermost_time_counts_nested_frames_once_per_thread():
    events = [
        _frame("sglang/srt/kv_canary/manager.py(1): bracket", 0, 100),
        _frame(
            "sglang/srt/kv_canary/single_forward.py(2): stage", 10, 50
        ),  # inside the bracket
        _frame(
            "sglang/srt/kv_canary/manager.py(3): report", 90, 30
        ),  # overlaps its end: +20
        _frame(
            "sglang/srt/kv_canary/manager.py(1): bracket", 0, 40, tid=2
        ),  # another thread
        _frame("sglang/srt/speculative/x.py(4): draft", 0, 1000),  # not canary
    ]
    assert (
        profile_decode.outermost_time(events, "kv_canary/", num_steps=2)
        == (100 + 20 + 40) / 2
    )


def test_python_self_time_subtracts_callees_per_thread():
    events = [
        _frame("sglang/srt/a.py(1): loop", 0, 100),
        _frame("sglang/srt/b.py(2): verify", 10, 30),
        _frame("sglang/srt/c.py(3): move", 15, 5),
        _frame("sglang/srt/b.py(2): verify", 50, 20),
        _frame(
            "sglang/srt/c.py(3): move", 0, 40, tid=2
        ),  # another thread: its own stack
    ]

    self_time = dict(profile_decode.python_self_time(events, num_steps=1, top=10))

    assert self_time == {
        "srt/a.py(1): loop": 50.0,
        "srt/b.py(2): verify": 45.0,
        "srt/c.py(3): move": 45.0,
    }


def test_host_op_slowdown_is_the_median_per_call_ratio_of_the_ops_both_ran():
    slow = {
        "cpu_op_count_per_step": [("aten::slice", 100), ("aten::view", 50), ("a", 2)],
        "cpu_op_us_per_step": [("aten::slice", 400.0), ("aten::view", 60.0), ("b", 9)],
    }
    fast = {
        "cpu_op_count_per_step": [("aten::slice", 100), ("aten::view", 40), ("b", 3)],
        "cpu_op_us_per_step": [("aten::slice", 200.0), ("aten::view", 40.0), ("a", 5)],
    }

    # slice 4.0 against 2.0 us a call, view 1.2 against 1.0: ops "a" and "b" are in one
    # list of each summary only.
    ratio, ops = profile_decode.host_op_slowdown(slow, fast)

    assert (ratio, ops) == (pytest.approx(1.6), 2)
    assert profile_decode.host_op_slowdown(
        slow, {**fast, "cpu_op_us_per_step": []}
    ) == (
        1.0,
        0,
    )


def test_two_configs_host_ops_are_compared_in_one_line_without_stacks(capsys):
    def summary(config, slice_us):
        return {
            "config": config,
            "cpu_ops_per_step": 4284.0,
            "cpu_op_count_per_step": [("aten::slice", 100)],
            "cpu_op_us_per_step": [("aten::slice", slice_us)],
        }

    profile_decode.print_host_comparison(
        summary("policy", 390.0), summary("chain", 200.0), with_stack=False
    )

    assert capsys.readouterr().out == (
        "host ops: policy 4284 a step, chain 4284; per call policy takes 1.95x "
        "chain's (median over 1 ops)\n"
    )


def test_host_time_differences_rank_frames_by_the_gap_between_two_configs():
    v2 = [("verify", 900.0), ("resolve_future", 120.0), ("draft", 400.0)]
    v1 = [("verify", 950.0), ("draft", 400.0), ("v1_only", 30.0)]

    rows = profile_decode.host_time_differences(v2, v1, top=3)

    # resolve_future exists only in v2 (counts 0 in v1); draft costs the same and drops out.
    assert rows == [
        ("resolve_future", 120.0, 0.0, 120.0),
        ("verify", 900.0, 950.0, -50.0),
        ("v1_only", 0.0, 30.0, -30.0),
    ]


def test_scheduler_thread_frames_keep_their_names_across_traces():
    events = [
        _frame(
            "sglang/srt/managers/scheduler.py(1579): event_loop_overlap", 0, 100, tid=7
        ),
        _frame(
            "<built-in method copy_ of Tensor object at 0x7f46cd1eaf30>", 10, 30, tid=7
        ),
        _frame("threading.py(359): wait", 0, 100, tid=3),  # an idle helper thread
    ]

    scheduler = profile_decode.scheduler_thread_events(events)
    self_time = dict(profile_decode.python_self_time(scheduler, num_steps=1, top=10))

    assert self_time == {
        "srt/managers/scheduler.py(1579): event_loop_overlap": 70.0,
        "<built-in method copy_ of Tensor object>": 30.0,
    }


def _gpu(cat, ts, dur, correlation):
    return {
        "cat": cat,
        "name": cat,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": correlation},
    }


def _launch(name, ts, dur, correlation, tid=1):
    return {
        "cat": "cuda_runtime",
        "name": name,
        "ts": ts,
        "dur": dur,
        "tid": tid,
        "args": {"correlation": correlation},
    }


def test_gpu_idle_gaps_are_charged_to_the_launch_that_ended_them():
    events = [
        _frame("sglang/srt/managers/scheduler.py(10): event_loop", 0, 1000),
        _frame("sglang/srt/speculative/eagle_worker_v2.py(50): draft", 0, 100),
        _frame("sglang/srt/speculative/eagle_worker_v2.py(90): verify", 300, 200),
        # Kernel 1 at 10..40, launched by draft. The copy ending the 40..60 gap was queued
        # at 20 (before the gap opened): a dependency wait, not the host.
        _launch("cudaLaunchKernel", 5, 3, correlation=1),
        _gpu("kernel", 10, 30, 1),
        _launch("cudaMemcpyAsync", 20, 2, correlation=2),
        _gpu("gpu_memcpy", 60, 20, 2),
        # The GPU idles 80..350 until verify's graph launch at 340 reaches it.
        _launch("cudaGraphLaunch", 340, 5, correlation=3),
        _gpu("kernel", 350, 100, 3),
        # A kernel overlapping the previous one (another stream) closes no gap.
        _launch("cudaLaunchKernel", 360, 3, correlation=4),
        _gpu("kernel", 400, 10, 4),
        # No enclosing sglang frame: the runtime call names the site.
        _launch("cudaLaunchKernel", 600, 3, correlation=5, tid=2),
        _gpu("gpu_memset", 610, 5, 5),
        # Triton launches through the driver API.
        {
            **_launch("cuLaunchKernelEx", 640, 3, correlation=6, tid=2),
            "cat": "cuda_driver",
        },
        _gpu("kernel", 645, 5, 6),
        # A GPU event whose launch is missing from the trace.
        _gpu("kernel", 700, 5, 99),
    ]

    idle = dict(profile_decode.gpu_idle_by_launch_site(events, num_steps=2, depth=2))

    verify = "srt/speculative/eagle_worker_v2.py(90): verify <- srt/managers/scheduler.py(10): event_loop"
    draft = "srt/speculative/eagle_worker_v2.py(50): draft <- srt/managers/scheduler.py(10): event_loop"
    assert idle == {
        verify: 135.0,  # (350 - 80) / 2
        "cudaLaunchKernel": 80.0,  # (610 - 450) / 2
        "cuLaunchKernelEx": 15.0,  # (645 - 615) / 2
        "?": 25.0,  # (700 - 650) / 2
        "queued: " + draft: 10.0,  # (60 - 40) / 2
    }


def test_gpu_idle_of_a_trace_without_gaps_is_empty():
    events = [
        _launch("cudaLaunchKernel", 0, 1, 1),
        _gpu("kernel", 1, 10, 1),
        _launch("cudaLaunchKernel", 2, 1, 2),
        _gpu("kernel", 11, 10, 2),
    ]
    assert profile_decode.gpu_idle_by_launch_site(events, num_steps=1) == []


def test_a_profiled_engine_is_bench_e2es_with_graphs_at_the_profiled_size(monkeypatch):
    import json

    monkeypatch.setattr(profile_decode.eng, "pool_tokens_for", lambda target: 1 << 16)
    kwargs = profile_decode.engine_settings(Path("/t"), Path("/d"), "policy", 64)
    assert kwargs["cuda_graph_bs"] == [64]
    assert kwargs["max_running_requests"] == 64
    # The policy config runs the shape policy, as in bench_e2e.
    config = json.loads(Path(kwargs["speculative_adaptive_config"]).read_text())
    assert config["shapes"] == profile_decode.bench_e2e.POLICY_SHAPES
    small = profile_decode.engine_settings(Path("/t"), Path("/d"), "chain", 1)
    assert small["max_running_requests"] == 4
    assert "speculative_adaptive" not in small


def test_kernel_time_is_charged_to_its_torch_op_and_launch_site():
    """Eager kernels get the innermost enclosing torch op and sglang frames of their launch;
    a kernel inside a replayed graph gets the replay's site, marked as a graph."""
    long_name = "void at::native::elementwise_kernel<128, 4, " + "x" * 120 + ">"
    events = [
        _frame("sglang/srt/speculative/eagle_worker_v2.py(70): draft", 0, 1000),
        _frame("sglang/srt/speculative/eagle_utils.py(9): cast_head", 100, 100),
        {"cat": "cpu_op", "name": "aten::to", "ts": 100, "dur": 90, "tid": 1},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 110, "dur": 60, "tid": 1},
        {
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 120,
            "dur": 5,
            "tid": 1,
            "args": {"correlation": 7},
        },
        {
            "cat": "cuda_runtime",
            "name": "cudaGraphLaunch",
            "ts": 300,
            "dur": 5,
            "tid": 1,
            "args": {"correlation": 8},
        },
        {**_kernel(long_name, 130, 150), "args": {"correlation": 7}},
        {**_kernel("gemm", 310, 40), "args": {"correlation": 8}},
        {**_kernel("gemm", 360, 40), "args": {"correlation": 8}},
        {**_kernel("orphan", 400, 10), "args": {"correlation": 99}},
    ]

    rows = profile_decode.kernel_time_by_launch_site(events, num_steps=2)

    draft = "srt/speculative/eagle_worker_v2.py(70): draft"
    assert rows == [
        [
            long_name,
            "aten::copy_",
            "srt/speculative/eagle_utils.py(9): cast_head <- " + draft,
            75.0,
        ],
        ["gemm", "", "graph: " + draft, 40.0],
        ["orphan", "", "?", 5.0],
    ]
    # The same kernels by launch site alone: a step's phases.
    assert profile_decode.kernel_time_by_site(events, num_steps=2) == [
        ["srt/speculative/eagle_utils.py(9): cast_head <- " + draft, 75.0],
        ["graph: " + draft, 40.0],
        ["?", 5.0],
    ]


class FakeEngine:
    """What profile_first_tokens calls, in order."""

    def __init__(self):
        self.calls = []

    def generate(self, input_ids, sampling_params):
        self.calls.append(("generate", sampling_params["max_new_tokens"]))
        return [
            {"output_ids": [0], "meta_info": {"completion_tokens": 1}}
            for _ in input_ids
        ]

    def start_profile(self, **kwargs):
        self.calls.append(("start", kwargs["output_dir"], "num_steps" in kwargs))

    def stop_profile(self):
        self.calls.append(("stop",))


def test_first_tokens_are_profiled_in_a_window_closed_by_hand(tmp_path):
    e = FakeEngine()

    profile_decode.profile_first_tokens(e, [[1, 2], [3]], 3, tmp_path, False)

    assert e.calls == [
        ("generate", 1),  # first use, outside the window
        ("start", str(tmp_path), False),  # no step count: closed by stop_profile
        ("generate", 1),
        ("generate", 1),
        ("generate", 1),
        ("stop",),
    ]
