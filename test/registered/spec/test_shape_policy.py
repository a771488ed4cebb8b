"""speculative/shape_policy.py: the per-step shape choice on given step costs and accept
lengths (docs/shape-policy.md)."""

from __future__ import annotations

import random

import pytest

from sglang.srt.speculative.context_slope import ContextSlope
from sglang.srt.speculative.shape_policy import (
    GUESS_DRAWS,
    NONE,
    PolicyConfig,
    Shape,
    ShapePolicy,
    StepCostTable,
    prior_step_cost,
)

WIDE = Shape(16, 3, 32)
NARROW = Shape(4, 3, 8)
CHAIN = Shape(1, 3, 4)

# Step seconds by batch size, shaped like the 1.21B preset's: the wide tree's verify grows with
# bs * 32 tokens, no speculation's step barely grows.
COSTS = {
    WIDE: {1: 4.0e-3, 16: 8.0e-3, 48: 20.0e-3},
    NARROW: {1: 3.6e-3, 16: 5.0e-3, 48: 9.0e-3},
    CHAIN: {1: 3.4e-3, 16: 3.9e-3, 48: 6.5e-3},
    NONE: {1: 1.6e-3, 16: 1.9e-3, 48: 2.2e-3},
}
ACCEPT = {WIDE: 3.3, NARROW: 2.9, CHAIN: 2.4}


def make_policy(initial=WIDE, shapes=(WIDE, NARROW, CHAIN, NONE), **config):
    cfg = PolicyConfig(shapes=tuple(shapes), **config)
    costs = StepCostTable({s: COSTS[s] for s in shapes}, cfg.ema_alpha)
    return ShapePolicy(cfg, costs, initial, initial_accept_lengths=ACCEPT)


def run(policy, bs, steps):
    return [policy.choose(bs) for _ in range(steps)]


# ----------------------------------------------------------------------------- shapes, config


def test_shapes_parse_and_label():
    assert Shape.parse("16,3,32") == WIDE
    assert Shape.parse(" None ") is NONE
    assert [s.label for s in (WIDE, NONE)] == ["16,3,32", "none"]
    assert not NONE.speculates and CHAIN.speculates
    with pytest.raises(
        ValueError, match="'16,3' is not TOPK,STEPS,DRAFT_TOKENS or none"
    ):
        Shape.parse("16,3")


def test_config_reads_shapes_and_knobs():
    cfg = PolicyConfig.from_dict(
        {"shapes": ["16,3,32", "none"], "margin": 0.1, "patience": 3}
    )
    assert cfg.shapes == (WIDE, NONE)
    assert (cfg.margin, cfg.patience, cfg.probe_interval) == (0.1, 3, 512)
    assert cfg.decisive_margin == 0.25
    cfg = PolicyConfig.from_dict({"shapes": ["16,3,32", "none"], "decisive_margin": 1})
    assert cfg.decisive_margin == 1.0 and isinstance(cfg.decisive_margin, float)


@pytest.mark.parametrize(
    "raw,message",
    [
        ({}, '"shapes" must be a list of strings'),
        ({"shapes": "16,3,32"}, '"shapes" must be a list of strings'),
        ({"shapes": ["16,3,32"]}, "at least two shapes"),
        ({"shapes": ["none", "NONE"]}, "lists a shape twice"),
        ({"shapes": ["none", "1,0,1"]}, "lists a shape twice"),
        ({"shapes": ["16,3,32", "16,3,32"]}, "lists a shape twice"),
        ({"shapes": ["16,3,32", "x"]}, "'x' is not TOPK"),
        ({"shapes": ["16,3,32", "none"], "margin": -0.1}, '"margin" out of range'),
        ({"shapes": ["16,3,32", "none"], "patience": 0}, '"patience" out of range'),
        (
            {"shapes": ["16,3,32", "none"], "margin": 0.3},
            '"decisive_margin" (0.25) is below "margin" (0.3)',
        ),
        (
            {"shapes": ["16,3,32", "none"], "patience": 2.5},
            '"patience" must be an integer',
        ),
        ({"shapes": ["16,3,32", "none"], "ema_alpha": 0}, '"ema_alpha" out of range'),
        (
            {"shapes": ["16,3,32", "none"], "probe_steps": "8"},
            '"probe_steps" must be a number',
        ),
    ],
)
def test_config_refusals_name_the_flag_and_key(raw, message):
    with pytest.raises(ValueError, match="--speculative-adaptive-config") as err:
        PolicyConfig.from_dict(raw)
    assert message in str(err.value)


def test_config_asks_the_server_rules_about_each_speculating_shape():
    seen = []

    def check(shape):
        seen.append(shape)
        if shape.num_draft_tokens > 1024:
            raise ValueError("--speculative-num-draft-tokens 2000 is more than 1024")

    PolicyConfig.from_dict({"shapes": ["16,3,32", "none"]}, check_shape=check)
    assert seen == [WIDE]
    with pytest.raises(ValueError, match="more than 1024"):
        PolicyConfig.from_dict({"shapes": ["64,40,2000", "none"]}, check_shape=check)


def test_the_flags_shape_must_be_in_the_set():
    with pytest.raises(ValueError, match="the flags' own shape 4,3,8 is not in"):
        make_policy(initial=NARROW, shapes=(WIDE, NONE))


# ----------------------------------------------------------------------------- step costs


def test_step_costs_interpolate_and_follow_the_prior_past_the_ends():
    table = StepCostTable({WIDE: COSTS[WIDE]}, ema_alpha=0.5)
    assert table.seconds(WIDE, 16) == 8.0e-3
    assert table.seconds(WIDE, 32) == pytest.approx(14.0e-3)
    # Past the last point: that point, grown as the prior grows from bs 48 to 64.
    grown = prior_step_cost(WIDE, 64) / prior_step_cost(WIDE, 48)
    assert grown > 1.2
    assert table.seconds(WIDE, 64) == pytest.approx(20.0e-3 * grown)
    table.observe(WIDE, 48, 30.0e-3)  # a measured step moves its point halfway
    assert table.seconds(WIDE, 48) == pytest.approx(25.0e-3)
    # A first step at a new size is only an upper bound: the points around it price it lower.
    table.observe(WIDE, 40, 30.0e-3)
    assert table.seconds(WIDE, 40) == pytest.approx(20.75e-3)
    # The second step there sets the point, not averaged.
    table.observe(WIDE, 40, 30.0e-3)
    assert table.seconds(WIDE, 40) == 30.0e-3
    assert table.seconds(WIDE, 44) == pytest.approx(27.5e-3)


def test_an_unmeasured_shape_is_priced_in_the_units_of_the_measured_ones():
    """The prior is in target steps; a first measurement of 8 ms per unit makes every
    unmeasured shape 8 ms per unit too, instead of looking cheaper for not having run.
    """
    table = StepCostTable({}, ema_alpha=0.2)
    assert table.seconds(CHAIN, 1) == prior_step_cost(CHAIN, 1)
    table.observe(WIDE, 1, 8.0e-3 * prior_step_cost(WIDE, 1))
    assert table.seconds(CHAIN, 4) == pytest.approx(8.0e-3 * prior_step_cost(CHAIN, 4))
    assert table.seconds(WIDE, 4) == pytest.approx(
        8.0e-3 * prior_step_cost(WIDE, 4)
    )  # its own point, grown by the prior


def test_a_one_off_slow_step_does_not_set_what_a_shape_costs():
    """The first step of a shape compiles kernels (hundreds of times a warm step): left out
    once the table has points to compare with, and replaced where it set a point."""
    table = StepCostTable({}, ema_alpha=0.2)
    table.observe(WIDE, 1, 1.7)  # the very first step: nothing to compare it with
    table.observe(WIDE, 1, 7.0e-3)  # a warm step replaces a point 200x above it
    assert table.seconds(WIDE, 1) == 7.0e-3
    table.observe(NARROW, 1, 0.36)  # a first step, far above what the table expects
    assert table.seconds(NARROW, 1) < 10e-3
    table.observe(NARROW, 1, 6.5e-3)
    assert table.seconds(NARROW, 1) == 6.5e-3
    # A slow spike among warm steps is left out; the same slowness three times is believed
    # and replaces the point.
    table.observe(NARROW, 1, 0.1)
    assert table.seconds(NARROW, 1) == 6.5e-3
    table.observe(NARROW, 1, 0.1)
    table.observe(NARROW, 1, 0.1)
    assert table.seconds(NARROW, 1) == 0.1  # believed: the new cost, not an average
    # Unmeasured shapes are priced by the median seconds per prior unit of the points (of
    # two points, their mean), which the left-out spikes did not move.
    units = [table.seconds(s, 1) / prior_step_cost(s, 1) for s in (WIDE, NARROW)]
    assert table.seconds(CHAIN, 1) == pytest.approx(
        prior_step_cost(CHAIN, 1) * sum(units) / 2
    )


def test_a_one_off_at_a_batch_size_never_run_again_is_dropped_by_warm_steps_elsewhere():
    """The wide tree's first step, at bs 21 of a growing batch, took 727 ms; warm steps at
    bs 57 and 64 took 52-55 ms, and the tree never ran near bs 21 again. Its bs 21 point must
    not go on pricing the tree at small batch (211 ms at bs 1, where a step takes 6 ms).
    """
    table = StepCostTable({}, ema_alpha=0.2)
    table.observe(WIDE, 21, 0.727)
    table.observe(WIDE, 57, 52.0e-3)
    table.observe(WIDE, 64, 55.0e-3)
    warm_unit = 55.0e-3 / prior_step_cost(WIDE, 64)
    assert table.seconds(WIDE, 1) == pytest.approx(
        52.0e-3 / prior_step_cost(WIDE, 57) * prior_step_cost(WIDE, 1)
    )
    assert table.seconds(WIDE, 21) < 2 * warm_unit * prior_step_cost(WIDE, 21)
    # Unmeasured shapes are priced from the warm points alone.
    assert table.seconds(CHAIN, 1) < 2 * warm_unit * prior_step_cost(CHAIN, 1)
    # Points within ONE_OFF_RATIO of each other per unit all stay: a dearer batch size is
    # what the shape costs there.
    table.observe(NARROW, 1, 6.0e-3)
    dearer = 3.0 * 6.0e-3 / prior_step_cost(NARROW, 1) * prior_step_cost(NARROW, 16)
    table.observe(NARROW, 16, dearer)
    table.observe(NARROW, 16, dearer)
    table.observe(NARROW, 1, 6.0e-3)
    assert table.seconds(NARROW, 16) == pytest.approx(dearer)


def test_first_steps_at_new_batch_sizes_are_one_offs_however_many_in_a_row():
    """A 7.24B policy trace (build 5f69cc8a): the narrow tree's first four steps came on a
    shrinking batch, each the first at its size, each compiling (1.58 s at bs 13, 0.61 s at
    bs 8, 0.15 s at bs 6, 0.26 s at bs 4, against about 7 ms warm). Counted as a streak they
    priced the tree 20x too dear, and it never ran again. They are four one-offs; the same
    slowness at a size the shape has run is still believed after ONE_OFF_STREAK steps.
    """
    table = StepCostTable({}, ema_alpha=0.2)
    for bs, seconds in ((1, 6.3e-3), (16, 6.6e-3), (28, 8.0e-3)):
        table.observe(CHAIN, bs, seconds)
    expected = {bs: table.seconds(NARROW, bs) for bs in (4, 6, 8, 13, 16)}
    for bs, seconds in ((13, 1.575), (8, 0.608), (6, 0.153), (4, 0.262)):
        table.observe(NARROW, bs, seconds)
    assert {bs: table.seconds(NARROW, bs) for bs in expected} == expected
    # Warm steps then set the narrow tree's points ...
    table.observe(NARROW, 4, 7.0e-3)
    assert table.seconds(NARROW, 4) == 7.0e-3
    # ... and a real slowdown at sizes it has run is believed on its third step.
    for bs, believed in ((4, False), (13, False), (8, True)):
        table.observe(NARROW, bs, 0.2)
        assert (table.seconds(NARROW, bs) == 0.2) == believed


def test_a_first_step_under_the_one_off_ratio_is_replaced_by_the_next():
    """A 7.24B policy trace (build 080af71e, bs 1): the narrow tree's first step, its graphs'
    first replay, took 32.9 ms on the device, under 4x what the table expected; the next took
    9.1 ms. Moved by the EMA the point stayed near 28 ms, priced the narrow tree at 3x its cost
    and it never ran again. The second step at a batch size replaces the first's point; later
    steps are smoothed as before."""
    table = StepCostTable({}, ema_alpha=0.2)
    for seconds in (34.9e-3, 8.16e-3, 8.12e-3):
        table.observe(WIDE, 1, seconds)
    table.observe(CHAIN, 1, 11.8e-3)
    assert (
        table.seconds(CHAIN, 1) == 11.8e-3
    )  # believed: 1.6x what the wide tree implies
    table.observe(NARROW, 1, 32.9e-3)  # under ONE_OFF_RATIO x the table: believed
    assert table.seconds(NARROW, 1) == 32.9e-3
    table.observe(NARROW, 1, 9.1e-3)
    assert table.seconds(NARROW, 1) == 9.1e-3
    table.observe(NARROW, 1, 8.6e-3)  # warm steps: the EMA again
    assert table.seconds(NARROW, 1) == pytest.approx(0.8 * 9.1e-3 + 0.2 * 8.6e-3)
    table.observe(CHAIN, 1, 7.6e-3)
    assert table.seconds(CHAIN, 1) == 7.6e-3
    # Given points are not provisional: a step moves them by the EMA.
    given = StepCostTable({NARROW: {1: 9.0e-3}}, ema_alpha=0.2)
    given.observe(NARROW, 1, 8.0e-3)
    assert given.seconds(NARROW, 1) == pytest.approx(0.8 * 9.0e-3 + 0.2 * 8.0e-3)


def test_the_first_believed_step_at_a_size_is_replaced_by_the_next():
    """A 7.24B policy trace (build bc660de8, bs 4): the narrow tree's price probe ran three
    steps, 512 ms (its compiles, left out), 6.92 ms and 5.94 ms. Set by the second and moved
    by the EMA, its point stayed at 6.72 ms, 13 % over the third, and the probe was over: the
    tree stayed priced dear at the size it was probed to price. The first step the table
    believes at a size is provisional like a first step: the next one replaces it."""
    table = StepCostTable({}, ema_alpha=0.2)
    for bs, seconds in ((1, 5.49e-3), (1, 5.5e-3), (4, 5.6e-3), (4, 5.58e-3)):
        table.observe(CHAIN, bs, seconds)
    table.observe(NARROW, 4, 0.512)  # a one-off: left out
    table.observe(NARROW, 4, 6.92e-3)
    assert table.seconds(NARROW, 4) == 6.92e-3
    table.observe(NARROW, 4, 5.94e-3)
    assert table.seconds(NARROW, 4) == 5.94e-3
    table.observe(NARROW, 4, 5.8e-3)  # warm steps: the EMA again
    assert table.seconds(NARROW, 4) == pytest.approx(0.8 * 5.94e-3 + 0.2 * 5.8e-3)


def test_a_probes_dearer_second_step_does_not_price_the_shape():
    """A 1.21B policy trace (build a89db7b0, bs 16, contexts near 240): the narrow tree's
    price probe ran 4.29 ms (its first step after the switch, not timed by the controller),
    3.92 and 4.35; the third replaced the second's provisional point, and at 4.35 against a
    steady 3.4-3.9 the narrow tree lost to the wide tree for a whole run. A provisional point
    confirmed at a near context keeps the cheaper of its two steps; later steps are smoothed
    as before, and a step at a context not near still replaces it."""
    table = StepCostTable({}, ema_alpha=0.2)
    table.observe(NARROW, 16, 3.92e-3, context=237.9)
    assert table.provisional(NARROW, 16)
    table.observe(NARROW, 16, 4.35e-3, context=240.9)
    assert table.confirmed(NARROW, 16)
    assert table.seconds(NARROW, 16) == 3.92e-3
    table.observe(NARROW, 16, 4.0e-3, context=250.0)  # warm steps: the EMA again
    assert table.seconds(NARROW, 16) == pytest.approx(0.8 * 3.92e-3 + 0.2 * 4.0e-3)
    # A dearer second step at a context not near is what the shape costs there.
    far = StepCostTable({}, ema_alpha=0.2)
    far.observe(CHAIN, 16, 3.0e-3, context=100.0)
    far.observe(CHAIN, 16, 4.4e-3, context=900.0)
    assert far.seconds(CHAIN, 16) == 4.4e-3


def host_bound_table_after_a_growing_batch() -> StepCostTable:
    """A 1.21B policy trace (build cd637d58, H200, the policy engine run first): device
    seconds of the chain and the narrow tree on a batch growing 1 -> 48. Each shape's first
    step at a size was slow (the narrow tree 7.85 ms at bs 16 and 8.6 ms at bs 48, about 3.0
    and 4.2 warm); the chain's at bs 16 (5.0 ms) was its only one there, as the batch moved on
    and the policy with it. Host-bound: a warm step grows far less with the batch than the
    prior's verify term says (the chain 2.54 ms at bs 16, 2.78 at bs 48 in the other engine).
    """
    table = StepCostTable({}, ema_alpha=0.2)
    # (shape, bs, the steps there in order); a size's second step confirms its point.
    for shape, bs, steps in (
        (CHAIN, 1, (2.7e-3, 2.7e-3)),
        (CHAIN, 4, (2.4e-3, 2.4e-3)),
        (NARROW, 4, (2.85e-3, 2.85e-3)),
        (CHAIN, 7, (3.1e-3, 3.1e-3)),
        (NARROW, 16, (7.85e-3, 3.0e-3)),
        (CHAIN, 16, (5.0e-3,)),
        (NARROW, 48, (8.6e-3, 4.2e-3)),
    ):
        for seconds in steps:
            table.observe(shape, bs, seconds)
    return table


def test_a_first_step_at_a_size_prices_the_shape_no_dearer_than_its_warm_points():
    """Trusted, the chain's one step at bs 16 priced it at 5.0 ms there and, extrapolated by
    the prior, 7.2 ms at bs 48, against the narrow tree's measured 4.2: the chain never ran at
    bs 16-64 again, and the engine ran the narrow tree below no speculation. A first step is
    an upper bound: the chain's warm points, grown as the narrow tree's measured steps grew,
    price it lower."""
    table = host_bound_table_after_a_growing_batch()
    assert table.seconds(CHAIN, 16) < 3.2e-3
    # At bs 48: from the chain's bs-7 point (3.1 ms), by the prior's growth (x1.63) times
    # the narrow tree's growth against its prior between bs 7 and 48 (x0.68).
    grown = prior_step_cost(CHAIN, 48) / prior_step_cost(CHAIN, 7)
    narrow_unit = {
        bs: seconds / prior_step_cost(NARROW, bs)
        for bs, seconds in ((7, 2.85e-3 + 0.15e-3 * 3 / 12), (48, 4.2e-3))
    }
    drift = narrow_unit[48] / narrow_unit[7]
    assert drift < 0.7
    assert table.seconds(CHAIN, 48) == pytest.approx(3.1e-3 * grown * drift)
    # The narrow tree's own points are confirmed: priced as measured.
    assert table.seconds(NARROW, 16) == 3.0e-3
    assert table.seconds(NARROW, 48) == 4.2e-3
    # A shape's only points being first steps, they are all it has.
    table.observe(WIDE, 48, 20.0e-3)
    assert table.seconds(WIDE, 48) == 20.0e-3


def test_the_policy_tries_the_chain_on_a_batch_that_grew_past_its_warm_points():
    """The same trace through the policy, running the narrow tree at bs 48 (accept lengths
    2.9 and 2.55): the chain scores ahead by more than the margin and takes over after
    patience, where the trusted first step kept the narrow tree for good."""
    cfg = PolicyConfig(shapes=(WIDE, NARROW, CHAIN, NONE))
    policy = ShapePolicy(
        cfg,
        host_bound_table_after_a_growing_batch(),
        NARROW,
        initial_accept_lengths={WIDE: 3.3, NARROW: 2.9, CHAIN: 2.55},
    )
    assert policy.score(CHAIN, 48) > (1 + cfg.margin) * policy.score(NARROW, 48)
    shapes = run(policy, 48, 12)
    assert shapes == [NARROW] * (cfg.patience - 1) + [CHAIN] * (13 - cfg.patience)


def test_the_policy_keeps_a_shape_whose_first_steps_compiled_in_contention():
    """The same trace, through the policy: after the narrow tree's slow first steps it still
    scores within reach of the chain at bs 16, so a warm measurement can win there."""
    cfg = PolicyConfig(shapes=(WIDE, NARROW, CHAIN), patience=2)
    table = StepCostTable({}, cfg.ema_alpha)
    for bs, seconds in ((1, 6.3e-3), (16, 6.6e-3), (28, 8.0e-3)):
        table.observe(CHAIN, bs, seconds)
    policy = ShapePolicy(
        cfg, table, CHAIN, initial_accept_lengths={NARROW: 2.9, CHAIN: 2.56}
    )
    for bs, seconds in ((13, 1.575), (8, 0.608), (6, 0.153), (4, 0.262)):
        policy.observe_step_time(NARROW, bs, seconds)
    assert policy.score(NARROW, 16) > 0.5 * policy.score(CHAIN, 16)
    policy.observe_step_time(
        NARROW, 16, 6.8e-3
    )  # warm: 2.9 / 6.8 ms beats 2.56 / 6.6 ms
    assert run(policy, 16, 3)[-1] == NARROW


def test_the_policy_runs_the_wide_tree_at_bs_1_after_its_first_step_was_a_one_off():
    """The tree ran first (its first step believed: nothing to compare it with), then the
    chain; at bs 1 the tree's warm cost wins."""
    cfg = PolicyConfig(shapes=(WIDE, CHAIN), patience=2)
    table = StepCostTable({}, cfg.ema_alpha)
    for bs, seconds in ((21, 0.727), (57, 52.0e-3), (64, 55.0e-3)):
        table.observe(WIDE, bs, seconds)
    for bs, seconds in ((64, 10.5e-3), (1, 6.3e-3)):
        table.observe(CHAIN, bs, seconds)
    policy = ShapePolicy(
        cfg, table, CHAIN, initial_accept_lengths={WIDE: 2.72, CHAIN: 2.37}
    )
    assert run(policy, 1, 3)[-1] == WIDE


def test_the_prior_prices_verify_width_and_draft_steps():
    assert prior_step_cost(NONE, 1) < prior_step_cost(Shape(1, 1, 2), 1)
    assert prior_step_cost(CHAIN, 1) < prior_step_cost(NARROW, 1)
    assert prior_step_cost(NARROW, 1) < prior_step_cost(WIDE, 1)
    # At bs 48 the wide tree verifies 1536 tokens: far past the knee, the chain's 192 not.
    assert prior_step_cost(WIDE, 48) > 3 * prior_step_cost(CHAIN, 48)


def test_step_costs_must_be_positive():
    with pytest.raises(ValueError, match="step costs of 16,3,32 must be positive"):
        StepCostTable({WIDE: {1: 0.0}}, ema_alpha=0.2)


# ----------------------------------------------------------------------------- the choice


def test_each_batch_size_gets_its_best_shape_after_patience():
    """Tokens per second: bs 1 the wide tree (3.3 / 4.0 ms = 825 against 806, 706, 625);
    bs 16 the chain (2.4 / 3.9 ms = 615 against 412, 580, 526); bs 48 no speculation
    (1 / 2.2 ms = 455 against 165, 322, 369)."""
    policy = make_policy(patience=3, decisive_margin=1.0)
    assert set(run(policy, 1, 10)) == {WIDE}
    assert run(policy, 16, 4) == [WIDE, WIDE, CHAIN, CHAIN]
    assert run(policy, 48, 4) == [CHAIN, CHAIN, NONE, NONE]
    assert run(policy, 1, 4) == [NONE, NONE, WIDE, WIDE]
    assert policy.counters.switches == 3
    assert policy.counters.steps == {"16,3,32": 14, "1,3,4": 4, "none": 4}


def test_a_decisive_challenger_switches_at_once():
    """A batch that jumps from 1 to 16 finds the chain 1.49x the wide tree: past the decisive
    margin (25 %), so it runs at once, not after patience. At bs 48 no speculation is 1.23x
    the chain: a near tie, which waits for patience."""
    policy = make_policy(patience=8)
    assert run(policy, 1, 3) == [WIDE] * 3
    assert run(policy, 16, 2) == [CHAIN, CHAIN]
    assert run(policy, 48, 9) == [CHAIN] * 7 + [NONE] * 2
    assert policy.counters.switches == 2


def test_a_switch_into_none_waits_out_patience_however_far_ahead():
    """A batch that jumps from 1 to 48 finds no speculation 2.75x the wide tree: the chain,
    2.2x, takes over at once, and no speculation only after `patience` decisions; a batch
    that passes through such a size for fewer steps never leaves speculation (the catch-up
    after `none` is not in its score)."""
    policy = make_policy(patience=8)
    assert run(policy, 1, 2) == [WIDE] * 2
    assert run(policy, 48, 10) == [CHAIN] * 8 + [NONE] * 2
    passing = make_policy(initial=CHAIN, patience=8)
    assert run(passing, 48, 3) + run(passing, 16, 2) == [CHAIN] * 5
    assert passing.counters.switches == 0


def test_a_challenger_within_the_margin_never_takes_over():
    # At bs 1 the narrow tree scores 2.9 / 3.6 ms = 806 /s, the wide one 825 /s: no switch
    # from narrow with a 5 % margin, although the wide tree is better.
    policy = make_policy(initial=NARROW, patience=1)
    assert set(run(policy, 1, 50)) == {NARROW}
    assert policy.counters.switches == 0


def test_a_stale_challenger_is_probed_before_a_switch_on_patience():
    """The 1.21B target at bs 64 on a shared host: the chain (2.55 tokens in 4.27 ms) beats
    the narrow tree (2.91 in 5.68 ms) by 17 %. The host slows down by a quarter while the
    chain runs: its price follows, the narrow tree's, set by its last run long before, does
    not, and the narrow tree looks 7 % better, past the margin. Switching on that would run
    it for `patience` steps or more; a probe prices it at the host's new speed in
    PRICE_PROBE_STEPS steps, and the policy stays on the chain."""
    cfg = PolicyConfig(shapes=(NARROW, CHAIN))
    seconds = {NARROW: 5.68e-3, CHAIN: 4.27e-3}
    draws = {NARROW: [3] * 58 + [2] * 6, CHAIN: [3] * 35 + [2] * 29}  # 2.91, 2.55
    policy = ShapePolicy(
        cfg,
        StepCostTable({s: {64: seconds[s]} for s in seconds}, cfg.ema_alpha),
        CHAIN,
        initial_accept_lengths={NARROW: 2.91, CHAIN: 2.55},
    )
    ran, probing = [], []
    for step in range(500):
        slowdown = 1.25 if step >= 300 else 1.0
        shape = policy.choose(64)
        ran.append(shape)
        probing.append(policy.probing)
        policy.observe_accept(shape, draws[shape])
        policy.observe_step_time(shape, 64, seconds[shape] * slowdown)
    assert ran[:300] == [CHAIN] * 300
    after = ran[300:]
    assert after.count(NARROW) == ShapePolicy.PRICE_PROBE_STEPS
    assert all(p for s, p in zip(after, probing[300:]) if s == NARROW)
    assert after[-100:] == [CHAIN] * 100


def test_a_fresh_challenger_is_switched_to_on_patience():
    """Where the challenger ran within STALE_AFTER steps, patience alone decides."""
    policy = make_policy(initial=CHAIN, shapes=(NARROW, CHAIN))
    policy.accept_length[NARROW] = 2.0
    assert run(policy, 1, 100) == [CHAIN] * 100
    policy.accept_length[NARROW] = 2.8  # 2.8 / 3.6 ms against 2.4 / 3.4 ms: 10 % ahead
    policy._last_run[NARROW] = policy._step  # as if it had just run
    chosen = run(policy, 1, policy.config.patience)
    assert chosen[-1] == NARROW and NARROW not in chosen[:-1]
    assert policy.counters.switches == 1 and policy.counters.probes == 0


def test_a_flapping_batch_size_does_not_switch():
    # bs 16 favours the chain (1.49x), bs 1 the wide tree (1.32x): alternating, no challenger
    # lasts 3 decisions, and neither wins by the decisive margin.
    policy = make_policy(patience=3, decisive_margin=1.0)
    for _ in range(20):
        policy.choose(16)
        policy.choose(1)
    assert policy.current == WIDE and policy.counters.switches == 0


def test_measured_acceptance_moves_the_choice():
    policy = make_policy(patience=2)
    for _ in range(400):
        policy.observe_accept(WIDE, [1, 1, 2, 1])  # the draft stopped agreeing
    assert policy.accept_length[WIDE] == pytest.approx(1.25, abs=0.01)
    # bs 1 then prefers the narrow tree (2.9 / 3.6 ms against 1.25 / 4.0 ms): 2.6x, decisive.
    assert run(policy, 1, 3) == [NARROW, NARROW, NARROW]
    policy = make_policy(patience=2, decisive_margin=2.0)
    for _ in range(400):
        policy.observe_accept(WIDE, [1, 1, 2, 1])
    assert run(policy, 1, 3) == [WIDE, NARROW, NARROW]  # after patience


def test_each_request_step_is_one_draw_of_the_accept_length():
    """A step of n requests weighs n draws: past accept_horizon draws, a batch of one moves
    the estimate by 1 / horizon of the gap, a batch of 64 by 1 - (1 - 1 / horizon) ** 64.
    """
    policy = make_policy(accept_horizon=64)
    for _ in range(100):
        policy.observe_accept(NARROW, [3] * 4)
    assert policy.accept_length[NARROW] == pytest.approx(3.0, abs=1e-3)
    policy.observe_accept(NARROW, [1])
    assert policy.accept_length[NARROW] == pytest.approx(3.0 - 2.0 / 64, abs=1e-3)
    before = policy.accept_length[NARROW]
    policy.observe_accept(NARROW, [4] * 64)
    a = 1 - (1 - 1 / 64) ** 64
    assert policy.accept_length[NARROW] == pytest.approx((1 - a) * before + a * 4)


def test_the_initial_guess_weighs_as_a_few_draws_then_the_plain_mean_takes_over():
    policy = make_policy(accept_horizon=64)
    guess = policy.accept_length[CHAIN]  # 2.4
    policy.observe_accept(CHAIN, [1])  # one short draw does not price the chain at 1
    assert policy.accept_length[CHAIN] == pytest.approx(
        (GUESS_DRAWS * guess + 1) / (GUESS_DRAWS + 1)
    )
    policy.observe_accept(CHAIN, [4] * 55)  # 64 draws with the guess's: their mean
    assert policy.accept_length[CHAIN] == pytest.approx(
        (GUESS_DRAWS * guess + 1 + 55 * 4) / 64
    )


@pytest.mark.parametrize("seed", range(20))
def test_at_bs_1_noisy_draws_do_not_lead_the_policy_off_the_best_shape(seed):
    """One request's accept length is a draw of 1 .. num_steps + 1, so at bs 1 a step says
    little about a shape. Here the chain is the best shape by 6 % (2.61 tokens in 3.4 ms;
    wide tree 2.72 in 4.0 ms, narrow 2.56 in 3.6), every shape starts from the optimistic
    guess and draws are 1 + Binomial(3, (mean - 1) / 3). Over 3000 steps the policy must
    make at least 95 % of the chain's tokens per second."""
    rng = random.Random(seed)
    means = {WIDE: 2.72, NARROW: 2.56, CHAIN: 2.61, NONE: 1.0}
    shapes = (WIDE, NARROW, CHAIN, NONE)
    cfg = PolicyConfig(shapes=shapes)
    policy = ShapePolicy(cfg, StepCostTable({s: COSTS[s] for s in shapes}, 0.2), WIDE)
    tokens = seconds = 0.0
    for _ in range(3000):
        shape = policy.choose(1)
        tokens += means[shape]
        seconds += COSTS[shape][1]
        if shape.speculates:
            q = (means[shape] - 1) / 3
            policy.observe_accept(shape, [1 + sum(rng.random() < q for _ in range(3))])
    best = means[CHAIN] / COSTS[CHAIN][1]
    assert tokens / seconds >= 0.95 * best


def seven_b_table_at_bs_4() -> StepCostTable:
    """Device seconds of a 7.24B policy engine (side by side, H200): the chain measured at
    bs 1 and 4, the narrow tree at bs 1 only (the policy had left it before the batch grew).
    """
    table = StepCostTable({}, ema_alpha=0.2)
    for shape, bs, seconds in (
        (CHAIN, 1, 5.41e-3),
        (NARROW, 1, 5.63e-3),
        (CHAIN, 4, 5.52e-3),
    ):
        for _ in range(2):  # the second step at a size confirms its point
            table.observe(shape, bs, seconds)
    return table


def test_a_shape_priced_from_afar_is_probed_once_the_batch_settles():
    """At bs 4 the narrow tree's price is its bs 1 point grown by the prior (6.0 ms against
    5.7 measured in its own engine), which with a few short draws behind its accept length
    scores it just under the chain: without running it there, nothing would correct that. It
    runs PRICE_PROBE_STEPS steps once `patience` decisions found the batch near bs 4, then the
    chain resumes; a measured price is no guess, and the probe does not come back."""
    cfg = PolicyConfig(shapes=(NARROW, CHAIN))
    policy = ShapePolicy(
        cfg, seven_b_table_at_bs_4(), CHAIN, {NARROW: 2.74, CHAIN: 2.57}
    )
    assert not policy.costs.measured_near(NARROW, 4)
    assert policy.costs.measured_near(NARROW, 2)
    assert policy.score(NARROW, 4) < policy.score(CHAIN, 4)
    probe = ShapePolicy.PRICE_PROBE_STEPS
    shapes = []
    for _ in range(cfg.patience + probe + 4):
        shape = policy.choose(4)
        shapes.append(shape)
        if shape == NARROW:
            policy.observe_step_time(NARROW, 4, 5.7e-3)
    assert shapes[: cfg.patience - 1] == [CHAIN] * (cfg.patience - 1)
    assert shapes[cfg.patience - 1 : cfg.patience - 1 + probe] == [NARROW] * probe
    assert shapes[cfg.patience - 1 + probe :] == [CHAIN] * 5
    assert policy.counters.probes == 1 and policy.counters.switches == 0
    assert policy.costs.seconds(NARROW, 4) == pytest.approx(5.7e-3)
    assert run(policy, 4, 100).count(NARROW) == 0


def test_a_probe_finds_no_speculation_best_where_its_prior_priced_it_dear():
    """A host-bound target at bs 48: `none` never ran, so its price is the prior's in the
    chain's units, 3.0 ms, while a plain step there takes 2.2 ms; 2.6 tokens in the chain's
    7.1 ms score 8 % above it. The probe measures `none`, which then wins after patience (a
    switch into `none` always waits it out)."""
    cfg = PolicyConfig(shapes=(CHAIN, NONE))
    table = StepCostTable({}, ema_alpha=0.2)
    for _ in range(2):
        table.observe(CHAIN, 48, 7.1e-3)
    policy = ShapePolicy(cfg, table, CHAIN, {CHAIN: 2.6})
    assert policy.score(CHAIN, 48) > 1.05 * policy.score(NONE, 48)
    shapes = []
    for _ in range(40):
        shape = policy.choose(48)
        shapes.append(shape)
        seconds = 2.2e-3 if shape == NONE else 7.1e-3
        policy.observe_step_time(shape, 48, seconds)
    probe_end = cfg.patience - 1 + ShapePolicy.PRICE_PROBE_STEPS
    assert shapes[cfg.patience - 1 : probe_end] == [NONE] * 3
    assert NONE in shapes[probe_end : probe_end + cfg.patience + 1]
    assert shapes[-10:] == [NONE] * 10


def test_no_price_probe_on_a_batch_that_keeps_doubling():
    """Every size is new to the narrow tree, but the batch never stays within
    StepCostTable.NEAR of one for `patience` decisions: its prices stay guesses and nothing
    is probed."""
    cfg = PolicyConfig(shapes=(NARROW, CHAIN))
    policy = ShapePolicy(
        cfg, seven_b_table_at_bs_4(), CHAIN, {NARROW: 2.74, CHAIN: 2.57}
    )
    for bs in (1, 2, 4, 8, 16, 32, 64, 128):
        assert run(policy, bs, 3) == [CHAIN] * 3  # 6 decisions within a factor 2
    assert policy.counters.probes == 0


def test_no_price_probe_of_a_shape_far_below_the_running_one():
    """The wide tree priced from afar at 2.1x the chain's seconds: beyond
    PRICE_PROBE_MARGIN, not worth its steps."""
    cfg = PolicyConfig(shapes=(WIDE, CHAIN))
    table = seven_b_table_at_bs_4()
    for _ in range(2):
        table.observe(WIDE, 48, 54.0e-3)
        table.observe(CHAIN, 48, 7.8e-3)
    policy = ShapePolicy(cfg, table, CHAIN, {WIDE: 3.3, CHAIN: 2.57})
    assert policy.score(WIDE, 16) < policy.score(CHAIN, 16) / 1.25
    assert run(policy, 16, 50) == [CHAIN] * 50
    assert policy.counters.probes == 0


def test_no_speculation_keeps_accept_length_one():
    policy = make_policy()
    policy.observe_accept(NONE, [1, 1])
    policy.observe_accept(WIDE, [])
    assert policy.accept_length[NONE] == 1.0 and policy.accept_length[WIDE] == 3.3


def test_measured_step_time_moves_the_choice():
    policy = make_policy(patience=1, ema_alpha=1.0)
    # The wide tree turns out three times as slow at bs 1 as its table said.
    policy.observe_step_time(WIDE, 1, 12.0e-3)
    assert run(policy, 1, 2) == [NARROW, NARROW]


def test_idle_shapes_within_the_decisive_margin_are_probed_then_left():
    # At bs 1 the narrow tree scores 2 % below the wide one and the chain 14 %: after
    # probe_interval steps each runs probe_steps steps, then the wide tree resumes. `none`
    # (nothing to measure but its step time) is never probed.
    policy = make_policy(patience=50, probe_interval=20, probe_steps=4)
    shapes = run(policy, 1, 60)
    assert shapes[:20] == [WIDE] * 20
    assert shapes[20:28] == [NARROW] * 4 + [CHAIN] * 4
    assert shapes[28:44] == [WIDE] * 16
    assert shapes[44:52] == [NARROW] * 4 + [CHAIN] * 4
    assert policy.counters.probes == 4
    assert policy.counters.switches == 0
    assert "none" not in policy.counters.steps


def test_an_idle_shape_beyond_the_decisive_margin_is_not_probed():
    policy = make_policy(shapes=(WIDE, CHAIN, NONE), patience=50, probe_interval=20)
    for _ in range(40):
        policy.observe_accept(
            CHAIN, [1, 2, 1, 2]
        )  # 1.5 / 3.4 ms: 47 % below the wide tree
    assert run(policy, 1, 60) == [WIDE] * 60
    assert policy.counters.probes == 0


def test_a_probe_ends_when_the_batch_leaves_the_size_it_began_at():
    """A 7.24B trace (session 58): a run's last requests drained the batch to bs 1, the wide
    tree, idle long enough and near the chain there, began a probe, and the next run's 64
    requests arrived mid-probe: the tree ran six steps at bs 64, 54 ms each against the
    chain's 9 ms. A probe is about the size it began at; at a size outside StepCostTable.NEAR of
    it the running shape comes back and the policy decides as usual."""
    policy = make_policy(
        initial=CHAIN,
        shapes=(WIDE, CHAIN, NONE),
        patience=50,
        probe_interval=5,
        probe_steps=8,
    )
    # Idle for 5 steps, the wide tree (17 % ahead at bs 1) begins its probe.
    assert run(policy, 1, 6) == [CHAIN] * 5 + [WIDE]
    assert run(policy, 2, 2) == [WIDE] * 2  # bs 2 is near bs 1: the probe goes on
    assert run(policy, 64, 3) == [CHAIN] * 3
    assert policy.counters.probes == 1 and policy.counters.switches == 0


def test_a_probe_that_measures_well_wins_the_next_decision():
    policy = make_policy(patience=1, probe_interval=5, probe_steps=2)
    shapes = run(policy, 1, 6)
    assert shapes == [WIDE] * 5 + [NARROW]  # idle for 5 steps: the probe starts
    policy.observe_accept(NARROW, [5, 5, 5, 5])
    policy.observe_accept(NARROW, [5, 5, 5, 5])
    # 3.9 accepted in 3.6 ms now beats 3.3 in 4.0 ms by more than the margin.
    assert run(policy, 1, 3) == [NARROW, NARROW, NARROW]
    assert policy.counters.switches == 1


# ----------------------------------------------------------------------------- contexts


def test_a_price_taken_at_another_context_is_replaced_not_averaged():
    """A step's cost grows with its requests' contexts: a point measured at a mean context
    more than CONTEXT_NEAR away is replaced by the step, not moved towards it by the EMA.
    """
    table = StepCostTable({}, ema_alpha=0.2)
    table.observe(CHAIN, 48, 4.6e-3, context=1000.0)
    table.observe(CHAIN, 48, 4.5e-3, context=1000.0)  # replaces the provisional point
    table.observe(CHAIN, 48, 4.7e-3, context=1100.0)  # a near context: the EMA
    assert table.seconds(CHAIN, 48) == pytest.approx(0.8 * 4.5e-3 + 0.2 * 4.7e-3)
    table.observe(CHAIN, 48, 2.9e-3, context=60.0)
    assert table.seconds(CHAIN, 48) == pytest.approx(2.9e-3)
    assert table.confirmed(CHAIN, 48)
    table.observe(CHAIN, 48, 3.9e-3)  # a step of unknown context: the EMA
    assert table.seconds(CHAIN, 48) == pytest.approx(0.8 * 2.9e-3 + 0.2 * 3.9e-3)


# Draws of 48 requests: the chain's mean 2.56, the narrow tree's 2.92.
DRAWS_48 = {CHAIN: [3] * 27 + [2] * 21, NARROW: [3] * 44 + [2] * 4}


def step_ms(shape: Shape, bs: int, context: float) -> float:
    """A step on a host-bound target: a fixed part, a part per request (the narrow tree
    verifies twice the chain's tokens) and the KV the requests' attention reads. At bs 48
    the chain wins at every context; at bs 2 the narrow tree does."""
    per_request, per_kv_token = {CHAIN: (0.006, 0.035e-3), NARROW: (0.03, 0.031e-3)}[
        shape
    ]
    return 2.5 + bs * (per_request + per_kv_token * context)


def run_replies(policy, runs, contexts=True):
    """Runs of 48 requests replying 1024 tokens (a benchmark's repeats): contexts grow from
    60 to 1060 KV tokens over 380 steps at bs 48, the batch drains to bs 2 and the last
    requests take 20 steps more. Returns the shapes run at bs 48, by run."""
    by_run = []
    for _ in range(runs):
        schedule = [(48, 60 + 1000 * i / 379) for i in range(380)]
        schedule += [(bs, 1060.0) for bs in range(46, 1, -2)] + [(2, 1060.0)] * 20
        ran = []
        for bs, context in schedule:
            shape = policy.choose(bs, context if contexts else None)
            if bs == 48:
                ran.append(shape)
            policy.observe_accept(shape, DRAWS_48[shape][:bs])
            seconds = step_ms(shape, bs, context) / 1e3
            policy.observe_step_time(shape, bs, seconds, context if contexts else None)
        by_run.append(ran)
    return by_run


@pytest.mark.parametrize("contexts", [True, False], ids=["contexts", "no-contexts"])
def test_a_run_begins_on_the_shape_that_wins_at_its_context(contexts):
    """Session 64's 1.21B bs-48 trace: the narrow tree, priced at bs 48 early in a run, ran a
    whole later run because the chain's price there was taken at the end of the run before,
    at four times the context, and its score (0.56 against the narrow tree's 0.72 tokens a
    ms) never called for a probe; the chain makes a fifth more at every context. With the
    contexts known, a shape last run at another context is probed at the run's start and
    the chain wins it back within a few steps; without them the narrow tree keeps the run.
    """
    cfg = PolicyConfig(shapes=(NARROW, CHAIN))
    policy = ShapePolicy(
        cfg,
        StepCostTable({}, cfg.ema_alpha),
        NARROW,
        initial_accept_lengths={NARROW: 2.92, CHAIN: 2.56},
    )
    runs = run_replies(policy, 4, contexts)
    later = [ran.count(CHAIN) / len(ran) for ran in runs[1:]]
    if contexts:
        assert min(later) >= 0.95, later
    else:
        assert min(later) < 0.5, later  # what the policy did without them


def run_short_then_long(
    chain_late_ms: float, contexts: bool
) -> tuple[list[Shape], int]:
    """The narrow tree runs a few steps at a 100-token context before the chain takes over
    on patience; then 60 steps at 1000 tokens, where the chain's fresh price makes the narrow
    tree's old one look 14 % (chain_late_ms 4.0: on patience) or 31 % (4.6: decisive) better
    than the chain's. Returns the shapes run and the policy's switches."""
    cfg = PolicyConfig(shapes=(NARROW, CHAIN))
    seconds = {NARROW: {100: 4.0e-3, 1000: 5.5e-3}, CHAIN: {100: 3.0e-3}}
    seconds[CHAIN][1000] = chain_late_ms / 1e3
    policy = ShapePolicy(
        cfg,
        StepCostTable({s: {48: by_ctx[100]} for s, by_ctx in seconds.items()}, 0.2),
        NARROW,
        initial_accept_lengths={NARROW: 2.92, CHAIN: 2.56},
    )
    ran = []
    for context in [100.0] * 20 + [1000.0] * 60:
        shape = policy.choose(48, context if contexts else None)
        ran.append(shape)
        policy.observe_accept(shape, DRAWS_48[shape])
        policy.observe_step_time(
            shape, 48, seconds[shape][context], context if contexts else None
        )
    assert ran[:20] == [NARROW] * 7 + [CHAIN] * 13  # the chain won on patience
    return ran, policy.counters.switches


@pytest.mark.parametrize("chain_late_ms", [4.0, 4.6], ids=["on-patience", "decisive"])
@pytest.mark.parametrize("contexts", [True, False], ids=["contexts", "no-contexts"])
def test_a_challenger_priced_at_a_shorter_context_is_probed_first(
    monkeypatch, chain_late_ms, contexts
):
    """Where no cost per token of context is known yet (ContextSlope says nothing), the
    narrow tree, priced at a tenth of the batch's context, is probed at this context before
    any switch, and its fresh price keeps the chain; without contexts the policy switched.
    """
    monkeypatch.setattr(ContextSlope, "MIN_STEPS", float("inf"))
    ran, switches = run_short_then_long(chain_late_ms, contexts)
    late = ran[20:]
    if contexts:
        assert late.count(NARROW) == ShapePolicy.PRICE_PROBE_STEPS
        assert switches == 1 and late[-40:] == [CHAIN] * 40
    else:
        assert switches >= 2


@pytest.mark.parametrize("chain_late_ms", [4.0, 4.6], ids=["on-patience", "decisive"])
def test_a_price_carried_to_the_batchs_context_needs_no_probe(chain_late_ms):
    """The chain's own steps at 100 and 1000 tokens say what a token of context costs at bs
    48; the narrow tree's price from 100 tokens, carried to 1000 by it, is no challenger:
    the chain runs every step at 1000 tokens, with no probe."""
    ran, switches = run_short_then_long(chain_late_ms, contexts=True)
    assert ran[20:] == [CHAIN] * 60
    assert switches == 1


def test_a_price_carried_from_other_batch_sizes_keeps_their_contexts():
    table = StepCostTable({}, ema_alpha=0.2)
    for _ in range(2):
        table.observe(CHAIN, 16, 2.7e-3, context=84.0)
        table.observe(CHAIN, 64, 4.7e-3, context=1050.0)
    assert table.context_at(CHAIN, 16) == 84.0
    assert table.context_at(CHAIN, 48) == pytest.approx(84 + (1050 - 84) * 2 / 3)
    assert (table.context_at(CHAIN, 1), table.context_at(CHAIN, 128)) == (84.0, 1050.0)
    assert table.context_at(NARROW, 48) is None  # never measured
    assert StepCostTable({CHAIN: {48: 4e-3}}, 0.2).context_at(CHAIN, 48) is None


@pytest.mark.parametrize("contexts", [True, False], ids=["contexts", "no-contexts"])
def test_a_shape_priced_from_long_contexts_elsewhere_is_probed(contexts):
    """Session 64's bs-48 warm-up run: the chain had never run at bs 48; its price there was
    interpolated from a bs-16 point at an 84-token context and a bs-64 point at the end of
    1024-token runs, and the narrow tree, running, kept the whole run at a fifth less. The
    interpolated price carries a context of about 730 tokens against the batch's 162: the
    chain is probed once the batch has settled at bs 48 (patience) and wins."""
    cfg = PolicyConfig(shapes=(NARROW, CHAIN))
    table = StepCostTable({}, cfg.ema_alpha)
    for _ in range(2):
        table.observe(CHAIN, 16, 2.7e-3, context=84.0 if contexts else None)
        table.observe(CHAIN, 64, 4.7e-3, context=1050.0 if contexts else None)
        table.observe(NARROW, 48, 4.6e-3, context=160.0 if contexts else None)
    policy = ShapePolicy(
        cfg, table, NARROW, initial_accept_lengths={NARROW: 2.92, CHAIN: 2.56}
    )
    seconds = {NARROW: 4.6e-3, CHAIN: 3.0e-3}
    ran = []
    for step in range(40):
        context = 162.0 + 2.5 * step
        shape = policy.choose(48, context if contexts else None)
        ran.append(shape)
        policy.observe_accept(shape, DRAWS_48[shape])
        policy.observe_step_time(
            shape, 48, seconds[shape], context if contexts else None
        )
    if contexts:
        patience = cfg.patience
        assert ran[: patience - 1] == [NARROW] * (patience - 1)
        assert ran[patience - 1] == CHAIN and policy.counters.probes == 1
        assert ran[-25:] == [CHAIN] * 25
    else:
        assert ran == [NARROW] * 40


def costs_at(shape: Shape, bs: int) -> float:
    """COSTS[shape] at bs, linear between its batch sizes."""
    sizes = sorted(COSTS[shape])
    hi = next(b for b in sizes if b >= bs)
    lo = max(b for b in sizes if b <= bs) if bs >= sizes[0] else hi
    if lo == hi:
        return COSTS[shape][hi]
    w = (bs - lo) / (hi - lo)
    return (1 - w) * COSTS[shape][lo] + w * COSTS[shape][hi]


def test_a_ramp_of_new_requests_probes_each_shape_once():
    """Every shape priced at a 1000-token context; then new requests arrive one a step at a
    100-token context (steps a quarter cheaper) and the batch stays at 48. Each shape's
    points at the ramp's sizes are dear one size after another: probing each as the batch
    reaches it ran the narrow tree and `none` nine times in these 88 steps; a shape is
    probed for its context once in STALE_AFTER steps."""
    policy = make_policy(initial=CHAIN)
    for shape, by_bs in COSTS.items():
        for bs, seconds in by_bs.items():
            for _ in range(2):
                policy.observe_step_time(shape, bs, seconds, context=1000.0)
    for bs in list(range(1, 49)) + [48] * 40:
        shape = policy.choose(bs, 100.0)
        policy.observe_accept(shape, [3, 2, 3] * 16 if shape.speculates else [])
        policy.observe_step_time(shape, bs, costs_at(shape, bs) * 0.775, 100.0)
    assert 1 <= policy.counters.probes <= 3, policy.counters


@pytest.mark.parametrize("carried", [True, False], ids=["carried", "not-carried"])
def test_an_idle_price_from_mid_run_is_carried_to_the_batchs_context(
    monkeypatch, carried
):
    """The chain runs a run of 1024-token replies at bs 48 (step_ms: the chain wins at every
    context); at 600 tokens the narrow tree is priced by an interval probe. Near 1000 tokens,
    within twice the probe's context, that price scores over the margin above the chain's
    fresh one: the narrow tree wins on patience and, idle for more than STALE_AFTER steps,
    is probed again (three steps, each a fifth dearer than the chain's). Carried to the
    batch's context by the chain's own cost per token, it scores below the chain: no probe,
    the chain runs every step."""
    if not carried:
        monkeypatch.setattr(ContextSlope, "MIN_STEPS", float("inf"))
    cfg = PolicyConfig(shapes=(NARROW, CHAIN), probe_interval=10**9)
    policy = ShapePolicy(
        cfg,
        StepCostTable({}, cfg.ema_alpha),
        CHAIN,
        initial_accept_lengths={NARROW: 2.92, CHAIN: 2.56},
    )
    for _ in range(50):  # the accept lengths of both shapes as measured
        policy.observe_accept(NARROW, DRAWS_48[NARROW])
        policy.observe_accept(CHAIN, DRAWS_48[CHAIN])
    ran = []
    for context in [60 + 1000 * i / 379 for i in range(380)]:
        if ran and ran[-1] == CHAIN and 600 <= context < 603:
            # An interval probe's steps, as the policy would have run them.
            for _ in range(3):
                policy.observe_step_time(
                    NARROW, 48, step_ms(NARROW, 48, context) / 1e3, context
                )
        shape = policy.choose(48, context)
        ran.append(shape)
        policy.observe_accept(shape, DRAWS_48[shape])
        policy.observe_step_time(shape, 48, step_ms(shape, 48, context) / 1e3, context)
    if carried:
        assert ran == [CHAIN] * 380
    else:
        # What the policy did without the carry: a stale challenger's probe.
        assert ran.count(NARROW) == ShapePolicy.PRICE_PROBE_STEPS
