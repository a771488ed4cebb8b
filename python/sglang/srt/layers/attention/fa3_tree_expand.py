"""The draft-token half of FA3's tree attention, and its merge, in one triton launch.

FA3 has no custom-mask kernel, so sglang attends a tree (topk > 1: a verify, or a draft step)
as a cascade (flashattention_backend, `use_cascade_attn`): an FA3 pass over each request's
prefix, an FA3 "expand" pass in which every draft row is a sequence of its own whose keys are
the few draft tokens the tree lets it see (its ancestors and itself: at most num_steps + 1),
and merge_state_v2 over the two. FA3 runs the expand pass as bs x num_draft_tokens sequences,
one block per (sequence, KV head) with the setup of a full attention tile each, and the LSEs
are transposed into copies for the merge: at a tree verify's sizes that costs several times the
prefix pass, and is what keeps FA3's tree behind triton's single masked kernel.

Here one small program per (draft row, KV head) reads the row's visible slots from the expand
page table, attends its GQA group of query heads to them, and merges the result into the
prefix pass's output in place, reading FA3's LSE where it lies ([heads, rows]). The keys and
values are read from the KV cache by slot, so any page size serves (the expand page table
holds slots, as FA3's expand pass reads them through pages of one token). FlashInfer's tree
verify runs the same split (flashinfer_tree_cascade.py): its prefix pass's LSE is base 2 and
[rows, heads], read as a transposed view and scaled by `lse_scale`.

`serves` says which calls this covers (bf16 / fp16 KV without scales, no logit soft-cap, no
sliding window, no attention sinks, FA3's LSE); the rest keep FA3's expand pass, as does
SGLANG_FA3_TREE_EXPAND=0 (for an A/B). `attend_and_merge_reference` is the same in plain torch.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

ENV = "SGLANG_FA3_TREE_EXPAND"


def enabled_by_env(environ=os.environ) -> bool:
    """On unless SGLANG_FA3_TREE_EXPAND=0 (FA3's own expand pass and merge_state_v2)."""
    return environ.get(ENV, "1") != "0"


_ENABLED = enabled_by_env()


def serves(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    *,
    logit_cap: float,
    window_size: tuple[int, int],
    k_descale: Optional[torch.Tensor],
    extra_kwargs: dict,
    fa_impl_ver: int,
) -> bool:
    """Whether attend_and_merge computes what FA3's expand pass and merge_state_v2 would."""
    return (
        _ENABLED
        and fa_impl_ver == 3
        and q.dtype in (torch.bfloat16, torch.float16)
        and key_cache.dtype == q.dtype
        and k_descale is None
        and not logit_cap
        and tuple(window_size) == (-1, -1)  # a draft step's sliding-window layer
        and not extra_kwargs  # attention sinks
    )


def attend_and_merge(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: torch.Tensor,
    num_visible: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    lse_scale: float = 1.0,
) -> torch.Tensor:
    """Attend each row of `q` to its visible draft slots and merge into `out`, in place.

    q: [rows, heads, head_dim]; key_cache / value_cache: the layer's KV cache, any shape whose
    last two dims are [kv_heads, head_dim] (pages are viewed as slots); page_table: [>= rows,
    width] int32, row r's first num_visible[r] entries are the slots row r sees;
    num_visible: [>= rows] int32; out: [rows, heads, head_dim], the prefix pass's output;
    lse: [heads, rows] float32, the prefix pass's LSE (any strides: FlashInfer's [rows, heads]
    passes as its transposed view); lse_scale turns it into a natural log (1 for FA3's, ln 2
    for FlashInfer's base-2 LSE). Returns `out`, now the attention over the prefix and the
    visible draft tokens together.
    """
    rows, heads, head_dim = q.shape
    kv_heads = key_cache.shape[-2]
    k_slots = key_cache.view(-1, kv_heads, head_dim)
    v_slots = value_cache.view(-1, kv_heads, value_cache.shape[-1])
    assert v_slots.shape[-1] == head_dim and out.shape == q.shape
    assert lse.shape == (heads, rows), (lse.shape, heads, rows)
    group = heads // kv_heads
    _attend_and_merge_kernel[(rows, kv_heads)](
        q,
        q.stride(0),
        q.stride(1),
        k_slots,
        v_slots,
        k_slots.stride(0),
        k_slots.stride(1),
        v_slots.stride(0),
        v_slots.stride(1),
        page_table,
        page_table.stride(0),
        num_visible,
        out,
        out.stride(0),
        out.stride(1),
        lse,
        lse.stride(1),
        lse.stride(0),
        lse_scale,
        sm_scale,
        GROUP=group,
        BLOCK_GROUP=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        BLOCK_DIM=triton.next_power_of_2(head_dim),
        num_warps=2,
    )
    return out


@triton.jit
def _attend_and_merge_kernel(
    q,
    q_row_stride,
    q_head_stride,
    k_slots,  # [slots, kv_heads, head_dim]
    v_slots,
    k_slot_stride,
    k_head_stride,
    v_slot_stride,
    v_head_stride,
    page_table,  # [>= rows, width] int32 slots
    page_table_stride,
    num_visible,  # [>= rows] int32
    out,  # [rows, heads, head_dim]: the prefix pass's output in, the merged output out
    out_row_stride,
    out_head_stride,
    lse,  # the prefix pass's LSE: natural log once multiplied by lse_scale
    lse_row_stride,
    lse_head_stride,
    lse_scale,
    sm_scale,
    GROUP: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    heads = kv_head * GROUP + tl.arange(0, BLOCK_GROUP)
    head_ok = tl.arange(0, BLOCK_GROUP) < GROUP
    dims = tl.arange(0, BLOCK_DIM)
    dim_ok = dims < HEAD_DIM
    tile_ok = head_ok[:, None] & dim_ok[None, :]

    q_tile = tl.load(
        q + row * q_row_stride + heads[:, None] * q_head_stride + dims[None, :],
        mask=tile_ok,
        other=0.0,
    ).to(tl.float32)

    # Online softmax over the visible draft tokens (a handful: the row's ancestors and itself).
    running_max = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_GROUP], tl.float32)
    acc = tl.zeros([BLOCK_GROUP, BLOCK_DIM], tl.float32)
    n = tl.load(num_visible + row)
    for j in range(0, n):
        slot = tl.load(page_table + row * page_table_stride + j).to(tl.int64)
        k = tl.load(
            k_slots + slot * k_slot_stride + kv_head * k_head_stride + dims,
            mask=dim_ok,
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            v_slots + slot * v_slot_stride + kv_head * v_head_stride + dims,
            mask=dim_ok,
            other=0.0,
        ).to(tl.float32)
        score = tl.sum(q_tile * k[None, :], axis=1) * sm_scale
        new_max = tl.maximum(running_max, score)
        rescale = tl.exp(running_max - new_max)
        weight = tl.exp(score - new_max)
        acc = acc * rescale[:, None] + weight[:, None] * v[None, :]
        running_sum = running_sum * rescale + weight
        running_max = new_max

    # Merge with the prefix pass: weights exp(lse_prefix) and exp(max) * sum. FA3 reports a
    # row without keys as +inf when it does not split, -inf when it does: either is no keys.
    out_tile = (
        out + row * out_row_stride + heads[:, None] * out_head_stride + dims[None, :]
    )
    prefix_out = tl.load(out_tile, mask=tile_ok, other=0.0).to(tl.float32)
    prefix_lse = tl.load(
        lse + row * lse_row_stride + heads * lse_head_stride,
        mask=head_ok,
        other=float("-inf"),
    )
    prefix_lse = tl.where(
        prefix_lse == float("inf"), float("-inf"), prefix_lse * lse_scale
    )
    top = tl.maximum(prefix_lse, running_max)
    top = tl.where(top == float("-inf"), 0.0, top)
    prefix_weight = tl.exp(prefix_lse - top)
    draft_scale = tl.exp(running_max - top)
    merged = (prefix_out * prefix_weight[:, None] + acc * draft_scale[:, None]) / (
        prefix_weight + running_sum * draft_scale
    )[:, None]
    tl.store(out_tile, merged.to(out.dtype.element_ty), mask=tile_ok)


def attend_and_merge_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: torch.Tensor,
    num_visible: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    lse_scale: float = 1.0,
) -> torch.Tensor:
    """attend_and_merge in plain torch, a row at a time (same arguments, same in-place result)."""
    rows, heads, head_dim = q.shape
    kv_heads = key_cache.shape[-2]
    group = heads // kv_heads
    k_slots = key_cache.reshape(-1, kv_heads, head_dim)
    v_slots = value_cache.reshape(-1, kv_heads, head_dim)
    wide = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    merged = torch.empty(rows, heads, head_dim, dtype=wide, device=q.device)
    for r in range(rows):
        slots = page_table[r, : int(num_visible[r])].long()
        keys = (
            k_slots[slots].to(wide).repeat_interleave(group, dim=1)
        )  # [n, heads, dim]
        values = v_slots[slots].to(wide).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r].to(wide), keys) * sm_scale
        draft_lse = scores.logsumexp(dim=1)  # -inf where nothing is visible
        draft_out = torch.einsum("hn,nhd->hd", scores.softmax(dim=1), values)
        draft_out = torch.nan_to_num(draft_out)  # softmax over no keys
        prefix_lse = lse[:, r].to(wide) * lse_scale
        prefix_lse[prefix_lse == float("inf")] = float("-inf")
        weights = torch.stack([prefix_lse, draft_lse]).softmax(dim=0)  # [2, heads]
        merged[r] = (
            weights[0, :, None] * out[r].to(wide) + weights[1, :, None] * draft_out
        )
    out.copy_(merged)
    return out
