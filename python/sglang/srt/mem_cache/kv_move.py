"""KV-cache row moves for every pool kind: `pool.move_kv_cache(tgt_loc, src_loc)`.

Spec v2 tree drafting moves each request's accepted tree path to the front of its block after
verify (sglang.srt.speculative.tree_compaction). Every pool gives a move the same meaning:
afterwards slot tgt_loc[i] holds what slot src_loc[i] held BEFORE the call, for every i. The
moves are gathered before they are scattered, so a slot that is one move's source and another
move's target (a path that skips a node shifts its later nodes down) is read before it is
overwritten. Targets must be distinct; a slot that does not move may be given as tgt == src.

A slot outside the pool is an error, never a silent write: a negative slot would otherwise
wrap around to the end of a buffer. On CUDA the check is an async device assert (no host
sync in the decode loop); on CPU it raises IndexError.

memory_pool.py calls in here from thin call sites (the spec-kv-moves-for-all-pools patch);
this module imports only torch, triton and sglang.srt.utils (which memory_pool.py imports
first) at load time, so memory_pool.py can import it without a cycle.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from sglang.srt.utils.eager_jit import eager_jit

# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def check_slots_in_range(loc: torch.Tensor, num_slots: int, what: str) -> None:
    """Fail unless every slot in `loc` lies in [0, num_slots). Empty `loc` passes."""
    if loc.numel() == 0:
        return
    if loc.device.type == "cpu":
        bad = (loc < 0) | (loc >= num_slots)
        if bool(bad.any()):
            flat = loc.reshape(-1)
            pos = int(bad.reshape(-1).nonzero()[0, 0])
            raise IndexError(
                f"{what}: slot {int(flat[pos])} (position {pos}) is outside the pool's "
                f"slots [0, {num_slots})"
            )
        return
    _launch_slot_check(loc.reshape(-1), loc.reshape(-1), loc.numel(), num_slots)


def check_move_in_range(
    tgt_loc: torch.Tensor, src_loc: torch.Tensor, num_slots: int, what: str
) -> None:
    """check_slots_in_range for a move's targets and sources (same length), in one kernel
    on CUDA: the decode loop at small batch is bound by launches on the host."""
    if tgt_loc.device.type == "cpu":
        check_slots_in_range(tgt_loc, num_slots, f"{what} tgt_loc")
        check_slots_in_range(src_loc, num_slots, f"{what} src_loc")
        return
    if tgt_loc.numel() == 0:
        return
    _launch_slot_check(
        tgt_loc.reshape(-1), src_loc.reshape(-1), tgt_loc.numel(), num_slots
    )


def _launch_slot_check(
    a: torch.Tensor, b: torch.Tensor, n: int, num_slots: int
) -> None:
    # Reading the verdict on the host would stall the decode loop on every verify. The device
    # assert traps in the stream ahead of the move kernels and leaves the CUDA context failed,
    # so nothing runs on the bad slot. One kernel: the torch spelling (ge, lt, and, all,
    # assert) is five per tensor.
    block = 1024
    _assert_slots_in_range_kernel[(triton.cdiv(n, block),)](
        a, b, n, num_slots, BLOCK=block
    )


# debug=True compiles device_assert in (it is dropped otherwise). The message is fixed at
# compile time, so it names the check, not the pool: the caller's traceback names the pool.
@eager_jit(debug=True)
def _assert_slots_in_range_kernel(a_ptr, b_ptr, n, num_slots, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offsets, mask=offsets < n, other=0)
    b = tl.load(b_ptr + offsets, mask=offsets < n, other=0)
    in_range = (a >= 0) & (a < num_slots) & (b >= 0) & (b < num_slots)
    tl.device_assert(in_range, "move_kv_cache: a slot is outside the pool")


def pool_slot_count(pool) -> int:
    # Token buffers hold size + page_size rows: slot 0 (the first page) takes padded tokens'
    # dummy writes, and real slots run up to size + page_size - 1.
    return pool.size + pool.page_size


def validate_pool_move(
    pool,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
    num_slots: Optional[int] = None,
) -> bool:
    """Check a move on `pool` whose buffers hold `num_slots` token slots (default: all of
    the pool's slots, pool_slot_count).

    Returns False when there is nothing to move: a pool without layers, or no moves.
    """
    # The full sub-pool of an all-SWA model (layer_num == 0) owns no buffers at all.
    if pool.layer_num == 0:
        return False
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(
            f"{type(pool).__name__}.move_kv_cache: {tgt_loc.numel()} targets but "
            f"{src_loc.numel()} sources"
        )
    if tgt_loc.numel() == 0:
        return False
    if num_slots is None:
        num_slots = pool_slot_count(pool)
    check_move_in_range(
        tgt_loc, src_loc, num_slots, f"{type(pool).__name__}.move_kv_cache"
    )
    return True


# ---------------------------------------------------------------------------------------------
# Raw moves (slots already checked)
# ---------------------------------------------------------------------------------------------


def _flat_long(loc: torch.Tensor) -> torch.Tensor:
    return loc.reshape(-1).to(torch.int64)


def move_token_rows(
    buffers: Sequence[torch.Tensor], tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """buffer[tgt_loc] = buffer[src_loc] for every buffer indexed by token slot on dim 0.

    Slots must be checked first (validate_pool_move): a negative one would wrap around.
    """
    if tgt_loc.numel() == 0:
        return
    tgt, src = _flat_long(tgt_loc), _flat_long(src_loc)
    for buf in buffers:
        # index_select materialises every source row before index_copy_ writes a target.
        buf.index_copy_(0, tgt, buf.index_select(0, src))


def move_paged_index_k_rows(
    buf: torch.Tensor,
    page_size: int,
    k_bytes_per_token: int,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Token-granular move inside NSA's page-granular indexer cache.

    buf is [num_pages, page_size * (k_bytes + s_bytes)] uint8 and splits every page into two
    blocks (index_buf_accessor.SetK / SetS): first the fp8 K of all page_size tokens, token o at
    bytes [o * k_bytes, (o + 1) * k_bytes), then their fp32 scales, token o at
    [page_size * k_bytes + o * s_bytes, ...). So a token's bytes are not one row; view each
    block as [page, offset, bytes] and move (page, offset) pairs in both.
    """
    if tgt_loc.numel() == 0:
        return
    num_pages, page_bytes = buf.shape
    token_bytes, rem = divmod(page_bytes, page_size)
    s_bytes = token_bytes - k_bytes_per_token
    if rem or s_bytes <= 0:
        raise ValueError(
            f"indexer page of {page_bytes} bytes does not hold {page_size} tokens of "
            f"{k_bytes_per_token} K bytes plus a scale"
        )
    k_block = buf[:, : page_size * k_bytes_per_token].view(
        num_pages, page_size, k_bytes_per_token
    )
    s_block = buf[:, page_size * k_bytes_per_token :].view(
        num_pages, page_size, s_bytes
    )

    tgt, src = _flat_long(tgt_loc), _flat_long(src_loc)
    tgt_page, tgt_off = tgt // page_size, tgt % page_size
    src_page, src_off = src // page_size, src % page_size
    for block in (k_block, s_block):
        # The gather (advanced indexing) copies before the scatter writes: overlap-safe.
        block[tgt_page, tgt_off] = block[src_page, src_off]


# ---------------------------------------------------------------------------------------------
# Per-pool moves (called from memory_pool.py)
# ---------------------------------------------------------------------------------------------


def mha_row_buffers(pool) -> list:
    """Every per-token buffer of an MHA pool, FP4 block scales included."""
    # MHATokenToKVPoolFP4 stores packed K/V plus per-token scales in k/v_scale_buffer; moving
    # the data without its scales would dequantise with another token's scale.
    return [
        *pool.k_buffer,
        *pool.v_buffer,
        *getattr(pool, "k_scale_buffer", ()),
        *getattr(pool, "v_scale_buffer", ()),
    ]


def move_mla_kv(pool, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """MLATokenToKVPool (and FP4): latent and rope share one kv_buffer row per token."""
    if not validate_pool_move(pool, tgt_loc, src_loc):
        return
    # MLATokenToKVPoolFP4 keeps per-token scales in kv_scale_buffer, rows indexed like kv_buffer.
    move_token_rows(
        [*pool.kv_buffer, *getattr(pool, "kv_scale_buffer", ())], tgt_loc, src_loc
    )


def _refuse_unsupported_nsa_layouts(pool) -> None:
    # HiSparse keeps kv_buffer rows at device slots translated from the logical slots the
    # indexer cache uses; a move would need both spaces. Not needed by tree drafting yet.
    if hasattr(pool, "translate_loc_to_hisparse_device"):
        raise NotImplementedError(
            f"{type(pool).__name__}.move_kv_cache: HiSparse NSA pools are not supported"
        )
    # ROCm's aiter preshuffle layout reorders bytes inside a page (MFMA 16x16 tiles); the
    # token-granular move below knows only the plain K block + scale block layout.
    from sglang.srt.layers.attention.nsa.utils import aiter_can_use_preshuffle_paged_mqa

    if aiter_can_use_preshuffle_paged_mqa():
        raise NotImplementedError(
            f"{type(pool).__name__}.move_kv_cache: aiter preshuffle indexer layout"
        )


def move_nsa_kv(pool, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """NSATokenToKVPool: the MLA kv_buffer rows plus the indexer's K and scale bytes."""
    _refuse_unsupported_nsa_layouts(pool)
    num_slots = pool_slot_count(pool)
    if pool.index_k_with_scale_buffer:
        # The indexer cache is sized separately (index_buf_size, rounded to pages); a slot
        # must be valid in both caches.
        index_slots = pool.index_k_with_scale_buffer[0].shape[0] * pool.page_size
        num_slots = min(num_slots, index_slots)
    if not validate_pool_move(pool, tgt_loc, src_loc, num_slots):
        return
    move_token_rows(pool.kv_buffer, tgt_loc, src_loc)
    for buf in pool.index_k_with_scale_buffer:
        move_paged_index_k_rows(
            buf, pool.page_size, pool.index_head_dim, tgt_loc, src_loc
        )
