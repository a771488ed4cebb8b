"""No false positives: random simulated workloads run clean in raise mode, and exercise what
they claim to (slot and row reuse, borrowed prefixes, tree compaction moves)."""

from __future__ import annotations

import pytest
from canary_sim import SimEngine

from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode, VerifySampler
from sglang.srt.kv_canary.report import STATS

FLAVOURS = {
    # name: (engine kwargs, counters that must be > 0)
    "eagle_chain": (dict(num_steps=3), ("spec_rounds", "borrowed")),
    "eagle_chain_one_step": (dict(num_steps=1), ("spec_rounds",)),
    "eagle_tree": (dict(num_steps=3, topk=3, num_draft_tokens=6), ("moved",)),
    "eagle_tree_radix": (
        dict(num_steps=4, topk=2, num_draft_tokens=7, radix=True),
        ("moved", "borrowed"),
    ),
    # STANDALONE runs EAGLE's draft extend: its draft KV at p holds token p + 1 too
    "standalone_chain": (
        dict(algorithm="STANDALONE", num_steps=3),
        ("spec_rounds", "borrowed"),
    ),
    "standalone_tree_radix": (
        dict(
            algorithm="STANDALONE", num_steps=4, topk=2, num_draft_tokens=7, radix=True
        ),
        ("moved", "borrowed"),
    ),
    "no_spec": (dict(eagle=False), ("borrowed",)),
    "no_spec_radix": (dict(eagle=False, radix=True), ("borrowed",)),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_random_workload_has_no_violations(flavour, seed):
    kwargs, exercised = FLAVOURS[flavour]
    engine = SimEngine(seed=seed, slots=400, mode=CanaryMode.RAISE, **kwargs)
    engine.run_random(250)
    stats = STATS.as_dict()
    assert stats["violations_total"] == 0
    assert stats["checks_total"] > 1000
    for name in ("freed", "slot_reused", "row_reused") + exercised:
        assert (
            engine.counts[name] > 0
        ), f"workload never exercised {name}: {dict(engine.counts)}"


def test_sampling_checks_fewer_forwards_and_stays_clean():
    full = SimEngine(seed=7, slots=400)
    full.run_random(150)
    every_forward = STATS.as_dict()
    STATS.reset()
    sparse = SimEngine(seed=7, slots=400, sample_every=4)
    sparse.run_random(150)
    sampled = STATS.as_dict()
    assert sampled["violations_total"] == 0
    assert 0 < sampled["checks_total"] < every_forward["checks_total"] / 2


def test_sampled_out_forwards_still_write():
    """Skipping a check must not skip the fingerprint writes: a later sampled forward would
    find stale slots."""
    engine = SimEngine(
        seed=8, slots=400, sample_every=1000
    )  # only the first bracket checks
    engine.run_random(120)
    engine.target.sampler = engine.draft.sampler = VerifySampler(
        CanaryConfig(CanaryMode.RAISE)
    )
    live = list(engine.reqs.values())
    assert live
    engine.spec_round(live)  # raise mode: any stale slot would raise here
    assert STATS.as_dict()["violations_total"] == 0
