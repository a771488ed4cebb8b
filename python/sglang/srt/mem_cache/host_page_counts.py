"""Page counts of a paged extend, from host lengths the caller already holds as Python ints.

The paged allocator's alloc_extend counts the pages an extend opens (get_num_new_pages) with
five small torch ops over CPU tensors, on every call. Spec v2's decode step allocates through
it every step when --page-size > 1, and it builds those tensors from per-request ints it has
just computed; at small batch sizes that loop is bound by host work, so the count is made
from the ints there (a sum over the batch) and handed to the allocator.

Only allocators whose alloc_extend takes `num_new_pages` get it: the SWA and hisparse
allocators count their own pools' pages and keep doing so.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional, Sequence


def pages_of(num_tokens: int, page_size: int) -> int:
    """Pages that hold num_tokens KV rows laid out from a page boundary."""
    return -(-num_tokens // page_size)


def num_new_pages(
    lens_before: Sequence[int], lens_after: Sequence[int], page_size: int
) -> int:
    """Pages opened by growing request i from lens_before[i] to lens_after[i] KV rows: what
    get_num_new_pages(seq_lens=after, page_size, prefix_lens=before) returns."""
    if len(lens_before) != len(lens_after):
        raise ValueError(
            f"{len(lens_before)} lengths before and {len(lens_after)} after"
        )
    return sum(
        pages_of(after, page_size) - pages_of(before, page_size)
        for before, after in zip(lens_before, lens_after)
    )


@functools.cache
def takes_page_count(allocator_type: type) -> bool:
    """Whether allocator_type.alloc_extend accepts a precomputed num_new_pages."""
    alloc_extend = getattr(allocator_type, "alloc_extend", None)
    if alloc_extend is None:
        return False
    return "num_new_pages" in inspect.signature(alloc_extend).parameters


def page_count_kwargs(allocator: object, count: Optional[int]) -> dict[str, int]:
    """The keyword arguments that hand `count` to allocator.alloc_extend: none when there is
    no count or the allocator counts for itself."""
    if count is None or not takes_page_count(type(allocator)):
        return {}
    return {"num_new_pages": count}
