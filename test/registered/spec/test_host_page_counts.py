"""mem_cache.host_page_counts: the page count spec v2's paged decode step hands the allocator
must be the count the allocator would make itself, and reach only allocators that take it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.mem_cache import common
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.host_page_counts import (
    num_new_pages,
    page_count_kwargs,
    pages_of,
)
from sglang.srt.mem_cache.swa_memory_pool import SWATokenToKVPoolAllocator
from sglang.srt.utils import get_num_new_pages


def upstream_count(before: list[int], after: list[int], page_size: int) -> int:
    return get_num_new_pages(
        seq_lens=torch.tensor(after, dtype=torch.int32),
        page_size=page_size,
        prefix_lens=torch.tensor(before, dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "before,after,page_size,expected",
    [
        ([0], [1], 16, 1),  # an empty request opens its first page
        ([16], [16], 16, 0),  # nothing grows
        ([16], [17], 16, 1),  # at a page boundary: the next token opens a page
        ([15], [16], 16, 0),  # filling the partial last page
        ([5], [70], 16, 4),  # mid-page to mid-page across pages: 1 -> 5
        ([5, 16, 31], [37, 16, 33], 16, 2 + 0 + 1),  # a batch sums its requests
        ([7], [8], 1, 1),  # page size 1: one page per token
    ],
)
def test_crafted_counts(before, after, page_size, expected):
    assert num_new_pages(before, after, page_size) == expected
    assert upstream_count(before, after, page_size) == expected


def test_random_batches_match_upstreams_count():
    rng = random.Random(0)
    for _ in range(500):
        page_size = rng.choice([2, 4, 16, 64])
        bs = rng.choice([1, 2, 8, 48])
        before = [rng.randrange(0, 4096) for _ in range(bs)]
        after = [
            b + rng.choice([0, 1, page_size, rng.randrange(0, 200)]) for b in before
        ]
        assert num_new_pages(before, after, page_size) == upstream_count(
            before, after, page_size
        ), (before, after, page_size)


def test_pages_of():
    assert [pages_of(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_lengths_of_different_batches_are_refused():
    with pytest.raises(ValueError, match="2 lengths before and 1 after"):
        num_new_pages([1, 2], [3], 16)


def test_only_allocators_that_take_a_count_get_it():
    paged = object.__new__(PagedTokenToKVPoolAllocator)
    swa = object.__new__(SWATokenToKVPoolAllocator)
    assert page_count_kwargs(paged, 3) == {"num_new_pages": 3}
    assert page_count_kwargs(paged, 0) == {"num_new_pages": 0}
    assert page_count_kwargs(paged, None) == {}
    # SWA counts its two pools' pages itself; its alloc_extend takes no count.
    assert page_count_kwargs(swa, 3) == {}
    assert page_count_kwargs(object(), 3) == {}


class RecordingAllocator:
    page_size = 16

    def __init__(self):
        self.calls = []

    def alloc_extend(self, *args, num_new_pages=None):
        self.calls.append(num_new_pages)
        return torch.zeros(args[-1], dtype=torch.int64)


@pytest.mark.parametrize("count", [None, 0, 5])
def test_alloc_paged_token_slots_extend_forwards_the_count(monkeypatch, count):
    allocator = RecordingAllocator()
    tree_cache = SimpleNamespace(token_to_kv_pool_allocator=allocator)
    monkeypatch.setattr(common, "evict_from_tree_cache", lambda *args: None)
    lens = torch.tensor([3], dtype=torch.int32)
    kwargs = {} if count is None else {"num_new_pages": count}
    out = common.alloc_paged_token_slots_extend(
        tree_cache, lens, lens, lens + 4, lens + 4, lens - 1, 4, **kwargs
    )
    assert out.shape == (4,)
    assert allocator.calls == [count]
