"""FlashInfer plans for speculative forwards of a fixed width, made from host lengths.

Two speculative forwards give every request the same number of query rows, `width`, after its
prefix of seq_len KV rows:
- target verify: the draft tree's num_draft_tokens nodes, masked by the tree (FULL_MASK rows:
  for each node, which of prefix + nodes it sees);
- spec v2's draft extend: the whole verify block again, num_draft_tokens rows, causal. The
  draft writes those rows' KV before attention reads it, so one causal pass of the paged
  prefill kernel over prefix + block is the whole attention.

FlashInfer's plan runs on the host. Given device index pointers it copies them back, and the
generic paths build them on the device, so every plan waited for the GPU: for a verify, until
the draft had finished; for a draft extend, until the verify had. Here every index pointer
comes from the host's seq_lens_cpu (exact in both spec versions), so planning waits for
nothing and the host runs ahead of the GPU. Only the KV slot list and the packed tree mask
are built on the device, by kernels that need no host read-back. The plans' shapes depend on
the batch size alone, so CUDA graphs replay under them.

The multi-step draft decode (draft_decode_indptrs, at the end) is planned from the same host
lengths: each of a request's topk branches reads the request's prefix plus its own draft
tokens so far, so its index pointers follow from seq_lens_cpu and the step alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.layers.attention.utils import create_flashinfer_kv_indices_triton


@dataclass(frozen=True)
class FixedWidthIndptrs:
    """Host index pointers of a fixed-width forward, all [bs + 1] int32 on the CPU."""

    # request b's query rows: qo_indptr[b] .. qo_indptr[b + 1] - 1 (b * width ...)
    qo_indptr: torch.Tensor
    # request b's KV rows (prefix + width) in the KV slot list
    kv_indptr: torch.Tensor
    # request b's tree-mask bits (width x its KV rows), unpacked and packed 8 to a byte
    mask_indptr: torch.Tensor
    packed_mask_indptr: torch.Tensor


def fixed_width_kv_lens(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[bs]: KV rows of each request, given seq_lens that already count the `width` rows.
    CUDA-graph padding requests carry a smaller placeholder, lifted to `width` so that none
    has fewer KV rows than query rows."""
    return seq_lens.clamp(min=width)


def fixed_width_indptrs(kv_lens_cpu: torch.Tensor, width: int) -> FixedWidthIndptrs:
    """Index pointers for `width` query rows per request over kv_lens_cpu [bs] KV rows."""
    bs = kv_lens_cpu.shape[0]
    kv_lens = kv_lens_cpu.to(torch.int64)
    mask_bits = width * kv_lens
    zero = torch.zeros(1, dtype=torch.int64)
    return FixedWidthIndptrs(
        qo_indptr=torch.arange(0, (bs + 1) * width, width, dtype=torch.int32),
        kv_indptr=torch.cat([zero, kv_lens.cumsum(0)]).to(torch.int32),
        mask_indptr=torch.cat([zero, mask_bits.cumsum(0)]).to(torch.int32),
        packed_mask_indptr=torch.cat([zero, ((mask_bits + 7) // 8).cumsum(0)]).to(
            torch.int32
        ),
    )


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    num_kv_rows: int,
    kv_indptr_buf: torch.Tensor,
    kv_indices_buf: Optional[torch.Tensor],
) -> torch.Tensor:
    """[num_kv_rows] int32 KV slots, request after request (the first kv_lens[b] slots of its
    req_to_token row). kv_indptr_buf: [>= bs + 1] int32 device scratch whose element 0 is 0
    (as every attention backend's indptr buffer is allocated); kv_indices_buf: a CUDA graph's
    index buffer, or None to allocate."""
    bs = kv_lens.shape[0]
    kv_indptr = kv_indptr_buf[: bs + 1]
    kv_indptr[1:] = torch.cumsum(kv_lens, dim=0)
    if kv_indices_buf is None:
        kv_indices = torch.empty(num_kv_rows, dtype=torch.int32, device=kv_lens.device)
    else:
        kv_indices = kv_indices_buf[:num_kv_rows]
    create_flashinfer_kv_indices_triton[(bs,)](
        req_to_token,
        req_pool_indices,
        kv_lens,
        kv_indptr,
        None,
        kv_indices,
        req_to_token.shape[1],
    )
    return kv_indices


def pack_tree_mask(
    custom_mask: torch.Tensor,
    indptrs: FixedWidthIndptrs,
    packed_buf: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed mask [packed bytes] uint8, packed indptr [bs + 1] int32), both on the device.

    custom_mask: bool, each request's width x KV-rows bits one after another (FULL_MASK), at
    least as many as the real requests need; CUDA-graph padding requests, past its end, see
    everything. FlashInfer's segment_packbits reads the packed size back from the device;
    here it is known on the host."""
    from flashinfer.quantization.packbits import get_quantization_module

    device = custom_mask.device
    num_bits = int(indptrs.mask_indptr[-1])
    num_bytes = int(indptrs.packed_mask_indptr[-1])
    mask = custom_mask.view(-1)[:num_bits]
    if mask.numel() < num_bits:
        pad = torch.ones(num_bits - mask.numel(), dtype=torch.bool, device=device)
        mask = torch.cat([mask, pad])
    mask_indptr = indptrs.mask_indptr.to(device, non_blocking=True)
    packed_indptr = indptrs.packed_mask_indptr.to(device, non_blocking=True)
    if packed_buf is None:
        packed = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    else:
        packed = packed_buf[:num_bytes]
    get_quantization_module().segment_packbits(
        mask.contiguous(), mask_indptr, packed_indptr, "little", packed
    )
    return packed, packed_indptr


@dataclass(frozen=True)
class HeadConfig:
    """What FlashInfer's plan needs to know of the attention layers."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    q_data_type: torch.dtype
    kv_data_type: torch.dtype


def plan_fixed_width(
    wrapper,
    heads: HeadConfig,
    *,
    width: int,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_lens_cpu: torch.Tensor,
    req_to_token: torch.Tensor,
    kv_indptr_buf: torch.Tensor,
    kv_indices_buf: Optional[torch.Tensor],
    custom_mask: Optional[torch.Tensor] = None,
) -> None:
    """Plan `wrapper` (a BatchPrefillWithPagedKVCacheWrapper over per-token KV slots) for
    `width` query rows per request. kv_lens [bs] (device) and kv_lens_cpu [bs] (host) hold the
    same KV lengths, the query rows included. With custom_mask (a tree verify) attention
    follows the mask, else it is causal. kv_indices_buf: the CUDA graph's slot buffer, or None
    (eager)."""
    bs = kv_lens.shape[0]
    indptrs = fixed_width_indptrs(fixed_width_kv_lens(kv_lens_cpu, width), width)
    kv_indices = build_kv_indices(
        req_to_token,
        req_pool_indices,
        fixed_width_kv_lens(kv_lens, width),
        int(indptrs.kv_indptr[-1]),
        kv_indptr_buf,
        kv_indices_buf,
    )
    wrapper.begin_forward(
        indptrs.qo_indptr,
        indptrs.kv_indptr,
        kv_indices,
        torch.ones(bs, dtype=torch.int32),  # last page length: one token a page
        heads.num_qo_heads,
        heads.num_kv_heads,
        heads.head_dim,
        1,
        q_data_type=heads.q_data_type,
        kv_data_type=heads.kv_data_type,
        non_blocking=True,
    )
    if custom_mask is None:
        return
    # Planned without the mask, which FlashInfer would pack after reading its size back from
    # the device; its run reads the packed mask from these two fields (in a CUDA graph, from
    # the buffers it was captured with).
    if wrapper.is_cuda_graph_enabled:
        _, packed_indptr = pack_tree_mask(
            custom_mask, indptrs, wrapper._custom_mask_buf
        )
        wrapper._mask_indptr_buf.copy_(packed_indptr)
    else:
        wrapper._custom_mask_buf, wrapper._mask_indptr_buf = pack_tree_mask(
            custom_mask, indptrs, None
        )


def draft_decode_branch_lens(seq_lens: torch.Tensor, topk: int) -> torch.Tensor:
    """[bs * topk]: each draft branch's prefix length, request b's seq_len for its branches
    b * topk ... b * topk + topk - 1. One copy kernel on the device, no host read-back; a
    fresh contiguous tensor, since triton kernels read it by offset (an expanded view's
    reshape would alias one element per request)."""
    return seq_lens[:, None].repeat(1, topk).view(-1)


def draft_decode_indptrs(
    seq_lens_cpu: torch.Tensor, topk: int, num_steps: int
) -> torch.Tensor:
    """[num_steps, bs * topk + 1] int32 on the CPU: row i holds the KV index pointers of draft
    decode step i, in which branch z (request z // topk) reads its request's seq_len prefix
    slots and then its own i + 1 draft tokens.

    These are the pointers sglang's generate_draft_decode_kv_indices writes on the device when
    its `positions` argument holds the branch lengths (draft_decode_branch_lens), and they
    match the KV slot list that kernel lays out, CUDA-graph padding requests included.
    """
    branch_lens = draft_decode_branch_lens(seq_lens_cpu.to(torch.int64), topk)
    num_branches = branch_lens.shape[0]
    prefix_indptr = torch.zeros(num_branches + 1, dtype=torch.int64)
    torch.cumsum(branch_lens, 0, out=prefix_indptr[1:])
    branch = torch.arange(num_branches + 1, dtype=torch.int64)
    draft_tokens_read = torch.arange(1, num_steps + 1, dtype=torch.int64)
    return (prefix_indptr[None, :] + draft_tokens_read[:, None] * branch[None, :]).to(
        torch.int32
    )
