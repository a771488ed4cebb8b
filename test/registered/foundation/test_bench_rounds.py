"""benchmark/spec/bench_e2e.py: per-round ratios (each round pairs the engines it started) and
config names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import bench_e2e  # noqa: E402

from specpatch.testing import engine as eng  # noqa: E402


def test_round_ratios_pair_the_configs_of_each_round():
    per_round = {
        ("tree", 1): [800.0, 780.0],
        ("tree-v1", 1): [640.0, 600.0],
        ("tree", 4): [2500.0, 2600.0],
        ("tree-v1", 4): [2000.0, 2080.0],
        ("chain", 4): [3000.0, 3100.0],  # neither side of the ratio
        ("tree", 16): [8000.0],  # no v1 engine at bs 16: no ratio
    }

    ratios = bench_e2e.round_ratios(per_round, "tree", "tree-v1")

    assert ratios == {
        1: [pytest.approx(1.25), pytest.approx(1.3)],
        4: [pytest.approx(1.25), pytest.approx(1.25)],
    }


@pytest.mark.parametrize(
    "name,expected",
    [
        ("tree", ("tree", "triton", 1)),
        ("tree@fa3", ("tree", "fa3", 1)),
        ("tree-v1@flashinfer:16", ("tree-v1", "flashinfer", 16)),
        ("none:64", ("none", "triton", 64)),
    ],
)
def test_config_names_carry_backend_and_page_size(name, expected):
    assert bench_e2e.split_config(name, "triton") == expected


def test_unknown_config_name_is_refused():
    with pytest.raises(SystemExit, match="unknown config 'forest'"):
        bench_e2e.split_config("forest@fa3:16", "triton")


def test_engines_capture_cuda_graphs_at_the_measured_batch_sizes_only(monkeypatch):
    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    kwargs = bench_e2e.engine_settings(
        Path("/t"), Path("/d"), "tree-v1@flashinfer:16", [16, 1, 4, 48, 4], "triton"
    )
    assert kwargs["cuda_graph_bs"] == [1, 4, 16, 48]
    assert kwargs["max_running_requests"] == 48
    assert kwargs["disable_cuda_graph"] is False
    assert (kwargs["attention_backend"], kwargs["page_size"]) == ("flashinfer", 16)
    assert kwargs["disable_overlap_schedule"] is True  # tree-v1 is spec v1


def test_the_engines_log_at_the_level_asked_for(monkeypatch):
    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)

    def log_level() -> str:
        kwargs = bench_e2e.engine_settings(
            Path("/t"), Path("/d"), "chain", [1], "triton"
        )
        return kwargs["log_level"]

    assert log_level() == "warning"
    monkeypatch.setattr(bench_e2e, "ENGINE_LOG_LEVEL", ["info"])
    assert log_level() == "info"


def test_the_policy_config_runs_the_shape_policy_over_its_shapes(monkeypatch):
    import json

    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    saved = list(bench_e2e.POLICY_SHAPES), bench_e2e.CONFIGS["policy"]
    try:
        bench_e2e.set_policy_shapes(["4,3,8", "1,3,4"])
        kwargs = bench_e2e.engine_settings(
            Path("/t"), Path("/d"), "policy@fa3", [1, 48], "triton"
        )
    finally:
        bench_e2e.POLICY_SHAPES[:], bench_e2e.CONFIGS["policy"] = saved
    assert kwargs["speculative_adaptive"] is True
    config = json.loads(Path(kwargs["speculative_adaptive_config"]).read_text())
    assert config == {"shapes": ["4,3,8", "1,3,4"]}
    shape = (
        kwargs["speculative_eagle_topk"],
        kwargs["speculative_num_steps"],
        kwargs["speculative_num_draft_tokens"],
    )
    assert shape == (4, 3, 8)  # the first shape is the flags' own
    fixed = bench_e2e.engine_settings(Path("/t"), Path("/d"), "narrow", [1], "triton")
    assert "speculative_adaptive" not in fixed


def test_the_warm_up_cycles_the_policy_through_every_bucket_and_graph(
    monkeypatch, tmp_path
):
    import contextlib
    import json
    import types

    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    started, batches = [], []

    class FakeEngine:
        # what sglang resolves for a mixed load (its default list)
        server_args = types.SimpleNamespace(cuda_graph_bs=[1, 2, 4, 8, 12, 24, 80])

    @contextlib.contextmanager
    def fake_engine(**kwargs):
        started.append(kwargs)
        yield FakeEngine()

    monkeypatch.setattr(bench_e2e.eng, "engine", fake_engine)
    monkeypatch.setattr(
        bench_e2e.eng, "generate", lambda e, prompts, n: batches.append(len(prompts))
    )
    monkeypatch.setattr(bench_e2e, "POLICY_TRACE", [str(tmp_path / "trace.jsonl")])
    bench_e2e.warm_jit_caches(
        Path("/t"),
        Path("/d"),
        ["none", "policy", "chain"],
        [1, 48],
        100,
        "triton",
        bench_e2e.MixedLoad(64, 1.5),
    )
    assert batches == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]  # not 80: above the largest
    (kwargs,) = started
    config = json.loads(Path(kwargs["speculative_adaptive_config"]).read_text())
    assert config["force_switch_every"] == 1
    assert config["shapes"] == bench_e2e.POLICY_SHAPES
    assert "trace" not in config  # the measured policy engine's trace stays its own
    assert kwargs["max_running_requests"] == 64


def test_without_a_policy_the_warm_up_is_the_first_config_at_bs_1(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_e2e, "measure", lambda *a, **k: calls.append(a[2:4]))
    bench_e2e.warm_jit_caches(
        Path("/t"), Path("/d"), ["none", "chain"], [1, 48], 100, "triton", None
    )
    assert calls == [("none", [1])]


def test_a_mixed_load_keeps_sglangs_graph_sizes_and_sorts_last(monkeypatch):
    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    mixed = bench_e2e.MixedLoad.parse("64:2.5")
    assert (mixed.requests, mixed.ramp_seconds) == (64, 2.5)
    kwargs = bench_e2e.engine_settings(
        Path("/t"), Path("/d"), "tree", [1, 4], "triton", mixed
    )
    assert "cuda_graph_bs" not in kwargs  # every batch size runs
    assert kwargs["max_running_requests"] == 64
    rows = [
        {"config": "tree", "bs": "mixed"},
        {"config": "none", "bs": 4},
        {"config": "tree", "bs": 1},
        {"config": "none", "bs": "mixed"},
        {"config": "none", "bs": 1},
    ]
    ordered = sorted(rows, key=bench_e2e.row_order(["none", "tree"]))
    assert [(r["config"], r["bs"]) for r in ordered] == [
        ("none", 1),
        ("none", 4),
        ("none", "mixed"),
        ("tree", 1),
        ("tree", "mixed"),
    ]


def test_cuda_graph_bs_names_every_engines_sizes_a_mixed_load_included(monkeypatch):
    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    monkeypatch.setattr(bench_e2e, "CUDA_GRAPH_BS", [1, 2, 4, 8, 16, 32, 64])
    mixed = bench_e2e.MixedLoad.parse("64:1.5")

    for load in (mixed, None):
        kwargs = bench_e2e.engine_settings(
            Path("/t"), Path("/d"), "chain", [1, 4], "triton", load
        )
        assert kwargs["cuda_graph_bs"] == [1, 2, 4, 8, 16, 32, 64]


def test_cuda_graph_bs_below_the_runs_largest_batch_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(bench_e2e, "CUDA_GRAPH_BS", [])
    monkeypatch.setattr(
        sys,
        "argv",
        ["bench_e2e.py", "--batch-sizes", "", "--mixed-load", "64:1.5:4x1024"]
        + ["--cuda-graph-bs", "1,8,32"],
    )

    with pytest.raises(SystemExit):
        bench_e2e.main()

    # 64 ramp requests and 4 long ones: bs 68 would run eagerly.
    assert "the run reaches bs 68" in capsys.readouterr().err


def test_a_mixed_load_with_a_long_tail_sends_the_long_requests_first(monkeypatch):
    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    mixed = bench_e2e.MixedLoad.parse("4:2:2x1024")
    assert mixed.label == "4:2:2x1024"
    delays, tokens = mixed.arrivals(128)
    assert delays == [0.0, 0.0, 0.0, 0.5, 1.0, 1.5]
    assert tokens == [1024, 1024, 128, 128, 128, 128]
    kwargs = bench_e2e.engine_settings(
        Path("/t"), Path("/d"), "tree", [1], "triton", mixed
    )
    assert (
        kwargs["max_running_requests"] == 6
    )  # the tail's requests run beside the ramp's
    assert bench_e2e.MixedLoad.parse("64:1.5").label == "64:1.5"


@pytest.mark.parametrize("text", ["64", "64:x", "64:1.5:4", "64:1.5:4x", "a:1"])
def test_a_malformed_mixed_load_names_the_flag(text):
    with pytest.raises(SystemExit, match="--mixed-load"):
        bench_e2e.MixedLoad.parse(text)


def test_divergence_is_counted_against_each_requests_own_length():
    successor = [1, 2, 3, 0]  # token t -> t + 1 mod 4
    prompts = [[0], [2]]
    ok = eng.GreedyRun(output_ids=[[1, 2, 3], [3]], seconds=1.0, completion_tokens=4)
    assert bench_e2e.diverged_requests(ok, prompts, successor, [3, 1]) == 0
    # The second request's one token is wrong; a shared length would call both wrong.
    bad = eng.GreedyRun(output_ids=[[1, 2, 3], [1]], seconds=1.0, completion_tokens=4)
    assert bench_e2e.diverged_requests(bad, prompts, successor, [3, 1]) == 1
    assert bench_e2e.diverged_requests(ok, prompts, successor, 3) == 1


def test_measured_rows_become_a_policy_config(tmp_path, capsys):
    import json

    rows = [
        {"config": "tree", "bs": 4, "tok_per_s": 2000.0, "accept_length": 3.0},
        {"config": "chain", "bs": 4, "tok_per_s": 2400.0, "accept_length": 2.4},
        {"config": "chain@fa3", "bs": 4, "tok_per_s": 9e9, "accept_length": 2.4},
        {"config": "tree:16", "bs": 4, "tok_per_s": 9e9, "accept_length": 3.0},
        {"config": "tree-v1", "bs": 4, "tok_per_s": 9e9, "accept_length": 3.0},
        {"config": "none", "bs": 4, "tok_per_s": 9e9, "accept_length": 1.0},
        {"config": "tree", "bs": "mixed", "tok_per_s": 9e9, "accept_length": 3.0},
    ]
    saved = bench_e2e.CONFIGS["tree"], bench_e2e.CONFIGS["tree-v1"]
    try:
        bench_e2e.set_tree_shape(16, 3, 32)
        path = tmp_path / "policy.json"
        bench_e2e.write_policy_config(rows, ["16,3,32", "1,3,4"], "triton", str(path))
        config = json.loads(path.read_text())
        assert config["shapes"] == ["16,3,32", "1,3,4"]
        assert config["step_costs"]["16,3,32"] == {"4": pytest.approx(4 * 3.0 / 2000)}
        assert config["step_costs"]["1,3,4"] == {"4": pytest.approx(4 * 2.4 / 2400)}
        missing = tmp_path / "none.json"
        bench_e2e.write_policy_config(rows, ["4,3,8"], "triton", str(missing))
        assert not missing.exists()
        assert "no triton rows for ['4,3,8']" in capsys.readouterr().out
    finally:
        bench_e2e.CONFIGS["tree"], bench_e2e.CONFIGS["tree-v1"] = saved


def test_a_written_policy_config_is_what_the_policy_config_runs(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    path = tmp_path / "policy.json"
    path.write_text(
        json.dumps(
            {"shapes": ["4,3,8", "1,1,2"], "step_costs": {"4,3,8": {"1": 0.004}}}
        )
    )
    for name in bench_e2e.POLICY_STEP_TIME:
        monkeypatch.setitem(bench_e2e.CONFIGS, name, bench_e2e.CONFIGS[name])
    monkeypatch.setattr(bench_e2e, "POLICY_SHAPES", list(bench_e2e.POLICY_SHAPES))
    monkeypatch.setattr(bench_e2e, "POLICY_CONFIG", [None])
    monkeypatch.setattr(bench_e2e, "POLICY_TRACE", [None])
    bench_e2e.set_policy_config(str(path))
    kwargs = bench_e2e.engine_settings(Path("/t"), Path("/d"), "policy", [1], "x")
    assert kwargs["speculative_adaptive_config"] == str(path)
    assert kwargs["speculative_eagle_topk"] == 4

    # The same config timed by periods: a copy with "step_time", tracing to its own file.
    bench_e2e.POLICY_TRACE[0] = str(tmp_path / "trace.jsonl")
    period = bench_e2e.engine_settings(
        Path("/t"), Path("/d"), "policy-period", [1], "x"
    )
    copied = json.loads(Path(period["speculative_adaptive_config"]).read_text())
    assert copied["step_time"] == "period"
    assert copied["step_costs"] == {"4,3,8": {"1": 0.004}}
    assert copied["trace"] == str(tmp_path / "trace.jsonl.period")
    assert period["speculative_eagle_topk"] == 4
    plain = bench_e2e.engine_settings(Path("/t"), Path("/d"), "policy", [1], "x")
    assert "step_time" not in json.loads(
        Path(plain["speculative_adaptive_config"]).read_text()
    )


def row(config, bs, tok_per_s):
    """A benchmark row as policy_ratios reads it."""
    return {"config": config, "bs": bs, "tok_per_s": tok_per_s}


def test_each_policy_config_gets_its_own_ratios(capsys):
    rows = [
        row("none", 1, 100.0),
        row("chain", 1, 150.0),
        row("policy", 1, 140.0),
        row("policy-period", 1, 160.0),  # not a fixed shape for the other policy
    ]

    assert bench_e2e.policy_ratios(rows)[1] == (
        pytest.approx(1.4),
        pytest.approx(140 / 150),
        "chain",
    )
    assert bench_e2e.policy_ratios(rows, "policy-period")[1][2] == "chain"
    bench_e2e.print_policy_ratios(rows)
    out = capsys.readouterr().out
    assert "policy, best runs (targets" in out and "policy-period, best runs" in out
    assert "1.07x chain" in out
    assert "median runs" not in out  # one run per engine: nothing more to compare


def test_each_round_compares_the_policy_with_that_rounds_best_fixed_shape(capsys):
    side = ["policy", "chain", "narrow", "none"]

    def runs(config, values):
        return {
            "config": config,
            "bs": "mixed",
            "tok_per_s": max(values),
            "tok_per_s_repeats": values,
            "side_by_side": side,
        }

    rows = [
        runs("policy", [3000.0, 2900.0, 3300.0]),
        runs("chain", [2800.0, 3000.0, 3100.0]),
        runs("narrow", [2900.0, 2600.0, 3200.0]),
        runs("none", [5000.0, 5000.0, 5000.0]),  # not a shape the policy chooses among
    ]

    margins = bench_e2e.policy_round_margins(rows)

    # round 1: narrow's 2900 is the best fixed; round 2: chain's 3000; round 3: narrow's 3200
    assert margins == {
        "mixed": [
            pytest.approx(3000 / 2900),
            pytest.approx(2900 / 3000),
            pytest.approx(3300 / 3200),
        ]
    }
    bench_e2e.print_policy_ratios(rows)
    assert (
        "  bs mixed [1.03 0.97 1.03] median 1.03, 2 of 3 above 1"
        in capsys.readouterr().out
    )


def test_policy_ratios_compare_with_no_speculation_and_the_best_fixed_shape():
    rows = [
        row("none", 1, 100.0),
        row("tree", 1, 180.0),
        row("chain", 1, 150.0),
        row("tree-v1", 1, 400.0),  # spec v1: not a shape the policy runs
        row("tree@flashinfer", 1, 500.0),  # another backend: neither
        row("chain-upstream-tile", 1, 600.0),  # kernel A/Bs: not shapes
        row("tree-whole-prefix", 1, 700.0),
        row("chain-exact-lens", 1, 800.0),
        row("policy", 1, 171.0),
        row("none", "mixed", 1000.0),
        row("chain", "mixed", 1100.0),
        row("policy", "mixed", 1210.0),
        row("policy", 64, 900.0),  # nothing else measured at bs 64
    ]

    ratios = bench_e2e.policy_ratios(rows)

    assert ratios[1] == (pytest.approx(1.71), pytest.approx(0.95), "tree")
    assert ratios["mixed"] == (pytest.approx(1.21), pytest.approx(1.1), "chain")
    assert ratios[64] == (None, None, None)


def test_with_three_runs_or_more_medians_are_compared_too(capsys):
    """Engines' runs spread by a third on a host-bound target: the best of four fixed engines'
    best runs stands above the policy's on noise alone."""

    def runs(config, *tok_per_s):
        return row(config, 16, max(tok_per_s)) | {"tok_per_s_repeats": list(tok_per_s)}

    rows = [
        runs("none", 80.0, 82.0, 81.0),
        runs("chain", 100.0, 101.0, 99.0),
        runs("narrow", 96.0, 135.0, 97.0),  # one lucky run
        runs("policy", 100.0, 102.0, 98.0),
    ]
    assert bench_e2e.policy_ratios(rows)[16][1:] == (pytest.approx(102 / 135), "narrow")
    assert bench_e2e.policy_ratios(rows, statistic=bench_e2e.median_run)[16] == (
        pytest.approx(100 / 81),
        pytest.approx(100 / 100),
        "chain",
    )
    bench_e2e.print_policy_ratios(rows)
    out = capsys.readouterr().out
    assert "policy, median runs" in out and "1.00x chain" in out
    assert "0.76x narrow" in out


def test_prompts_take_their_lengths_from_prompt_len(monkeypatch):
    monkeypatch.setattr(bench_e2e, "PROMPT_LEN", [1000, 1010])
    long = bench_e2e.prompts(4, 32000, seed=4)
    assert len(long) == 4 and all(1000 <= len(p) <= 1010 for p in long)
    assert all(0 <= t < 32000 for p in long for t in p)
    monkeypatch.setattr(bench_e2e, "PROMPT_LEN", [8, 64])
    assert all(8 <= len(p) <= 64 for p in bench_e2e.prompts(16, 100, seed=1))


def test_every_greedy_cell_is_checked_against_the_targets_table():
    """Token 0 -> 1 -> 2 -> 0 ...: a run that follows the table diverges nowhere; one
    request off the table is counted, and the summary names the cell."""
    successor = [1, 2, 0]
    prompts = [[2], [0, 1]]
    good = eng.GreedyRun(
        output_ids=[[0, 1, 2], [2, 0, 1]], seconds=1.0, completion_tokens=6
    )
    bad = eng.GreedyRun(
        output_ids=[[0, 1, 2], [2, 1, 1]], seconds=1.0, completion_tokens=6
    )

    assert bench_e2e.diverged_requests(good, prompts, successor, 3) == 0
    assert bench_e2e.diverged_requests(bad, prompts, successor, 3) == 1
    assert bench_e2e.diverged_requests(bad, prompts, None, 3) is None

    rows = [
        {"config": "none", "bs": 2, "diverged": 0},
        {"config": "chain", "bs": 2, "diverged": 0},
        {"config": "old", "bs": 2},  # a row from a run without the check
    ]
    assert bench_e2e.identity_line(rows) == (
        "token identity: all 2 cells match the target's greedy table"
    )
    rows.append({"config": "tree", "bs": 2, "diverged": 1})
    assert bench_e2e.identity_line(rows) == (
        "token identity: DIVERGED in tree bs 2 (1 requests)"
    )


def test_host_load_line_names_the_configs_that_ran_on_a_busy_host():
    rows = [
        {"config": "none", "bs": 1, "host_load": 3.0},
        {"config": "chain", "bs": 1, "host_load": 40.5},
        {"config": "chain", "bs": 4, "host_load": 40.5},
        {"config": "tree", "bs": 1},  # rows of an older run: no load recorded
    ]
    assert bench_e2e.host_load_line(rows, cpus=64) == (
        "host load: over 32 (half of 64 cores) while chain ran (40.5)"
    )
    assert bench_e2e.host_load_line(rows[:1], cpus=64) is None


def test_decode_rate_leaves_out_the_first_token_run():
    run = eng.GreedyRun(output_ids=[], seconds=1.3, completion_tokens=4 * 128)
    first = eng.GreedyRun(output_ids=[], seconds=0.1, completion_tokens=4)

    assert bench_e2e.decode_tok_per_s(run, first) == pytest.approx(4 * 127 / 1.2)


def test_the_first_token_time_is_printed_per_row(capsys):
    rows = [
        {"config": "none", "bs": 1, "tok_per_s": 160.0, "first_token_ms": 18.61},
        dict(config="chain", bs=1, tok_per_s=300.0, accept_length=2.5)
        | {"first_token_ms": 33.84},
        dict(config="chain", bs="mixed", tok_per_s=3300.0, accept_length=2.5),
    ]

    bench_e2e.print_spec_efficiency(rows)

    out = capsys.readouterr().out
    assert "  chain bs 1: 0.750\n" in out
    assert out.endswith("ms:\n  none bs 1: 18.6\n  chain bs 1: 33.8\n")


def test_spec_efficiency_against_no_speculation_at_each_batch_size():
    rows = [
        {"config": "none", "bs": 1, "tok_per_s": 160.0, "decode_tok_per_s": 170.0},
        {"config": "none", "bs": 4, "tok_per_s": 640.0},
        {"config": "none", "bs": "mixed", "tok_per_s": 3000.0},
        dict(config="chain", bs=1, tok_per_s=300.0, accept_length=2.5),
        dict(config="chain", bs=1, tok_per_s=300.0, accept_length=2.5)
        | {"config": "tree", "decode_tok_per_s": 340.0},
        dict(config="tree", bs=4, tok_per_s=1280.0, accept_length=3.2),
        dict(config="tree", bs=16, tok_per_s=4000.0, accept_length=3.2),  # no none
        dict(config="policy", bs=1, tok_per_s=310.0, accept_length=2.6),
        dict(config="chain", bs="mixed", tok_per_s=3300.0, accept_length=2.5),
    ]

    assert bench_e2e.spec_efficiency(rows) == {
        ("chain", 1): pytest.approx(0.75),
        ("tree", 1): pytest.approx(0.75),
        ("tree", 4): pytest.approx(0.625),
    }
    assert bench_e2e.spec_efficiency(rows, "decode_tok_per_s") == {
        ("tree", 1): pytest.approx(340 / (170 * 2.5)),
    }


@pytest.fixture
def engine_without_a_gpu(monkeypatch):
    """measure()'s engine and runs faked: an engine that starts at once and runs each batch
    in one second, on a host of two CPUs, the second at 0.6 of the first's speed."""
    import contextlib

    monkeypatch.setattr(
        bench_e2e.vcpu_speed, "speed_map", lambda cpus=None: {0: 1.0, 1: 0.6}
    )

    @contextlib.contextmanager
    def fake_engine(**kwargs):
        yield object()

    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    monkeypatch.setattr(bench_e2e.eng, "engine", fake_engine)

    def one_second_run(batch, n):
        return eng.GreedyRun(
            output_ids=[[0] * n] * len(batch), seconds=1.0, completion_tokens=n
        )

    monkeypatch.setattr(
        bench_e2e.eng,
        "timed_runs",
        lambda e, batch, n, repeats: [one_second_run(batch, n)] * repeats,
    )
    monkeypatch.setattr(
        bench_e2e.eng, "best_of", lambda e, batch, n, repeats: one_second_run(batch, n)
    )


def test_each_row_records_its_engines_start_up_time(
    engine_without_a_gpu, monkeypatch, capsys
):
    clock = iter([100.0, 187.25])  # before the engine starts, once it is up
    monkeypatch.setattr(bench_e2e.time, "perf_counter", lambda: next(clock))

    rows = bench_e2e.measure(Path("/t"), Path("/d"), "none", [1, 4], 8, 100)

    assert [r["engine_start_s"] for r in rows] == [87.2, 87.2]
    # Then each size's row as it is measured (8 tokens of one request in the fake's second).
    assert capsys.readouterr().out.splitlines() == [
        "none: engine started in 87 s",
        "none bs 1: 8 tok/s, accept 1.00, diverged None",
        "none bs 4: 8 tok/s, accept 1.00, diverged None",
    ]


def test_freeze_gc_freezes_each_engine_once_it_is_up_and_rows_say_so(
    engine_without_a_gpu, monkeypatch
):
    import contextlib

    frozen = []

    class Engine:
        def freeze_gc(self):
            frozen.append(True)

    @contextlib.contextmanager
    def engine(**kwargs):
        yield Engine()

    monkeypatch.setattr(bench_e2e.eng, "engine", engine)

    rows = bench_e2e.measure(
        Path("/t"), Path("/d"), "chain", [1, 4], 8, 100, freeze_gc=True
    )
    unfrozen = bench_e2e.measure(Path("/t"), Path("/d"), "chain", [1], 8, 100)

    assert frozen == [True]
    assert [r["gc_frozen"] for r in rows + unfrozen] == [True, True, False]


def test_each_row_records_its_schedulers_cpu_use_over_its_timed_runs(
    engine_without_a_gpu, monkeypatch, capsys
):
    from specpatch.testing import scheduler_host

    schedulers = ["the engine's scheduler"]
    monkeypatch.setattr(scheduler_host, "scheduler_processes", lambda: schedulers)
    # Totals read before and after each row's timed runs (not its first-token runs).
    totals = iter(
        [
            scheduler_host.HostUsage(cpu_s=10.0, preemptions=5, wall_s=100.0, waits=7),
            scheduler_host.HostUsage(
                cpu_s=11.9, preemptions=25, wall_s=102.0, waits=17
            ),
            scheduler_host.HostUsage(
                cpu_s=20.0, preemptions=30, wall_s=110.0, waits=100
            ),
            scheduler_host.HostUsage(
                cpu_s=21.0, preemptions=30, wall_s=112.0, waits=3100
            ),
        ]
    )

    def snapshot(procs):
        assert procs is schedulers
        return next(totals)

    monkeypatch.setattr(scheduler_host, "snapshot", snapshot)
    monkeypatch.setattr(scheduler_host, "cpus_of", lambda procs: [1])

    rows = bench_e2e.measure(Path("/t"), Path("/d"), "chain", [1, 4], 8, 100)
    capsys.readouterr()
    bench_e2e.print_scheduler_use(rows)

    assert [
        (
            r["scheduler_busy"],
            r["scheduler_preempted_per_s"],
            r["scheduler_waits_per_s"],
        )
        for r in rows
    ] == [(0.95, 10.0, 5), (0.5, 0.0, 1500)]
    assert [(r["scheduler_cpus"], r["scheduler_cpu_speed"]) for r in rows] == [
        ([1], 0.6),
        ([1], 0.6),
    ]
    assert capsys.readouterr().out == (
        "scheduler CPU seconds per second / involuntary switches per second"
        " / voluntary switches per second:\n"
        "  chain bs 1: 0.95 / 10.0 / 5 | cpu [1], speed 0.60 before start\n"
        "  chain bs 4: 0.50 / 0.0 / 1500 | cpu [1], speed 0.60 before start\n"
    )


def test_a_tree_with_another_backends_verify_runs_sglangs_hybrid_backend(monkeypatch):
    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    monkeypatch.setattr(bench_e2e, "CONFIGS", dict(bench_e2e.CONFIGS))
    bench_e2e.set_tree_shape(16, 3, 32)

    kwargs = bench_e2e.engine_settings(
        Path("/t"), Path("/d"), "tree-triton-verify@fa3", [1, 4], "triton"
    )

    # decode steps (the draft's) on FA3; target verify and draft extend on triton
    assert (kwargs["attention_backend"], kwargs["prefill_attention_backend"]) == (
        "fa3",
        "triton",
    )
    assert kwargs["speculative_eagle_topk"] == 16
    assert kwargs["speculative_num_draft_tokens"] == 32
    assert "prefill_attention_backend" not in bench_e2e.engine_settings(
        Path("/t"), Path("/d"), "tree@fa3", [1, 4], "triton"
    )
    # not a shape the policy chooses among, nor a row that prices one
    assert not bench_e2e.is_fixed_shape_like("tree-triton-verify@fa3", "policy@fa3")
    row = {"config": "tree-triton-verify", "bs": 1, "tok_per_s": 1.0}
    assert list(bench_e2e.fixed_shape_rows([row], "triton")) == []


def test_none_v2_runs_a_spec_v2_engine_whose_policy_takes_only_none_steps(monkeypatch):
    import json

    from sglang.srt.speculative import shape_runtime
    from sglang.srt.speculative.shape_policy import NONE, ShapePolicy, StepCostTable

    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    kwargs = bench_e2e.engine_settings(
        Path("/t"), Path("/d"), "none-v2", [1, 4, 64], "triton"
    )
    assert kwargs["speculative_adaptive"] and kwargs["speculative_eagle_topk"] == 16
    path = kwargs["speculative_adaptive_config"]
    assert json.loads(Path(path).read_text()) == bench_e2e.NONE_V2_POLICY
    # The config as the server reads it: past the switch's patience (the engine's first few
    # decode steps run the flags' tree), `none` at every batch size, nothing probing the tree.
    config = shape_runtime.read_shape_policy(path)
    costs = StepCostTable(config.step_costs, config.policy.ema_alpha)
    policy = ShapePolicy(config.policy, costs, config.policy.shapes[0])
    chosen = [policy.choose(bs) for bs in [1, 4, 64] * 400 + [2, 48, 128] * 400]
    first_none = chosen.index(NONE)
    assert first_none <= config.policy.patience + 1
    assert set(chosen[first_none:]) == {NONE}
    # neither a fixed shape nor a row that prices one, nor a spec efficiency
    assert not bench_e2e.is_fixed_shape_like("none-v2", "policy")
    row = dict(config="none-v2", bs=4, tok_per_s=1.0, accept_length=1.0)
    assert list(bench_e2e.fixed_shape_rows([row], "triton")) == []
    none = {"config": "none", "bs": 4, "tok_per_s": 1.0}
    assert bench_e2e.spec_efficiency([none, row]) == {}


def test_policy_configs_are_found_by_name_and_backend():
    names = ["none", "policy@fa3", "chain", "policy-period"]
    assert bench_e2e.policy_configs(names, "triton") == ["policy@fa3", "policy-period"]
    assert bench_e2e.policy_configs(["tree", "tree-v1@fa3"], "triton") == []


def test_skipping_the_warm_up_engine_is_refused_with_a_policy_config(monkeypatch):
    def no_models(*args):
        raise AssertionError("refused before the models are made")

    monkeypatch.setattr(bench_e2e, "ensure_pair", no_models)
    argv = ["bench_e2e.py", "--no-warm-up-engine", "--configs", "chain,policy"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        bench_e2e.main()
    assert exit_info.value.code == 2  # argparse's usage error


def test_side_by_side_policy_runs_without_the_warm_up_engine(
    bench_without_models, monkeypatch
):
    started = []
    monkeypatch.setattr(
        bench_e2e, "warm_jit_caches", lambda *a: started.append("warm-up")
    )

    def measure_side_by_side(target, draft, names, *args, **kwargs):
        started.extend(names)
        row = {"config": "chain", "bs": 1, "tok_per_s": 100.0, "accept_length": 1.0}
        return [row, {**row, "config": "policy"}]

    monkeypatch.setattr(bench_e2e, "measure_side_by_side", measure_side_by_side)
    argv = ["bench_e2e.py", "--configs", "chain,policy", "--batch-sizes", "1"]
    argv += ["--side-by-side", "--no-warm-up-engine"]
    monkeypatch.setattr(sys, "argv", argv)
    bench_e2e.main()
    assert started == ["chain", "policy"]


def test_skipping_the_warm_up_engine_starts_only_the_measured_ones(
    bench_without_models, monkeypatch
):
    started = []
    monkeypatch.setattr(
        bench_e2e, "warm_jit_caches", lambda *a: started.append("warm-up")
    )

    def measure(target, draft, name, batch_sizes, *args, **kwargs):
        started.append(name)
        return [{"config": name, "bs": 1, "tok_per_s": 100.0, "accept_length": 1.0}]

    monkeypatch.setattr(bench_e2e, "measure", measure)
    argv = ["bench_e2e.py", "--configs", "none,chain", "--batch-sizes", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--no-warm-up-engine"])
    bench_e2e.main()
    assert started == ["none", "chain"]
    started.clear()
    monkeypatch.setattr(sys, "argv", argv)
    bench_e2e.main()
    assert started == ["warm-up", "none", "chain"]


def test_spread_lines_name_cells_whose_runs_or_engines_disagree():
    rows = [
        # steady within its engine, 40 % apart between engines: the engine, not the config
        {
            "config": "tree@fa3:16",
            "bs": 1,
            "tok_per_s_repeats": [640.0, 648.0, 645.0],
            "tok_per_s_per_round": [648.0, 1010.0],
        },
        # one slow run of three in one engine
        {"config": "tree@fa3", "bs": 4, "tok_per_s_repeats": [3300.0, 2700.0, 3280.0]},
        # within 10 %: nothing to say
        {"config": "tree@fa3", "bs": 1, "tok_per_s_repeats": [950.0, 940.0, 957.0]},
        # one engine, one run: nothing to compare
        {"config": "none", "bs": 1, "tok_per_s_repeats": [592.0]},
    ]

    assert bench_e2e.spread_lines(rows) == [
        "  tree@fa3:16 bs 1, engines: 648 / 1010",
        "  tree@fa3 bs 4, runs: 3300 / 2700 / 3280",
    ]


def test_turn_ratios_pair_the_runs_of_each_side_by_side_round():
    side = ["policy", "chain"]
    rows = [
        {
            "config": "policy",
            "bs": "mixed",
            "side_by_side": side,
            "tok_per_s_repeats": [3000.0, 2700.0, 3300.0],
        },
        {
            "config": "chain",
            "bs": "mixed",
            "side_by_side": side,
            "tok_per_s_repeats": [2500.0, 3000.0, 3000.0],
        },
        # one engine after another: run i of each is not from one round, no pairs
        {"config": "policy", "bs": 1, "tok_per_s_repeats": [500.0, 510.0]},
        {"config": "chain", "bs": 1, "tok_per_s_repeats": [400.0, 410.0]},
    ]

    assert bench_e2e.turn_ratios(rows, "policy", "chain") == {
        "mixed": [pytest.approx(1.2), pytest.approx(0.9), pytest.approx(1.1)]
    }
    # the best runs say 1.10x; the turns say the policy led in two of three
    assert bench_e2e.turn_ratio_line(rows, "policy", "chain") == (
        "policy / chain tok/s, each turn's pair: "
        "bs mixed [1.20 0.90 1.10] median 1.10, 2 of 3 above 1"
    )
    assert bench_e2e.turn_ratio_line(rows, "policy", "none") is None


def test_a_cell_records_every_timed_run_of_its_engine(monkeypatch):
    runs = iter([5.0, 2.0, 4.0])  # seconds of the warm-up, then two timed runs

    def generate(engine, prompts, max_new_tokens):
        return eng.GreedyRun(
            output_ids=[[0] * max_new_tokens], seconds=next(runs), completion_tokens=64
        )

    monkeypatch.setattr(eng, "generate", generate)

    timed = eng.timed_runs(object(), [[1]], 64, repeats=2)

    # the warm-up left out, the timed runs in order
    assert [r.tok_per_s for r in timed] == [32.0, 16.0]


def test_each_row_keeps_its_engines_timed_runs(engine_without_a_gpu):
    rows = bench_e2e.measure(Path("/t"), Path("/d"), "none", [1, 4], 8, 100, repeats=3)

    assert [r["tok_per_s_repeats"] for r in rows] == [[8.0] * 3, [8.0] * 3]


def test_policy_chain_carries_the_set_and_runs_only_the_chain(monkeypatch):
    """policy-chain: the engine's flags and config are the policy's (its set, the set's first
    shape as the flags'), and the policy the server builds from that config runs the chain at
    every batch size once it has switched to it."""
    import json

    from sglang.srt.speculative import shape_runtime
    from sglang.srt.speculative.shape_policy import Shape, ShapePolicy, StepCostTable

    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    # set_policy_shapes rewrites these; the test leaves them as it found them.
    monkeypatch.setattr(bench_e2e, "POLICY_SHAPES", list(bench_e2e.POLICY_SHAPES))
    for name in ("policy", "policy-period", "policy-chain"):
        monkeypatch.setitem(bench_e2e.CONFIGS, name, bench_e2e.CONFIGS[name])
    bench_e2e.set_policy_shapes(["16,3,32", "4,3,8", "1,3,4", "none"])
    kwargs = bench_e2e.engine_settings(
        Path("/t"), Path("/d"), "policy-chain", [1, 48, 64], "triton"
    )
    assert kwargs["speculative_adaptive"] and kwargs["speculative_eagle_topk"] == 16
    path = kwargs["speculative_adaptive_config"]
    assert json.loads(Path(path).read_text())["shapes"] == bench_e2e.POLICY_SHAPES
    config = shape_runtime.read_shape_policy(path)
    assert config.deterministic  # given costs: no step is timed
    costs = StepCostTable(config.step_costs, config.policy.ema_alpha)
    policy = ShapePolicy(config.policy, costs, config.policy.shapes[0])
    chosen = [policy.choose(bs) for bs in [1, 48, 64, 4, 16, 128] * 300]
    assert set(chosen[1:]) == {Shape(1, 3, 4)}, set(chosen)
    assert not bench_e2e.is_fixed_shape_like("policy-chain", "policy")
    assert "trace" not in json.loads(Path(path).read_text())
    # With --policy-trace, its own trace beside the policy's.
    monkeypatch.setattr(bench_e2e, "POLICY_TRACE", ["/tmp/trace.jsonl"])
    traced = bench_e2e.engine_settings(
        Path("/t"), Path("/d"), "policy-chain", [1], "triton"
    )
    given = json.loads(Path(traced["speculative_adaptive_config"]).read_text())
    assert given["trace"] == "/tmp/trace.jsonl.policy-chain"
    assert bench_e2e.NONE_V2_POLICY.get("trace") is None  # the shared dict untouched
    with pytest.raises(ValueError, match="runs the chain"):
        bench_e2e.policy_chain_config(["16,3,32", "none"])


def test_policy_chain_without_the_chain_in_the_set_is_refused(monkeypatch):
    def no_models(*args):
        raise AssertionError("refused before the models are made")

    monkeypatch.setattr(bench_e2e, "ensure_pair", no_models)
    monkeypatch.setattr(bench_e2e, "POLICY_SHAPES", list(bench_e2e.POLICY_SHAPES))
    for name in ("policy", "policy-period", "policy-chain"):
        monkeypatch.setitem(bench_e2e.CONFIGS, name, bench_e2e.CONFIGS[name])
    argv = ["bench_e2e.py", "--configs", "chain,policy-chain"]
    argv += ["--policy-shapes", "16,3,32 none", "--side-by-side"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        bench_e2e.main()
    assert exit_info.value.code == 2  # argparse's usage error


def test_a_stair_load_holds_each_phases_batch_for_its_requests(monkeypatch):
    monkeypatch.setattr(bench_e2e.eng, "pool_tokens_for", lambda target: 1 << 16)
    stair = bench_e2e.parse_load("1x2,4x8,1x1")
    assert isinstance(stair, bench_e2e.StairLoad)
    assert stair.phases == ((1, 2), (4, 8), (1, 1))
    assert (stair.total_requests, stair.most_in_flight, stair.label) == (
        11,
        4,
        "1x2,4x8,1x1",
    )
    assert stair.tokens(128) == [128] * 11
    kwargs = bench_e2e.engine_settings(
        Path("/t"), Path("/d"), "tree", [1], "triton", stair
    )
    # At most 4 in flight: no larger batch to run or to capture.
    assert kwargs["max_running_requests"] == 4
    assert isinstance(bench_e2e.parse_load("64:1.5"), bench_e2e.MixedLoad)


def test_a_stair_load_sends_each_request_at_its_phases_level(monkeypatch):
    seen = {}

    def concurrency_generate(e, prompts, tokens, levels):
        seen.update(engine=e, prompts=len(prompts), tokens=tokens, levels=levels)
        return "run"

    monkeypatch.setattr(bench_e2e.eng, "concurrency_generate", concurrency_generate)
    stair = bench_e2e.StairLoad.parse("1x2,3x3")

    assert stair.generate("e", [[0]] * 5, 16) == "run"
    assert seen == dict(engine="e", prompts=5, tokens=[16] * 5, levels=[1, 1, 3, 3, 3])


@pytest.mark.parametrize("text", ["16", "16x", "x4", "0x4", "4x0", "4x8,", "ax1"])
def test_a_malformed_stair_load_names_the_flag(text):
    with pytest.raises(SystemExit, match="--mixed-load .*LEVELxREQUESTS"):
        bench_e2e.parse_load(text)


def test_live_tokens_of_a_stair_load_cover_its_most_in_flight(monkeypatch):
    monkeypatch.setattr(bench_e2e, "PROMPT_LEN", [8, 64])
    per_request = 64 + bench_e2e.SPEC_SLACK_TOKENS
    stair = bench_e2e.StairLoad.parse("1x8,16x64,1x8")

    assert bench_e2e.live_tokens([1], stair, 512) == 16 * (per_request + 512)
