"""Spec v2 trees with --page-size > 1 (docs/paged-trees.md): the layout and accounting helpers
of paged_tree_layout, and (through triton's interpreter) decode rounds on the real paged
allocator and kernels (paged_tree_cases.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import paged_tree_cases
import pytest
import torch

from sglang.srt.speculative.paged_tree_layout import (
    UPSTREAM_ROW_SLACK,
    alloc_len_per_decode,
    attention_page_size_of,
    draft_branch_page_size,
    draft_branch_page_size_of,
    draft_decode_kv_positions,
    flat_draft_positions,
    req_to_token_extra_len_of,
)
from specpatch.testing.interpret import interpreter_suite

HERE = Path(__file__).resolve().parent
NAMES = [
    f"test_rounds_keep_layout_and_accounting[{c.name}]" for c in paged_tree_cases.CASES
] + ["test_spec_v1_branch_layout_reads_other_slots_than_v2_writes"]

# Upstream's generate_draft_decode_kv_indices and alloc_extend_kernel bound loops by loaded
# values, which the interpreter runs with a numpy deprecation warning (numpy 2.5 refuses).
interpreter_run, test_rounds_under_interpreter = interpreter_suite(
    HERE / "paged_tree_cases.py", NAMES, strict_numpy=False
)


@pytest.mark.parametrize(
    "page_size,topk,spec_v2,expected",
    [
        (16, 4, True, 1),  # spec v2 trees: flat branches at every page size
        (16, 4, False, 16),  # spec v1 trees: each branch in its own pages
        (16, 1, False, 1),  # a chain has one branch
        (1, 4, False, 1),
    ],
)
def test_draft_branch_page_size(page_size, topk, spec_v2, expected):
    assert draft_branch_page_size(page_size, topk, spec_v2) == expected


def test_draft_branch_page_size_of_reads_the_scheduler_choice():
    args = SimpleNamespace(
        page_size=64, speculative_eagle_topk=8, disable_overlap_schedule=False
    )
    assert draft_branch_page_size_of(args) == 1
    args.disable_overlap_schedule = True
    assert draft_branch_page_size_of(args) == 64


@pytest.mark.parametrize(
    "topk,steps,tokens,expected",
    [(4, 3, 8, 12), (16, 3, 32, 48), (2, 1, 3, 3), (8, 5, 9, 40), (1, 3, 4, 4)],
)
def test_alloc_len_is_the_larger_of_draft_and_verify(topk, steps, tokens, expected):
    assert alloc_len_per_decode(topk, steps, tokens) == expected


def test_flat_draft_positions_follow_each_other_branch_by_branch():
    positions = flat_draft_positions(torch.tensor([5, 16]), topk=3, num_steps=2)
    assert positions.shape == (2, 3, 2)
    assert positions[0].tolist() == [[5, 6], [7, 8], [9, 10]]
    assert positions[1, 2].tolist() == [20, 21]


def test_draft_decode_reads_the_prefix_then_its_branch():
    assert draft_decode_kv_positions(3, topk_id=1, forward_index=1, num_steps=4) == [
        0,
        1,
        2,
        7,
        8,
    ]


def _server_args(**overrides):
    args = dict(
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=16,
        speculative_num_steps=3,
        speculative_num_draft_tokens=32,
        disable_overlap_schedule=False,
    )
    args.update(overrides)
    return SimpleNamespace(**args)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            {},
            1,
        ),  # spec v2 trees: fa3 reads the flat branches through pages of one token
        (dict(disable_overlap_schedule=True), 64),  # spec v1: branches own their pages
        (dict(speculative_eagle_topk=1, speculative_num_steps=3), 64),  # chains
        (dict(speculative_algorithm="NGRAM"), 64),
        (
            dict(
                speculative_algorithm=None,
                speculative_eagle_topk=None,
                speculative_num_draft_tokens=None,
            ),
            64,
        ),
    ],
    ids=["tree-v2", "tree-v1", "chain", "ngram", "no-spec"],
)
def test_attention_page_size_is_one_only_for_spec_v2_trees(overrides, expected):
    assert attention_page_size_of(_server_args(**overrides), 64) == expected


def test_tree_rows_hold_two_allocations_past_the_context():
    # alloc_len 48: the row reaches kv_committed_len + 96
    assert req_to_token_extra_len_of(_server_args()) == UPSTREAM_ROW_SLACK + 96


@pytest.mark.parametrize(
    "overrides",
    [
        dict(speculative_eagle_topk=1, speculative_num_steps=3),
        dict(disable_overlap_schedule=True),
        dict(speculative_algorithm="NGRAM"),
        dict(
            speculative_algorithm=None,
            speculative_eagle_topk=None,
            speculative_num_draft_tokens=None,
        ),
    ],
    ids=["chain", "spec-v1", "ngram", "no-spec"],
)
def test_other_rows_keep_upstreams_slack(overrides):
    args = _server_args(**overrides)
    expected = UPSTREAM_ROW_SLACK + (args.speculative_num_draft_tokens or 0)
    assert req_to_token_extra_len_of(args) == expected
