"""Accepted-path compaction (spec v2 tree drafting) against a plain per-request reference."""

from __future__ import annotations

import random

import pytest
import torch

from sglang.srt.speculative.tree_compaction import (
    AcceptedPathMoves,
    compact_accepted_tree_path,
    compact_rows,
    plan_accepted_path_moves,
)


class RecordingPool:
    """A one-layer KV pool on CPU whose move copies rows the way MHA's kernel does:
    every source is read before any target is written."""

    def __init__(self, num_slots: int, width: int = 3):
        self.kv = torch.randn(num_slots, width)
        self.moves: list[tuple[torch.Tensor, torch.Tensor]] = []

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        self.moves.append((tgt_loc.clone(), src_loc.clone()))
        self.kv[tgt_loc] = self.kv[src_loc].clone()


def reference_compaction(
    accept_index, num_draft_tokens, out_cache_loc, kv, predict, hidden
):
    """What compaction means, request by request: node accept_index[b, i] becomes row i."""
    kv, predict, hidden = kv.clone(), predict.clone(), hidden.clone()
    kv_before, predict_before, hidden_before = (
        kv.clone(),
        predict.clone(),
        hidden.clone(),
    )
    for b, path in enumerate(accept_index.tolist()):
        for i, row in enumerate(r for r in path if r >= 0):
            dst = b * num_draft_tokens + i
            kv[out_cache_loc[dst]] = kv_before[out_cache_loc[row]]
            predict[dst] = predict_before[row]
            hidden[dst] = hidden_before[row]
    return kv, predict, hidden


def random_paths(
    bs: int, num_draft_tokens: int, max_accept: int, rng: random.Random, lengths=None
):
    """accept_index as verify returns it: increasing tree nodes from the root, -1 padded."""
    accept_index = torch.full((bs, max_accept), -1, dtype=torch.int32)
    for b in range(bs):
        length = lengths[b] if lengths is not None else rng.randint(1, max_accept)
        nodes = [0] + sorted(rng.sample(range(1, num_draft_tokens), length - 1))
        accept_index[b, :length] = torch.tensor(nodes) + b * num_draft_tokens
    return accept_index


def run_case(accept_index: torch.Tensor, num_draft_tokens: int, seed: int = 0):
    bs = accept_index.shape[0]
    gen = torch.Generator().manual_seed(seed)
    num_slots = bs * num_draft_tokens + 17
    pool = RecordingPool(num_slots)
    # Each request's verify slots are scattered over the pool, as the allocator leaves them.
    out_cache_loc = torch.randperm(num_slots, generator=gen)[: bs * num_draft_tokens]
    predict = torch.randint(
        0, 1000, (bs * num_draft_tokens,), generator=gen, dtype=torch.int32
    )
    hidden = torch.randn(bs * num_draft_tokens, 5, generator=gen)
    expected = reference_compaction(
        accept_index, num_draft_tokens, out_cache_loc, pool.kv, predict, hidden
    )

    predict_before = predict.clone()
    bonus_tokens = compact_accepted_tree_path(
        accept_index=accept_index,
        num_draft_tokens=num_draft_tokens,
        verify_out_cache_loc=out_cache_loc,
        kv_pool=pool,
        predict=predict,
        hidden_states=hidden,
    )
    assert torch.equal(pool.kv, expected[0])
    assert torch.equal(predict, expected[1])
    assert torch.equal(hidden, expected[2])
    # The bonus token is the path's last node, as verify predicted it.
    last_nodes = [[r for r in path if r >= 0][-1] for path in accept_index.tolist()]
    assert bonus_tokens.dtype == torch.int32
    assert bonus_tokens.tolist() == predict_before[last_nodes].tolist()
    return pool


@pytest.mark.parametrize("bs", [1, 3, 48])
@pytest.mark.parametrize(
    "num_draft_tokens,max_accept", [(8, 4), (16, 6), (64, 6), (3, 2)]
)
def test_random_paths_match_the_reference(bs, num_draft_tokens, max_accept):
    rng = random.Random(bs * 1000 + num_draft_tokens)
    for trial in range(5):
        run_case(
            random_paths(bs, num_draft_tokens, max_accept, rng),
            num_draft_tokens,
            seed=trial,
        )


def test_nothing_accepted_moves_nothing():
    accept_index = random_paths(4, 8, 4, random.Random(0), lengths=[1, 1, 1, 1])
    pool = run_case(accept_index, 8)
    tgt, src = pool.moves[0]
    assert torch.equal(tgt, src)


def test_everything_accepted_along_a_deep_branch():
    # the longest path, through the last nodes of the tree: every kept row moves
    accept_index = torch.tensor([[0, 5, 6, 7], [8, 13, 14, 15]], dtype=torch.int32)
    pool = run_case(accept_index, 8)
    tgt, src = pool.moves[0]
    assert (tgt != src).sum() == 6


def test_chain_prefix_is_already_compact():
    accept_index = torch.tensor([[0, 1, 2, -1]], dtype=torch.int32)
    moves = plan_accepted_path_moves(accept_index, 8)
    assert torch.equal(moves.dst_rows, moves.src_rows)


def test_ragged_paths_and_sources_that_are_also_targets():
    # request 0 skips node 1: sources 2, 3 are targets 1, 2 of the same move
    accept_index = torch.tensor(
        [[0, 2, 3, -1], [4, -1, -1, -1], [8, 9, 11, -1]], dtype=torch.int32
    )
    run_case(accept_index, 4)


def test_moves_are_fixed_size_and_identity_past_the_path():
    accept_index = torch.tensor([[0, 3, -1], [4, 5, 6]], dtype=torch.int32)
    moves = plan_accepted_path_moves(accept_index, 4)
    assert moves.dst_rows.tolist() == [0, 1, 2, 4, 5, 6]
    assert moves.src_rows.tolist() == [0, 3, 2, 4, 5, 6]
    assert moves.dst_rows.dtype == moves.src_rows.dtype == torch.int64


def test_hidden_states_may_be_absent():
    pool = RecordingPool(16)
    predict = torch.arange(8, dtype=torch.int32)
    compact_accepted_tree_path(
        accept_index=torch.tensor([[0, 2], [4, 7]], dtype=torch.int32),
        num_draft_tokens=4,
        verify_out_cache_loc=torch.arange(8),
        kv_pool=pool,
        predict=predict,
        hidden_states=None,
    )
    assert predict.tolist() == [0, 2, 2, 3, 4, 7, 6, 7]


def test_a_path_longer_than_the_block_is_refused():
    with pytest.raises(ValueError, match="does not fit a block of 2 draft tokens"):
        plan_accepted_path_moves(torch.zeros((1, 3), dtype=torch.int32), 2)


def test_dummy_moves_are_identity():
    moves = AcceptedPathMoves.make_dummy(bs=2, max_accept=3, num_draft_tokens=5)
    rows = torch.arange(10)
    compact_rows(rows, moves)
    assert rows.tolist() == list(range(10))
    assert moves.dst_rows.tolist() == [0, 1, 2, 5, 6, 7]
