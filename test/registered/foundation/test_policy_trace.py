"""benchmark/spec/policy_trace.py: a shape policy trace summarised (steps per batch size and
shape, switches, slow steps with the compiles logged beside them)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import policy_trace  # noqa: E402

LINES = [
    {"step": 1, "switch": ["16,3,32", "1,3,4"], "bs": 4},
    {"step": 2, "shape": "1,3,4", "bs": 4, "seconds": 0.003, "accept": 2.5},
    # Logged while step 3 launched: written on the line before step 3's own.
    {
        "step": 3,
        "shape": "1,3,4",
        "bs": 4,
        "seconds": 0.003,
        "compiles": [["assign_req_to_token_pool[bs_upper=4]", 412.0]],
    },
    {"step": 4, "shape": "1,3,4", "bs": 4, "seconds": 0.415},
    {"step": 5, "shape": "1,3,4", "bs": 4, "seconds": None},  # not measured
    {"step": 6, "shape": "4,3,8", "bs": 8, "seconds": 0.05},
]


def test_steps_switches_and_slow_steps_with_their_compiles():
    summary = policy_trace.summarise(LINES, slow_ms=30)

    assert summary.step_seconds == {
        (4, "1,3,4"): [0.003, 0.003, 0.415],
        (8, "4,3,8"): [0.05],
    }
    # Step 5 was not timed: counted, without seconds.
    assert summary.steps == {(4, "1,3,4"): 4, (8, "4,3,8"): 1}
    assert summary.switches == [(1, "16,3,32", "1,3,4", 4)]
    (slow, other) = summary.slow_steps
    assert slow[:3] == (4, 4, "1,3,4")
    assert slow[3] == pytest.approx(415.0)
    assert slow[4] == [["assign_req_to_token_pool[bs_upper=4]", 412.0]]
    assert other[:3] == (6, 8, "4,3,8") and other[4] == []
    assert summary.compiles == [(3, "assign_req_to_token_pool[bs_upper=4]", 412.0)]


def test_gzipped_traces_are_read(tmp_path, capsys):
    path = tmp_path / "trace.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(line) + "\n" for line in LINES))

    policy_trace.print_summary(
        policy_trace.summarise(policy_trace.read_lines(path)), min_steps=1
    )

    out = capsys.readouterr().out
    assert "bs   4    1,3,4:    4 steps,    3 timed, median    3.00" in out
    assert "step 4: bs 4 1,3,4 415.0 ms | compiled: assign_req_to_token_pool" in out
    assert "Triton compiles logged: 1, 412 ms in all" in out


def test_periods_are_host_intervals_between_consecutive_steps_of_one_cell(capsys):
    lines = [
        {"step": 1, "shape": "1,3,4", "bs": 4, "seconds": 0.003, "t": 10.000},
        {"step": 2, "shape": "1,3,4", "bs": 4, "seconds": 0.003, "t": 10.005},
        {"step": 3, "shape": "1,3,4", "bs": 4, "seconds": 0.003, "t": 10.011},
        # A prefill came between (no decode step 4 here): not a period.
        {"step": 5, "shape": "1,3,4", "bs": 4, "seconds": 0.003, "t": 10.060},
        {
            "step": 6,
            "shape": "1,3,4",
            "bs": 5,
            "seconds": 0.003,
            "t": 10.066,
        },  # bs grew
        {"step": 7, "switch": ["1,3,4", "4,3,8"], "bs": 5},
        {"step": 7, "shape": "4,3,8", "bs": 5, "seconds": 0.004, "t": 10.074},
        {"step": 8, "shape": "4,3,8", "bs": 5, "seconds": 0.004, "t": 10.081},
        {"step": 9, "shape": "4,3,8", "bs": 5, "seconds": 0.004},  # an older trace line
    ]

    summary = policy_trace.summarise(lines)

    assert summary.periods.keys() == {(4, "1,3,4"), (5, "4,3,8")}
    assert summary.periods[4, "1,3,4"] == [pytest.approx(0.005), pytest.approx(0.006)]
    assert summary.periods[5, "4,3,8"] == [pytest.approx(0.007)]
    policy_trace.print_summary(summary, min_steps=1)
    out = capsys.readouterr().out
    assert (
        "bs   4    1,3,4:    4 steps,    4 timed, median    3.00, max      3.0, "
        "period    5.50" in out
    )
    assert (
        "bs   5    1,3,4:    1 steps,    1 timed, median    3.00, max      3.0\n" in out
    )


def test_untimed_steps_count_and_keep_their_periods(capsys):
    """Past a confirmed price the policy times one step in time_every: the others' lines
    have "seconds": null, and still count as steps and give periods."""
    lines = [
        {"step": s, "shape": "1,3,4", "bs": 16, "seconds": None, "t": 1 + s * 0.004}
        for s in range(1, 9)
    ]
    lines[3]["seconds"] = 0.003

    policy_trace.print_summary(policy_trace.summarise(lines), min_steps=1)

    out = capsys.readouterr().out
    assert (
        "bs  16    1,3,4:    8 steps,    1 timed, median    3.00, max      3.0, "
        "period    4.00" in out
    )
    assert "steps by shape: 1,3,4 8" in out


REPLAY_LINES = [
    {"step": 1, "shape": "1,3,4", "bs": 3, "seconds": 0.003},
    # A batch drained from 3 to 1: the chain's first step at bs 1, slow, is provisional.
    {"step": 2, "shape": "1,3,4", "bs": 1, "seconds": 0.009},
    {"step": 3, "shape": "1,3,4", "bs": 2, "seconds": 0.003},
    {"step": 4, "shape": "1,3,4", "bs": 1, "seconds": 0.0025},  # resized again
    {"step": 5, "switch": ["1,3,4", "4,3,8"], "bs": 1},
    {"step": 5, "shape": "4,3,8", "bs": 1, "seconds": 0.050, "after_switch": True},
    {"step": 6, "shape": "4,3,8", "bs": 1, "seconds": 0.003},
]


def test_prices_replay_the_cost_table_before_a_given_result():
    """--prices-at: the measured steps before the given one, in order, through sglang's
    StepCostTable. A first step's price is provisional ("*") and the next step at its size
    replaces it; a switch's first step is no price."""
    prices = policy_trace.replay_prices(REPLAY_LINES, [2, 6], [1, 3])

    assert prices[2]["1,3,4"][3] == (pytest.approx(0.003), True)
    assert prices[6]["1,3,4"][1] == (pytest.approx(0.0025), False)
    narrow_at_1, provisional = prices[6]["4,3,8"][1]
    assert not provisional and narrow_at_1 < 0.010  # not the switch's 50 ms


def test_prices_replay_the_resized_near_rule_that_kept_a_first_step(capsys):
    """Session 62's reverted rule: a step after a resize is no price where the shape has a
    point within a factor 2, its own provisional first step included, so the slow first
    step at bs 1 stays the chain's price there."""
    prices = policy_trace.replay_prices(REPLAY_LINES, [6], [1], resize_rule="any")
    assert prices[6]["1,3,4"][1] == (pytest.approx(0.009), True)
    policy_trace.print_prices(prices)
    assert "1,3,4: bs 1 9.00*" in capsys.readouterr().out


DRAIN_LINES = [
    # The chain steady at bs 48 (its second step confirms the price), then a batch draining
    # through bs 46 at the end of its tokens, and a step at bs 20, far from any price.
    {"step": 1, "shape": "1,3,4", "bs": 48, "seconds": 0.004},
    {"step": 2, "shape": "1,3,4", "bs": 48, "seconds": 0.004},
    {"step": 3, "shape": "1,3,4", "bs": 46, "seconds": 0.006},
    {"step": 4, "shape": "1,3,4", "bs": 20, "seconds": 0.005},
    {"step": 5, "shape": "1,3,4", "bs": 20, "seconds": 0.005},
]


def test_prices_replay_the_controllers_resize_rule_by_default():
    """The controller's rule (b40df68): a resized step near a confirmed price is no price, so
    the draining step at bs 46 leaves the table as it was; at bs 20, with no confirmed price
    within a factor 2, the resized step is priced. Without a rule the drain's step sets a
    point at bs 46 (a first step's, an upper bound there)."""
    confirmed = policy_trace.replay_prices(DRAIN_LINES, [3, 4, 5], [46, 20])
    # bs 46 is priced from bs 48's point, before the draining step and after it alike.
    assert confirmed[4]["1,3,4"][46] == confirmed[3]["1,3,4"][46]
    assert confirmed[4]["1,3,4"][46][0] < 0.0045
    # bs 20 has a point of its own, the resized step's (a first step's, so provisional).
    assert confirmed[5]["1,3,4"][20][1] is True
    assert confirmed[4]["1,3,4"][20][1] is False
    unruled = policy_trace.replay_prices(DRAIN_LINES, [4], [46], resize_rule="none")
    assert unruled[4]["1,3,4"][46][1] is True
    assert confirmed[4]["1,3,4"][46][1] is False
    with pytest.raises(ValueError, match="resize_rule"):
        policy_trace.replay_prices(DRAIN_LINES, [4], [46], resize_rule="some")


def _run_lines(first_step, bs, shape, spans, t0, period, accept=2.5):
    """A run: a batch of `bs` for len(spans) steps, then one step at bs 1 (all requests but one
    left), a result every `period` seconds."""
    lines = []
    for i, span in enumerate([*spans, spans[-1]]):
        lines.append(
            {
                "step": first_step + i,
                "shape": shape,
                "bs": bs if i < len(spans) else 1,
                "seconds": span,
                "accept": accept,
                "t": t0 + i * period,
            }
        )
    return lines


def test_runs_split_where_the_batch_jumps_and_show_span_quarters(capsys):
    """--runs: a run starts where the batch size jumps up; its quarters are the medians of
    its main shape's spans at full size, in order; its rate the tokens committed after its
    first result over the host's time to its last."""
    quick = _run_lines(1, 48, "1,3,4", [0.003] * 4 + [0.004] * 4, t0=0.0, period=0.004)
    slow = _run_lines(10, 48, "1,3,4", [0.005] * 8, t0=1.0, period=0.005)
    switch = {"step": 19, "switch": ["1,3,4", "4,3,8"], "bs": 4}
    small = _run_lines(19, 4, "4,3,8", [0.002] * 8, t0=2.0, period=0.002, accept=3.0)
    runs = policy_trace.split_runs(quick + slow + [switch] + small)

    assert [(r.first_step, r.bs, len(r.full), len(r.lines)) for r in runs] == [
        (1, 48, 8, 9),
        (10, 48, 8, 9),
        (19, 4, 8, 9),
    ]
    assert runs[0].span_quarters() == pytest.approx([0.003, 0.003, 0.004, 0.004])
    assert runs[1].span_quarters() == pytest.approx([0.005] * 4)
    # 7 steps at bs 48 and one at 1 after the first result, 2.5 tokens each, in 8 periods.
    assert runs[0].tokens_per_second() == pytest.approx((7 * 48 + 1) * 2.5 / 0.032)
    policy_trace.print_runs(runs)
    out = capsys.readouterr().out
    assert "step      1: bs  48,    8 of    9 steps" in out, out
    assert "1,3,4 3.00 / 3.00 / 4.00 / 4.00" in out, out
    assert "4,3,8 8 | 4,3,8 2.00 / 2.00 / 2.00 / 2.00" in out, out


def mixed_load_lines() -> list[dict]:
    """Two runs of a mixed load 10 s apart on the host's clock: the first grows to bs 6 on
    the narrow tree, switches to the chain (a 0.5-s first step: a compile, not a new run)
    and drains to bs 1 on the wide tree; the second stays on the narrow tree at bs 2."""
    lines, t, step = [], 100.0, 0

    def result(shape, bs, gap=0.004, accept=2.0):
        nonlocal t, step
        t, step = t + gap, step + 1
        lines.append({"step": step, "shape": shape, "bs": bs, "accept": accept, "t": t})

    for bs in (2, 4, 6):
        result("4,3,8", bs)
    lines.append({"step": step + 1, "switch": ["4,3,8", "1,3,4"], "bs": 6})
    result("1,3,4", 6, gap=0.5)
    result("1,3,4", 5)
    result("1,3,4", 4)
    lines.append({"step": step + 1, "switch": ["1,3,4", "16,3,32"], "bs": 4})
    for bs in (4, 2, 1):
        result("16,3,32", bs)
    result("4,3,8", 2, gap=10.0)
    result("4,3,8", 2)
    return lines


def test_loads_are_cut_at_the_host_clocks_long_idle_not_at_a_stall():
    first, second = policy_trace.split_loads(mixed_load_lines(), gap_s=2.0)

    assert (first.max_bs, first.switches, len(first.results)) == (6, 2, 9)
    assert [(s.shape, s.steps, s.first_bs, s.last_bs) for s in first.stretches()] == [
        ("4,3,8", 3, 2, 6),
        ("1,3,4", 3, 6, 4),
        ("16,3,32", 3, 4, 1),
    ]
    # Eight results after the first, 2 tokens a request each, over 0.528 s.
    committed = 2.0 * (4 + 6 + 6 + 5 + 4 + 4 + 2 + 1)
    assert first.seconds == pytest.approx(0.528)
    assert first.tokens_per_second() == pytest.approx(committed / 0.528)
    assert (second.max_bs, second.switches, second.seconds) == (
        2,
        0,
        pytest.approx(0.004),
    )
    # A gap shorter than the 0.5-s stall keeps it inside one run no longer.
    assert len(policy_trace.split_loads(mixed_load_lines(), gap_s=0.4)) == 3


def test_loads_printed_fold_short_stretches(capsys):
    policy_trace.print_loads(policy_trace.split_loads(mixed_load_lines()), min_steps=3)

    out = capsys.readouterr().out
    assert "load 0: bs <= 6, 0.53 s, 121 tok/s, 2 switches, " in out
    assert "1,3,4 x3    bs   6 -> 4   to 0.52 s" in out
    assert "load 1: bs <= 2, 0.00 s, " in out
    assert "(and 2 steps in stretches under 3)" in out


def test_loads_need_the_host_clock():
    lines = [{"step": 1, "shape": "1,3,4", "bs": 4, "accept": 2.0}]
    with pytest.raises(ValueError, match="step 1's result has no host clock"):
        policy_trace.split_loads(lines)
