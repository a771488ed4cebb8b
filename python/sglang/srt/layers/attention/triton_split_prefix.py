"""Split-prefix attention for short extends: a speculative verify or draft extend.

A verify extends each request by a few query rows (2 to 32) over a prefix of hundreds or
thousands of tokens. Triton's extend kernel runs one program per (request, query head, row
tile), and each walks the whole prefix alone: at bs 1 of a 32-head model that is 32 programs
on a GPU of over a hundred SMs, and a verify's attention costs several times a decode step's;
at large batch the programs fill the GPU, but each reads its KV head's prefix once per query
head of the GQA group. Decode attention meets the same shape by splitting the prefix across
programs and tiling the group's heads together; this does the same for short extends, at every
batch size (the split count falls to one where the batch alone fills the GPU), in two launches:

1. partial: one program per (request, KV head, split). The query rows of every head that
   shares the KV head are one tile (GQA), so each K/V block is loaded once for the group.
   Splits 0 .. num_splits - 1 share the prefix, which every row sees; split num_splits is
   the extend block itself under its mask (the tree's custom mask, or causal). Each writes
   its rows' softmax-normalised output and log-sum-exp.
2. merge: one program per (request, head, row) weighs the partials by their log-sum-exp.

Only the summation order differs from upstream's kernel. The split count is a function of the
batch size and head count (host ints), so a CUDA graph captures a fixed grid; how long each
request's prefix is stays on the device.

On by default; SGLANG_TRITON_SPLIT_PREFIX_EXTEND=0 keeps upstream's kernel. The gain grows with
the prefix: a verify's attention is a small part of a step over a prompt of tens of tokens and
most of it over thousands (docs/benchmarks.md, the split prefix at long contexts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

# Query rows of one partial program (the GQA group's heads x the extend's rows, padded).
MAX_TILE_ROWS = 128
# Partial programs to aim for: about one per SM of an H100 / H200.
TARGET_PROGRAMS = 128
MAX_SPLITS = 16
# Prefix tokens per inner step of a partial program.
BLOCK_N = 32


def enabled_by_env(environ=os.environ) -> bool:
    return environ.get("SGLANG_TRITON_SPLIT_PREFIX_EXTEND", "1") != "0"


_ENABLED = enabled_by_env()


@dataclass(frozen=True)
class SplitPlan:
    """The launch shape: `group` query heads per KV head, `q_rows` rows per request (the
    longest extend to a power of two, and at least as many as fill a 16-row tile with the
    group: min_q_rows), `tile_rows` = group x q_rows to a power of two (at least 16,
    tl.dot's smallest), `num_splits` prefix splits, and the partial kernel's `num_warps`.
    """

    group: int
    q_rows: int
    tile_rows: int
    num_splits: int
    num_warps: int = 4


def partial_warps(tile_rows: int) -> int:
    """Warps of a partial program. Its fp32 accumulator is tile_rows x head dim: for a full
    128-row tile at head dim 128, 128 registers a thread on four warps before the query tile
    and the scores; eight warps halve that."""
    return 8 if tile_rows >= MAX_TILE_ROWS else 4


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def min_q_rows(group: int) -> int:
    """The most rows per request that still fit a group of `group` heads in 16 tile rows, a
    power of two. Extends shorter than that take the same 16-row tile whatever their
    length, so they share one compile (Q_ROWS is a constexpr) instead of one per length: a
    prefill that extends a cached prefix by one or two tokens would otherwise compile its
    own variants the first time a server meets it, after any warm-up."""
    fit = max(16 // group, 1)
    return 1 << (fit.bit_length() - 1)


def plain_extend(
    logit_cap: float,
    sinks: Optional[torch.Tensor],
    sliding_window_size: int,
    xai_temperature_len: int,
    custom_mask: Optional[torch.Tensor],
    skip_prefix_custom_mask: bool,
) -> bool:
    """Whether an extend_attention_fwd call is plain softmax attention with the whole prefix
    visible, all the split-prefix kernels compute: no logit cap, attention sinks, sliding
    window or length-dependent temperature, and no custom mask over the prefix."""
    return (
        not logit_cap > 0
        and sinks is None
        and sliding_window_size <= -1
        and not xai_temperature_len > 0
        and (custom_mask is None or skip_prefix_custom_mask)
    )


def plan_split_prefix(
    max_len_extend,
    batch_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    plain: bool = True,
) -> Optional[SplitPlan]:
    """The plan for an extend of batch_size requests whose longest has max_len_extend rows,
    or None where upstream's kernel (with triton_short_extend's tile) serves: attention that
    is not plain (plain_extend), a length on the device, rows that do not fit one tile, or head
    dims that are not one power of two. Any batch size: where the short tile would take a large
    batch, the GQA tile still reads each K/V block once per KV head instead of once per query
    head (docs/benchmarks.md, the GQA tile at every batch size)."""
    if (
        not _ENABLED
        or not plain
        or not isinstance(max_len_extend, int)
        or max_len_extend < 1
        or num_heads % num_kv_heads
        or head_dim != v_head_dim
        or head_dim != _next_power_of_2(head_dim)
        or head_dim < 16
    ):
        return None
    group = num_heads // num_kv_heads
    q_rows = max(_next_power_of_2(max_len_extend), min_q_rows(group))
    tile_rows = max(16, _next_power_of_2(group * q_rows))
    if tile_rows > MAX_TILE_ROWS:
        return None
    per_split = batch_size * num_kv_heads
    num_splits = 1
    while (
        num_splits * 2 <= MAX_SPLITS and num_splits * 2 * per_split <= TARGET_PROGRAMS
    ):
        num_splits *= 2
    return SplitPlan(group, q_rows, tile_rows, num_splits, partial_warps(tile_rows))


@triton.jit
def _online_softmax_step(m_i, l_i, acc, qk, v, v_scale):
    """Fold one block of scores qk: [rows, cols] (masked entries -inf) and its values
    v: [cols, dim] into the running max m_i, denominator l_i and output acc. A row that has
    seen only masked scores keeps m_i = -inf and adds nothing."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v) * v_scale
    return m_new, l_i, acc


@triton.jit
def _attend_prefix_share(
    q,
    m_i,
    l_i,
    acc,
    row_ok,
    kv_head,
    split,
    p_start,
    p_len,
    kv_indices,
    K_Buffer,
    V_Buffer,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    sm_scale,
    k_scale,
    v_scale,
    num_splits,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
):
    """Fold split `split`'s share of the prefix (whole BLOCK_N steps except at its end; every
    row sees all of it) into the running softmax state."""
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    chunk = tl.cdiv(tl.cdiv(p_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, p_len)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < hi
        slot = tl.load(kv_indices + p_start + cols, mask=col_ok, other=0)
        k = tl.load(
            K_Buffer
            + slot[None, :] * stride_kbt
            + kv_head * stride_kbh
            + offs_d[:, None],
            mask=col_ok[None, :],
            other=0.0,
        )
        qk = tl.dot(q.to(k.dtype), k) * (sm_scale * k_scale)
        qk = tl.where(row_ok[:, None] & col_ok[None, :], qk, float("-inf"))
        v = tl.load(
            V_Buffer + slot[:, None] * stride_vbt + kv_head * stride_vbh + offs_d,
            mask=col_ok[:, None],
            other=0.0,
        )
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, qk, v, v_scale)
    return m_i, l_i, acc


@triton.jit
def _attend_extend_block(
    q,
    m_i,
    l_i,
    acc,
    row,
    row_ok,
    kv_head,
    b,
    q_start,
    q_len,
    p_len,
    K_Extend,
    V_Extend,
    stride_ket,
    stride_keh,
    stride_vet,
    stride_veh,
    custom_mask,
    mask_indptr,
    sm_scale,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    USE_CUSTOM_MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
):
    """Fold the request's own extend rows, under the tree's custom mask (its part after the
    prefix) or causally, into the running softmax state."""
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_start = tl.load(mask_indptr + b)
    for start in range(0, q_len, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < q_len
        k = tl.load(
            K_Extend
            + (q_start + cols)[None, :] * stride_ket
            + kv_head * stride_keh
            + offs_d[:, None],
            mask=col_ok[None, :],
            other=0.0,
        )
        qk = tl.dot(q, k) * sm_scale
        visible = row_ok[:, None] & col_ok[None, :]
        if USE_CUSTOM_MASK:
            seen = tl.load(
                custom_mask
                + mask_start
                + row[:, None] * (p_len + q_len)
                + p_len
                + cols[None, :],
                mask=visible,
                other=0,
            )
            visible = visible & (seen != 0)
        elif IS_CAUSAL:
            visible = visible & (cols[None, :] <= row[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        v = tl.load(
            V_Extend
            + (q_start + cols)[:, None] * stride_vet
            + kv_head * stride_veh
            + offs_d,
            mask=col_ok[:, None],
            other=0.0,
        )
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, qk, v, 1.0)
    return m_i, l_i, acc


# The split count follows the batch size (1-16 splits): a runtime argument, unspecialised, so
# that the batch sizes a server passes through share this kernel's compiles.
@triton.jit(do_not_specialize=["num_splits"])
def _partial_kernel(
    Q,
    K_Extend,
    V_Extend,
    K_Buffer,
    V_Buffer,
    qo_indptr,
    kv_indptr,
    kv_indices,
    custom_mask,
    mask_indptr,
    Partial_O,
    Partial_LSE,
    sm_scale,
    k_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ket,
    stride_keh,
    stride_vet,
    stride_veh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_or,
    stride_lb,
    stride_ls,
    stride_lh,
    num_splits,
    GROUP: tl.constexpr,
    Q_ROWS: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    USE_CUSTOM_MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q_start
    p_start = tl.load(kv_indptr + b)
    p_len = tl.load(kv_indptr + b + 1) - p_start

    # Tile row t holds row t % Q_ROWS of the group's head t // Q_ROWS.
    offs_t = tl.arange(0, TILE_ROWS)
    head = kv_head * GROUP + offs_t // Q_ROWS
    row = offs_t % Q_ROWS
    row_ok = (offs_t // Q_ROWS < GROUP) & (row < q_len)
    offs_d = tl.arange(0, D)
    q = tl.load(
        Q + (q_start + row)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d,
        mask=row_ok[:, None],
        other=0.0,
    )

    m_i = tl.full([TILE_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_ROWS], tl.float32)
    acc = tl.zeros([TILE_ROWS, D], tl.float32)
    # Two helpers, not two inline branches: triton merges the variables that both branches
    # of an `if` assign, and their types differ (int64 query offsets against int32 prefix
    # offsets; an fp8 KV cache against the extend's dtype).
    if split < num_splits:
        m_i, l_i, acc = _attend_prefix_share(
            q,
            m_i,
            l_i,
            acc,
            row_ok,
            kv_head,
            split,
            p_start,
            p_len,
            kv_indices,
            K_Buffer,
            V_Buffer,
            stride_kbt,
            stride_kbh,
            stride_vbt,
            stride_vbh,
            sm_scale,
            k_scale,
            v_scale,
            num_splits,
            BLOCK_N,
            D,
        )
    else:
        m_i, l_i, acc = _attend_extend_block(
            q,
            m_i,
            l_i,
            acc,
            row,
            row_ok,
            kv_head,
            b,
            q_start,
            q_len,
            p_len,
            K_Extend,
            V_Extend,
            stride_ket,
            stride_keh,
            stride_vet,
            stride_veh,
            custom_mask,
            mask_indptr,
            sm_scale,
            BLOCK_N,
            D,
            USE_CUSTOM_MASK,
            IS_CAUSAL,
        )

    # A split past a short prefix sees no key: its rows store only their -inf log-sum-exp,
    # which tells the merge not to read their output (most splits, on a prompt of a few
    # hundred tokens; the output is the partials' bulk).
    seen_any = l_i > 0
    l_safe = tl.where(seen_any, l_i, 1.0)
    tl.store(
        Partial_O
        + b * stride_ob
        + split * stride_os
        + head[:, None] * stride_oh
        + row[:, None] * stride_or
        + offs_d,
        acc / l_safe[:, None],
        mask=(row_ok & seen_any)[:, None],
    )
    tl.store(
        Partial_LSE + b * stride_lb + split * stride_ls + head * stride_lh + row,
        tl.where(seen_any, m_i + tl.log(l_safe), float("-inf")),
        mask=row_ok,
    )


@triton.jit
def _merge_kernel(
    O,
    qo_indptr,
    Partial_O,
    Partial_LSE,
    stride_ot,
    stride_oh,
    stride_ob,
    stride_os,
    stride_oph,
    stride_or,
    stride_lb,
    stride_ls,
    stride_lh,
    PARTS: tl.constexpr,
    PARTS_POW2: tl.constexpr,
    D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    q_start = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q_start
    if row < q_len:
        offs_s = tl.arange(0, PARTS_POW2)
        part_ok = offs_s < PARTS
        offs_d = tl.arange(0, D)
        lse = tl.load(
            Partial_LSE + b * stride_lb + offs_s * stride_ls + head * stride_lh + row,
            mask=part_ok,
            other=float("-inf"),
        )
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m)
        # Parts that saw no key left their output unwritten (weight 0; skip the read).
        seen = part_ok & (lse > float("-inf"))
        o = tl.load(
            Partial_O
            + b * stride_ob
            + offs_s[:, None] * stride_os
            + head * stride_oph
            + row * stride_or
            + offs_d,
            mask=seen[:, None],
            other=0.0,
        )
        total = tl.maximum(tl.sum(w, 0), 1e-30)
        out = tl.sum(w[:, None] * o, 0) / total
        tl.store(
            O + (q_start + row) * stride_ot + head * stride_oh + offs_d,
            out.to(O.dtype.element_ty),
        )


def _partial_buffers(
    batch_size: int,
    parts: int,
    num_heads: int,
    q_rows: int,
    dim: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised partial outputs [batch_size, parts, num_heads, q_rows, dim] and log-sum-
    exps [batch_size, parts, num_heads, q_rows], fp32: the partial kernel writes what the merge
    reads."""
    partial_o = torch.empty(
        (batch_size, parts, num_heads, q_rows, dim), dtype=torch.float32, device=device
    )
    partial_lse = torch.empty(
        (batch_size, parts, num_heads, q_rows), dtype=torch.float32, device=device
    )
    return partial_o, partial_lse


def split_prefix_extend_attention(
    plan: SplitPlan,
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: Optional[torch.Tensor],
    is_causal: bool,
    mask_indptr: torch.Tensor,
    k_scale: float,
    v_scale: float,
    sm_scale: float,
) -> None:
    """Write the attention of every extend row (q_extend: [tokens, heads, dim]) over its
    request's prefix (kv_indices[kv_indptr[b]:kv_indptr[b + 1]] of k/v_buffer, all visible) and
    its extend block (k/v_extend rows under custom_mask, else causal if is_causal) into
    o_extend, as extend_attention_fwd does with skip_prefix_custom_mask."""
    batch_size = qo_indptr.shape[0] - 1
    num_heads, dim = q_extend.shape[1], q_extend.shape[2]
    num_kv_heads = k_extend.shape[1]
    parts = plan.num_splits + 1
    partial_o, partial_lse = _partial_buffers(
        batch_size, parts, num_heads, plan.q_rows, dim, q_extend.device
    )
    use_custom_mask = custom_mask is not None
    _partial_kernel[(batch_size, num_kv_heads, parts)](
        q_extend,
        k_extend,
        v_extend,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        custom_mask if use_custom_mask else qo_indptr,
        mask_indptr if use_custom_mask else qo_indptr,
        partial_o,
        partial_lse,
        sm_scale,
        k_scale,
        v_scale,
        q_extend.stride(0),
        q_extend.stride(1),
        k_extend.stride(0),
        k_extend.stride(1),
        v_extend.stride(0),
        v_extend.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        *partial_o.stride()[:4],
        *partial_lse.stride()[:3],
        plan.num_splits,
        GROUP=plan.group,
        Q_ROWS=plan.q_rows,
        TILE_ROWS=plan.tile_rows,
        BLOCK_N=BLOCK_N,
        D=dim,
        USE_CUSTOM_MASK=use_custom_mask,
        IS_CAUSAL=is_causal,
        num_warps=plan.num_warps,
        num_stages=1,
    )
    _merge_kernel[(batch_size, num_heads, plan.q_rows)](
        o_extend,
        qo_indptr,
        partial_o,
        partial_lse,
        o_extend.stride(0),
        o_extend.stride(1),
        *partial_o.stride()[:4],
        *partial_lse.stride()[:3],
        PARTS=parts,
        PARTS_POW2=_next_power_of_2(parts),
        D=dim,
        num_warps=1,
    )


def reference_extend_attention(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: Optional[torch.Tensor],
    is_causal: bool,
    mask_indptr: torch.Tensor,
    k_scale: float,
    v_scale: float,
    sm_scale: float,
) -> torch.Tensor:
    """Plain torch, request by request: softmax over [prefix, extend block] per head, in fp32."""
    num_heads, num_kv_heads = q_extend.shape[1], k_extend.shape[1]
    out = torch.empty_like(q_extend)
    for b in range(qo_indptr.shape[0] - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        p0, p1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        n, p = q1 - q0, p1 - p0
        slots = kv_indices[p0:p1].long()
        keys = torch.cat([k_buffer[slots].float() * k_scale, k_extend[q0:q1].float()])
        values = torch.cat([v_buffer[slots].float() * v_scale, v_extend[q0:q1].float()])
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_extend[q0:q1].float(), keys) * sm_scale
        if custom_mask is not None:
            m0 = int(mask_indptr[b])
            block = custom_mask[m0 : m0 + n * (p + n)].view(n, p + n)[:, p:].bool()
        elif is_causal:
            block = torch.ones(n, n, dtype=torch.bool, device=q_extend.device).tril()
        else:
            block = torch.ones(n, n, dtype=torch.bool, device=q_extend.device)
        prefix = torch.ones(n, p, dtype=torch.bool, device=q_extend.device)
        visible = torch.cat([prefix, block], dim=1)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(
            out.dtype
        )
    return out
