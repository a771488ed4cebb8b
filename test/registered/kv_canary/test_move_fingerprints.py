"""move_fingerprints: fingerprints follow the K/V in accepted-path compaction, overlap-safe."""

from __future__ import annotations

import random

import torch
from test_reference import Pools

from sglang.srt.kv_canary import api
from sglang.srt.kv_canary.tables import RequestRecord, move_fingerprints


def _group(n=16):
    record = RequestRecord(torch.zeros(2, 4, dtype=torch.int32))
    group = record.register_group(
        object(), "target", is_draft=False, token_offset=0, num_slots=n
    )
    group.slot_fp.copy_(torch.arange(n) * 10 + 1)
    group.slot_writer.copy_(torch.arange(n) * 100)
    return group


def test_shift_down_by_one_reads_every_source_before_overwriting():
    """A path that skips one node: sources shift down, each slot is both a source and a target."""
    group = _group()
    move_fingerprints(group, torch.tensor([3, 4, 5]), torch.tensor([4, 5, 6]))
    assert group.slot_fp[3:7].tolist() == [41, 51, 61, 61]
    assert group.slot_writer[3:7].tolist() == [400, 500, 600, 600]


def test_matches_gather_then_scatter_on_random_moves():
    rng = random.Random(0)
    for _ in range(50):
        group = _group(32)
        k = rng.randrange(0, 10)
        tgt = rng.sample(
            range(32), k
        )  # targets are distinct (one slot per accepted position)
        src = [rng.randrange(32) for _ in range(k)]
        expected = group.slot_fp.clone()
        expected[tgt] = group.slot_fp.clone()[src]
        move_fingerprints(
            group,
            torch.tensor(tgt, dtype=torch.int64),
            torch.tensor(src, dtype=torch.int64),
        )
        assert torch.equal(group.slot_fp, expected)


def test_empty_and_identity_moves_change_nothing():
    group = _group()
    before = group.slot_fp.clone()
    move_fingerprints(
        group, torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)
    )
    move_fingerprints(group, torch.tensor([2, 7]), torch.tensor([2, 7]))
    assert torch.equal(before, group.slot_fp)


def _tree_round(pools: Pools, path_nodes: list[int], moved_from: list[int]):
    """Row 1 has 4 committed positions; verify writes a 5-node tree at slots of positions 4..8,
    node j at depth depths[j]; the accepted path is moved to the front, then checked."""
    depths = [0, 1, 1, 2, 2]
    tokens = [50, 61, 62, 71, 72]
    pools.place(1, 9, tag=9)
    pools.write(1, [0, 1, 2, 3], [1, 2, 3, 4])
    slots = pools.record.req_to_token[1, 4:9].to(torch.int64)
    from sglang.srt.kv_canary import reference
    from sglang.srt.kv_canary.contract import FingerprintWrite

    reference.write_fingerprints(
        pools.record,
        pools.target,
        pools.target,
        FingerprintWrite(
            out_cache_loc=slots,
            positions=torch.tensor([4 + d for d in depths]),
            input_ids=torch.tensor(tokens),
            req_pool_indices=torch.tensor([1]),
            token_batch_rows=None,
            tokens_per_row=5,
            live_rows=torch.tensor([1], dtype=torch.int32),
            record_tokens=False,  # verify is speculative
        ),
    )
    tgt = slots[: len(path_nodes)]
    move_fingerprints(pools.target, tgt, slots[moved_from])
    # the next draft extend records the committed tokens of the accepted path
    accepted = [tokens[j] for j in path_nodes]
    pools.record.token_at[1, 4 : 4 + len(accepted)] = torch.tensor(
        accepted, dtype=torch.int32
    )
    return pools.check([1], [4 + len(path_nodes)])


def test_compacted_tree_path_verifies():
    path = [0, 2, 4]  # root, node 2 (depth 1), node 4 (depth 2)
    assert int(_tree_round(Pools(), path, moved_from=path).count) == 0


def test_a_move_that_copied_the_wrong_slot_is_caught():
    """Moving node 3 instead of node 4 (same depth, another token) leaves position 6 wrong."""
    sink = _tree_round(Pools(), [0, 2, 4], moved_from=[0, 2, 3])
    assert int(sink.count) == 1 and int(sink.records[0, 2]) == 6


def test_a_missing_move_is_caught():
    """Without the move, position 5's slot still holds node 1 (a sibling of the accepted node)."""
    sink = _tree_round(Pools(), [0, 2, 4], moved_from=[0, 1, 2])
    assert int(sink.count) == 2


def test_api_moves_by_pool():
    from canary_sim import SimEngine

    engine = SimEngine(seed=1, topk=2, num_steps=2, num_draft_tokens=4)
    req = engine.admit(6)
    a, b = (int(engine.r2t[req.row, p]) for p in (1, 2))
    fp_b, draft_a = int(engine.target.group.slot_fp[b]), int(
        engine.draft.group.slot_fp[a]
    )
    api.on_kv_move(engine.target_pool, torch.tensor([a]), torch.tensor([b]))
    assert int(engine.target.group.slot_fp[a]) == fp_b
    assert (
        int(engine.draft.group.slot_fp[a]) == draft_a
    )  # only the moved pool's group changes
