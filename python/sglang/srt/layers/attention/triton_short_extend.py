"""The query tile of triton's extend attention kernel for short extends.

A speculative verify extends each request by num_draft_tokens query rows (2 for chain 1,1,2,
4 for chain 1,3,4, 32 for tree 16,3,32) and a draft extend by as many; a prefill by hundreds.
Upstream sizes the kernel's query tile (BLOCK_M) for prefill: 128 rows on Hopper, 64 on most
other GPUs. One program runs per (request, head, tile), and each computes a BLOCK_M x BLOCK_N
score block against every prefix block: with 2 real rows in a 128-row tile, 98 % of that work
is masked out, and the verify's attention costs many times a decode step's at large batch.

A tile of the extend's own length (rounded up to a power of two, at least the 16 rows of the
smallest tensor-core tile) computes the same scores with the same prefix order, so the output is
the same up to the rounding of the dot products; small tiles run with 4 warps. It pays where
programs are many (a batch of requests times the heads): at bs 1 a lone program per head is
bound by how fast it walks the prefix, which upstream's 8-warp tile does faster, so a launch
of fewer than MIN_PROGRAMS (request, head) pairs keeps upstream's tile. The extend length must
be a host int: a device tensor (read without a sync) keeps upstream's tile too. Plain attention
whose rows fit one GQA tile goes to triton_split_prefix at every batch size; this tile serves
the rest (a logit cap, sinks, a sliding window, extends wider than that tile).

On by default; SGLANG_TRITON_SHORT_EXTEND_TILE=0 restores upstream's tile everywhere (for an
A/B, or should a GPU's triton mis-compile the small tile).
"""

from __future__ import annotations

import os

# The smallest query tile tl.dot takes.
MIN_BLOCK_M = 16
# Tiles up to this many rows run with 4 warps.
SMALL_TILE_ROWS = 32
# (request, head) pairs from which short tiles are faster: bs 8 of a 32-head model.
MIN_PROGRAMS = 256


def enabled_by_env(environ=os.environ) -> bool:
    """Short tiles unless SGLANG_TRITON_SHORT_EXTEND_TILE is "0"."""
    return environ.get("SGLANG_TRITON_SHORT_EXTEND_TILE", "1") != "0"


_ENABLED = enabled_by_env()


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def short_extend_launch(
    max_len_extend, batch_size: int, num_heads: int, block_m: int, num_warps: int
) -> tuple[int, int]:
    """(BLOCK_M, num_warps) for an extend of batch_size requests whose longest has
    max_len_extend query rows, given upstream's choice for prefill. Unchanged when the extend
    fills upstream's tile, the launch is small, or the length is not known on the host.
    """
    if (
        not _ENABLED
        or not isinstance(max_len_extend, int)
        or max_len_extend >= block_m
        or batch_size * num_heads < MIN_PROGRAMS
    ):
        return block_m, num_warps
    rows = max(MIN_BLOCK_M, _next_power_of_2(max_len_extend))
    if rows >= block_m:
        return block_m, num_warps
    return rows, (min(num_warps, 4) if rows <= SMALL_TILE_ROWS else num_warps)
