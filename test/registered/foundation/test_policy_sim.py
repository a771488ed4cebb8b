"""benchmark/spec/policy_sim.py: a benchmark's measured step costs replayed on a load, for
every fixed shape and for the shape policy."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import bench_e2e  # noqa: E402
import policy_sim  # noqa: E402

from sglang.srt.speculative.shape_policy import Shape, ShapePolicy  # noqa: E402

# bench_e2e's "narrow" config is tree 4,3,8 whatever --tree says.
TREE, CHAIN, NONE = Shape(4, 3, 8), Shape(1, 3, 4), Shape.parse("none")
ACCEPT = {"narrow": 3.6, "chain": 2.5, "none": 1.0}


def step_ms(config: str, bs: int) -> float:
    """A tree that verifies bs x 8 tokens grows dear fast; the chain barely grows."""
    return {
        "narrow": 3.0 + 0.25 * bs,
        "chain": 3.0 + 0.04 * bs,
        "none": 2.0 + 0.01 * bs,
    }[config]


def bench_rows() -> list[dict]:
    rows = [
        {
            "config": config,
            "bs": bs,
            "tok_per_s": bs * ACCEPT[config] / (step_ms(config, bs) / 1e3),
            "accept_length": ACCEPT[config],
        }
        for config in ("none", "chain", "narrow")
        for bs in (1, 4, 16, 64)
    ]
    # A mixed-load row and a spec v1 config are not step costs.
    rows.append(
        {"config": "narrow", "bs": "mixed", "tok_per_s": 1.0, "accept_length": 3}
    )
    rows.append({"config": "tree-v1", "bs": 4, "tok_per_s": 1.0, "accept_length": 3})
    return rows


def test_measured_costs_are_seconds_per_step_between_and_past_the_sizes():
    costs = policy_sim.measured_costs(bench_rows())
    assert set(costs.step_seconds) == {TREE, CHAIN, NONE}
    assert costs.seconds(TREE, 4) == pytest.approx(4.0e-3)
    assert costs.seconds(TREE, 10) == pytest.approx(5.5e-3)  # between 4 and 16
    assert costs.seconds(CHAIN, 128) == pytest.approx(2 * costs.seconds(CHAIN, 64))
    assert costs.accept_length[TREE] == pytest.approx(3.6)
    assert costs.accept_length[NONE] == 1.0


def test_replay_decodes_every_token_of_every_request():
    costs = policy_sim.measured_costs(bench_rows())
    # One request of 10 tokens alone: ceil(10 / 2.5) = 4 chain steps of 3.04 ms.
    run = policy_sim.replay(costs, [0.0], [10], lambda bs: CHAIN)
    assert run.steps_by_shape == {"1,3,4": 4}
    assert run.tok_per_s == pytest.approx(10 / (4 * 3.04e-3))
    # A second request arriving after the first finished waits for nothing and runs alone.
    run = policy_sim.replay(costs, [0.0, 1.0], [10, 10], lambda bs: CHAIN)
    assert run.steps_by_shape == {"1,3,4": 8}
    assert run.tok_per_s == pytest.approx(20 / (1.0 + 4 * 3.04e-3))


def test_step_noise_only_ever_makes_a_step_dearer():
    noise = policy_sim.one_sided_noise(0.2, random.Random(0))
    taken = [noise(4.0e-3) for _ in range(400)]
    assert min(taken) >= 4.0e-3
    # 1 + 0.2 x E|N(0, 1)|: about 1.16 times the cost on average.
    assert sum(taken) / len(taken) == pytest.approx(4.0e-3 * 1.16, rel=0.03)
    costs = policy_sim.measured_costs(bench_rows())
    plain = policy_sim.replay(costs, [0.0], [10], lambda bs: CHAIN)
    noisy = policy_sim.replay(costs, [0.0], [10], lambda bs: CHAIN, noise=noise)
    assert noisy.steps_by_shape == plain.steps_by_shape
    assert noisy.seconds > plain.seconds


@pytest.mark.parametrize("confirm_cheaper,price", [(True, 3.92e-3), (False, 4.35e-3)])
def test_the_servers_policy_confirms_a_price_as_told(confirm_cheaper, price):
    """--confirm-replace: the server's policy before a provisional point kept the cheaper
    of its two steps."""
    policy = policy_sim.server_policy([TREE, CHAIN], confirm_cheaper)
    for seconds in (3.92e-3, 4.35e-3):
        policy.observe_step_time(TREE, 16, seconds)
    assert policy.costs.seconds(TREE, 16) == price


def test_the_policy_beats_every_fixed_shape_where_the_load_spends_time_at_both_ends():
    costs = policy_sim.measured_costs(bench_rows())
    delays, tokens = bench_e2e.MixedLoad.parse("64:0.1:4x1024").arrivals(128)
    runs = policy_sim.compare(costs, [TREE, CHAIN, NONE], delays, tokens)
    best_fixed = max(r.tok_per_s for label, r in runs.items() if label != "policy")
    assert runs["policy"].tok_per_s > 1.05 * best_fixed
    # It ran the chain through the crowd and the tree through the tail.
    assert runs["policy"].steps_by_shape.keys() >= {"1,3,4", "4,3,8"}


def test_at_one_batch_size_the_policy_settles_on_the_best_shape():
    """The tree's price at bs 64, a guess from the prior, scores it near the chain: the policy
    probes it for PRICE_PROBE_STEPS steps, finds it 3.4x dearer and stays on the chain.
    """
    costs = policy_sim.measured_costs(bench_rows())
    delays, tokens = [0.0] * 64, [2048] * 64
    runs = policy_sim.compare(costs, [TREE, CHAIN, NONE], delays, tokens)
    assert runs["policy"].tok_per_s >= 0.98 * runs["1,3,4"].tok_per_s
    assert (
        runs["policy"].steps_by_shape.get("4,3,8", 0) <= ShapePolicy.PRICE_PROBE_STEPS
    )


def test_accept_draws_average_the_measured_accept_length():
    costs = policy_sim.measured_costs(bench_rows())
    draw = policy_sim.binomial_draws(costs, random.Random(0))
    draws = [draw(TREE) for _ in range(20000)]
    assert set(draws) == {1, 2, 3, 4}  # 0 .. num_steps drafts and the bonus token
    assert sum(draws) / len(draws) == pytest.approx(3.6, abs=0.02)


def test_replay_with_draws_commits_each_requests_own_draw():
    costs = policy_sim.measured_costs(bench_rows())
    seen = []
    draws = iter([4, 1, 4, 4, 4, 4])
    run = policy_sim.replay(
        costs,
        [0.0, 0.0],
        [8, 5],
        lambda bs: CHAIN,
        observe=lambda shape, bs, seconds, accepted: seen.append((bs, accepted)),
        draw=lambda shape: next(draws),
    )
    # Step 1: 4 and 1 tokens; step 2: 4 and 4 (the first request is done); step 3: the
    # second request alone.
    assert seen == [(2, [4, 1]), (2, [4, 4]), (1, [4])]
    assert run.steps_by_shape == {"1,3,4": 3}


def test_batch_sizes_in_turn_with_one_policy_throughout():
    """bench_e2e's fixed sizes: each config's tok/s at each size; the policy learns from
    nothing at bs 1 (its first run there explores) and carries what it learnt to bs 64.
    """
    costs = policy_sim.measured_costs(bench_rows())
    table = policy_sim.compare_batch_sizes(costs, [TREE, CHAIN, NONE], [1, 64], 2, 512)
    assert set(table) == {"4,3,8", "1,3,4", "none", "policy"}
    # A fixed shape: bs x tokens over its steps' seconds (143 steps of 3.25 ms at bs 1).
    assert table["4,3,8"][1] == pytest.approx(512 / (143 * 3.25e-3))
    assert table["policy"][1] >= 0.9 * table["4,3,8"][1]
    assert table["policy"][64] >= 0.95 * table["1,3,4"][64]


def test_the_policy_runs_untimed_once_at_each_size_before_its_timed_runs(monkeypatch):
    """bench_e2e's warm-up round: the policy learns from it, the table leaves it out."""
    costs = policy_sim.measured_costs(bench_rows())
    real_replay = policy_sim.replay
    policy_runs: list[tuple[int, float]] = []

    def replay(costs, delays, tokens, choose, *args, **kwargs):
        result = real_replay(costs, delays, tokens, choose, *args, **kwargs)
        if isinstance(getattr(choose, "__self__", None), ShapePolicy):
            policy_runs.append((len(delays), result.seconds))
        return result

    monkeypatch.setattr(policy_sim, "replay", replay)
    table = policy_sim.compare_batch_sizes(costs, [TREE, CHAIN, NONE], [1, 16], 2, 64)
    assert [bs for bs, _ in policy_runs] == [1, 1, 1, 16, 16, 16]
    for bs, runs in ((1, policy_runs[:3]), (16, policy_runs[3:])):
        timed = sum(seconds for _, seconds in runs[1:])
        assert table["policy"][bs] == pytest.approx(2 * bs * 64 / timed)


def test_the_seeds_table_prints_mean_cells_and_the_policys_worst_and_mean_ratio(capsys):
    tables = [
        {"1,3,4": {4: 100.0}, "none": {4: 80.0}, "policy": {4: 90.0}},
        {"1,3,4": {4: 120.0}, "none": {4: 80.0}, "policy": {4: 120.0}},
    ]
    policy_sim.print_batch_sizes(tables)
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == [
        "bs",
        "1,3,4",
        "none",
        "policy",
        "policy/best",
        "(worst,",
        "mean)",
    ]
    # Means 110 / 80 / 105; the policy's ratios 0.9 and 1.0 to the best fixed shape.
    assert row.split() == ["4", "110.0", "80.0", "105.0", "0.900", "0.950"]


def test_a_closed_loop_holds_the_batch_at_each_phases_level():
    """levels: request i comes in once fewer than levels[i] are present, so a fixed shape's
    steps run at exactly the phases' sizes, however long a step takes."""
    costs = policy_sim.measured_costs(bench_rows())
    stair = bench_e2e.StairLoad.parse("1x2,4x8,1x2")
    tokens, levels = stair.tokens(10), stair.levels()
    sizes = []

    def chain_recording(bs):
        sizes.append(bs)
        return CHAIN

    run = policy_sim.replay(
        costs, [0.0] * len(tokens), tokens, chain_recording, levels=levels
    )
    # 10 tokens at 2.5 a step: 4 steps a request. Request 0 alone; request 1 waits for it,
    # and with it in come three of the 4-level phase; then four more; the phase's last
    # request runs alone, the 1-level requests after it wait for fewer than one present.
    assert sizes == [1] * 4 + [4] * 8 + [1] * 12
    assert run.tok_per_s == pytest.approx(
        sum(tokens) / (16 * costs.seconds(CHAIN, 1) + 8 * costs.seconds(CHAIN, 4))
    )


def test_on_a_closed_loop_stair_the_policy_beats_every_fixed_shape():
    costs = policy_sim.measured_costs(bench_rows())
    stair = bench_e2e.StairLoad.parse("1x8,4x16,64x128,4x16,1x8")
    tokens = stair.tokens(128)
    runs = policy_sim.compare(
        costs, [TREE, CHAIN, NONE], [0.0] * len(tokens), tokens, levels=stair.levels()
    )
    best_fixed = max(r.tok_per_s for label, r in runs.items() if label != "policy")
    assert runs["policy"].tok_per_s > 1.05 * best_fixed
    assert runs["policy"].steps_by_shape.keys() >= {"1,3,4", "4,3,8"}


def test_the_oracle_runs_the_best_shape_at_each_size_and_bounds_the_policy():
    costs = policy_sim.measured_costs(bench_rows())
    choose = policy_sim.best_at_each_size(costs, [TREE, CHAIN, NONE])
    # narrow 3.6 / (3 + 0.25 bs) ms, chain 2.5 / (3 + 0.04 bs), none 1 / (2 + 0.01 bs)
    assert [choose(bs) for bs in (1, 4, 64)] == [TREE, TREE, CHAIN]
    stair = bench_e2e.StairLoad.parse("1x8,4x16,64x128,4x16,1x8")
    tokens, delays = stair.tokens(128), [0.0] * stair.total_requests
    oracle = policy_sim.replay(costs, delays, tokens, choose, levels=stair.levels())
    runs = policy_sim.compare(
        costs, [TREE, CHAIN, NONE], delays, tokens, levels=stair.levels()
    )
    assert all(oracle.tok_per_s >= r.tok_per_s for r in runs.values())
