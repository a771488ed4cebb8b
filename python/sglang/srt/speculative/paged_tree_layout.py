"""Spec v2 tree drafting with --page-size > 1: the draft's KV layout and what a decode step
allocates (design: docs/paged-trees.md).

Spec v2 lays a tree round out "flat" at every page size: request b's draft branch t writes
its step s at position `seq_len + t * num_steps + s` of its req_to_token row, verify writes
tree node j at `seq_len + j`, compaction moves the accepted path to `seq_len + i`. Backends
that read KV by token slot (triton, and flashinfer, which plans pages of one token) read that
layout at any page size; the page allocator only decides which slots the positions get.

Two things read the layout or its size and must agree with it:
- the multi-step draft backends' KV-index kernel (spec_utils.generate_draft_decode_kv_indices)
  takes the page size that branches are laid out by: 1 on spec v2, whose draft writes them flat
  (eagle_info_v2.assign_draft_cache_locs_page_size_1); the page size on spec v1, whose draft
  gives each branch its own pages (spec_utils.assign_draft_cache_locs);
- the per-step allocation (managers.utils.get_alloc_len_per_decode) and the req_to_token row
  width, which must hold every position a round writes;
- a backend that reads KV through a page table (FA3: `req_to_token[:, ::P] // P` and the
  last page's length) sees a branch as page-contiguous only if it owns its pages, which the flat
  layout does not give it. On spec v2 trees FA3 plans with pages of one token instead
  (attention_page_size): its page table is then req_to_token itself, which reads any
  position-to-slot map, as triton and flashinfer read it.
"""

from __future__ import annotations

import torch


def draft_branch_page_size(page_size: int, topk: int, spec_v2: bool) -> int:
    """The page size the draft-decode KV indices lay tree branches out by: 1 (flat) on spec v2
    and for chains, which have one branch; the page size for spec v1 trees."""
    if spec_v2 or topk == 1:
        return 1
    return page_size


def draft_branch_page_size_of(server_args) -> int:
    """draft_branch_page_size for a resolved ServerArgs: spec v2 is the overlap scheduler."""
    return draft_branch_page_size(
        server_args.page_size,
        server_args.speculative_eagle_topk or 1,
        spec_v2=not server_args.disable_overlap_schedule,
    )


def alloc_len_per_decode(topk: int, num_steps: int, num_draft_tokens: int) -> int:
    """Positions past seq_len one spec v2 round writes, at any page size: topk * num_steps
    draft slots (flat branches), num_draft_tokens verify / draft-extend rows. Page rounding is
    the allocator's (alloc_extend continues the partial last page) and the scheduler's
    estimate's (ceil_align of the allocated length)."""
    return max(topk * num_steps, num_draft_tokens)


# Slack upstream keeps past the context length in every req_to_token row.
UPSTREAM_ROW_SLACK = 4

# The algorithms whose spec v2 worker drafts trees (the hook's EAGLE family).
_TREE_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "STANDALONE"})


def req_to_token_extra_len(num_draft_tokens: int, alloc_len: int) -> int:
    """Positions a spec v2 tree request's req_to_token row needs past the context length.

    Before each step spec v2 extends the row to kv_committed_len + 2 * alloc_len, and
    kv_committed_len (one round behind, plus the step's pre-claimed bonus) gets within a few
    tokens of the context length. Upstream's rows hold UPSTREAM_ROW_SLACK + num_draft_tokens
    past it, which a tree whose 2 * alloc_len is larger would overrun into the next row.
    """
    return UPSTREAM_ROW_SLACK + max(num_draft_tokens, 2 * alloc_len)


def runs_spec_v2_trees(server_args) -> bool:
    """Whether a resolved ServerArgs drafts trees on spec v2 (the hook has chosen the
    scheduler by the time any model runner reads this), at some step of a shape policy.
    """
    from sglang.srt.speculative.shape_runtime import carried_topk

    return (
        server_args.speculative_algorithm in _TREE_ALGORITHMS
        and carried_topk(server_args) > 1
        and not server_args.disable_overlap_schedule
    )


def req_to_token_extra_len_of(server_args) -> int:
    """The row slack for a resolved ServerArgs: upstream's unless it runs spec v2 trees."""
    from sglang.srt.speculative.shape_runtime import (
        reserved_alloc_len,
        reserved_num_draft_tokens,
    )

    if server_args.speculative_num_draft_tokens is None:
        return UPSTREAM_ROW_SLACK
    num_draft_tokens = reserved_num_draft_tokens(server_args)
    if not runs_spec_v2_trees(server_args):
        return UPSTREAM_ROW_SLACK + num_draft_tokens
    return req_to_token_extra_len(num_draft_tokens, reserved_alloc_len(server_args))


def attention_page_size(page_size: int, spec_v2_trees: bool) -> int:
    """The page size a page-table attention backend (FA3) plans with: 1 on spec v2 trees,
    whose flat draft branches share pages; the pool's page size otherwise.

    Pages of one token read the same KV (a pool of pages of P tokens is a pool of tokens,
    slot = page * P + offset); they cost a page table P times longer, and nothing else
    changes: the allocator, the radix cache and the scheduler's page accounting keep P.
    """
    return 1 if spec_v2_trees else page_size


def attention_page_size_of(server_args, page_size: int) -> int:
    """attention_page_size for a resolved ServerArgs and the pool's page size."""
    return attention_page_size(page_size, runs_spec_v2_trees(server_args))


def flat_draft_positions(
    seq_lens: torch.Tensor, topk: int, num_steps: int
) -> torch.Tensor:
    """[bs, topk, num_steps] int64: the position draft branch t writes at step s,
    seq_len + t * num_steps + s (the reference for the draft's out_cache_loc)."""
    offsets = torch.arange(topk * num_steps, dtype=torch.int64, device=seq_lens.device)
    return (seq_lens.to(torch.int64)[:, None] + offsets).view(-1, topk, num_steps)


def draft_decode_kv_positions(
    seq_len: int, topk_id: int, forward_index: int, num_steps: int
) -> list[int]:
    """Positions that draft-decode forward `forward_index` (0 .. num_steps - 2; the first
    tokens come from the previous draft extend's logits) attends over for branch topk_id: the
    committed prefix, then the branch's slots up to the one this forward writes."""
    own = seq_len + topk_id * num_steps
    return list(range(seq_len)) + list(range(own, own + forward_index + 1))
