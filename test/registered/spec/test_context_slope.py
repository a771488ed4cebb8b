"""speculative.context_slope: what a token of the requests' mean context costs a decode step,
learned per batch size from the steps the shapes run."""

from __future__ import annotations

import random

import pytest

from sglang.srt.speculative.context_slope import ContextSlope

# The chain and the narrow tree at bs 48 on the 1.21B target (session 64's trace): a step
# grows by 0.161 / 0.144 ms per 100 tokens of mean context.
CHAIN_MS = (2.9, 0.161e-2)
NARROW_MS = (3.9, 0.144e-2)


def feed(slope, shape, bs, line_ms, contexts, noise_ms=0.0, seed=0):
    rng = random.Random(seed)
    base, per_token = line_ms
    for context in contexts:
        ms = base + per_token * context + rng.gauss(0.0, noise_ms)
        slope.observe(shape, bs, context, ms / 1e3)


def a_run(start=60.0, end=1060.0, steps=380):
    return [start + (end - start) * i / (steps - 1) for i in range(steps)]


def test_a_run_of_growing_contexts_gives_its_cost_per_token():
    slope = ContextSlope()
    feed(slope, "chain", 48, CHAIN_MS, a_run(), noise_ms=0.15)
    assert slope.per_token(48) == pytest.approx(CHAIN_MS[1] / 1e3, rel=0.1)


def test_shapes_at_one_batch_size_pool_without_their_offsets_mixing():
    """Two shapes whose steps differ by a whole millisecond at every context: the pooled
    cost per token lies between theirs, not at the offset between them."""
    slope = ContextSlope()
    feed(slope, "chain", 48, CHAIN_MS, a_run(60, 500))
    feed(slope, "narrow", 48, NARROW_MS, a_run(500, 1000))
    per_token_ms = slope.per_token(48) * 1e3
    assert NARROW_MS[1] <= per_token_ms <= CHAIN_MS[1]


@pytest.mark.parametrize(
    "contexts",
    [
        a_run(steps=int(ContextSlope.MIN_STEPS) - 1),  # too few steps
        a_run(500, 500 + ContextSlope.MIN_SPREAD, steps=100),  # contexts too close
    ],
    ids=["few-steps", "close-contexts"],
)
def test_nothing_is_carried_before_a_fit_says_something(contexts):
    slope = ContextSlope()
    feed(slope, "chain", 48, CHAIN_MS, contexts)
    assert slope.per_token(48) == 0.0


def test_a_batch_size_without_a_fit_scales_the_nearest_ones():
    """A step reads bs times the mean context: bs 16 gets a third of bs 48's cost per token,
    bs 64 four thirds of it; a size between two fitted ones takes the nearer one's."""
    slope = ContextSlope()
    feed(slope, "chain", 48, CHAIN_MS, a_run())
    feed(slope, "chain", 4, (2.0, CHAIN_MS[1] / 12), a_run())
    at_48 = slope.per_token(48)
    assert slope.per_token(16) == pytest.approx(at_48 / 3)
    assert slope.per_token(64) == pytest.approx(at_48 * 4 / 3)
    assert slope.per_token(1) == pytest.approx(slope.per_token(4) / 4)


def test_a_cost_per_token_is_never_negative():
    slope = ContextSlope()
    feed(slope, "chain", 48, (5.0, -0.1e-2), a_run())
    assert slope.per_token(48) == 0.0


def test_old_steps_fade():
    """After a few half-lives of steps at a new cost per token, the fit follows it."""
    slope = ContextSlope()
    feed(slope, "chain", 48, CHAIN_MS, a_run())
    feed(slope, "chain", 48, (2.9, 0.4e-2), a_run() * 2)
    assert slope.per_token(48) == pytest.approx(0.4e-5, rel=0.1)
