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

Where spec v2 may hand bounds as host lengths (speculative/bounded_host_lens.py: FlashInfer's
trees, and its chains on request), the plan sizes its work from the bounds and the lengths
FlashInfer's fa2 kernels read (the KV and mask index pointers in device buffers) are the
device's exact ones, written after the plan's copies: plan_fixed_width(host_lens_are_bounds=True),
docs/flashinfer-overlap.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from sglang.srt.layers.attention.utils import create_flashinfer_kv_indices_triton


def unsplit_plan_by_env(environ=os.environ) -> bool:
    """SGLANG_FLASHINFER_SPEC_UNSPLIT_PLAN=1: plan each fixed-width CUDA graph once, without
    split-KV (plan_paged_prefill's unsplit_once). An experiment for an A/B, off by default:
    it saves the plan's host work on every replay and costs split-KV's parallelism at small
    batch and long prefixes (docs/flashinfer-overlap.md). The multi-step draft decode on tensor
    cores is then planned at capture only (draft_decode_planned_at_capture_only)."""
    return environ.get("SGLANG_FLASHINFER_SPEC_UNSPLIT_PLAN", "0") == "1"


_UNSPLIT_PLAN = unsplit_plan_by_env()


@dataclass(frozen=True)
class FixedWidthIndptrs:
    """Host index pointers of a fixed-width forward, all int32 on the CPU."""

    # [bs + 1]: request b's query rows: qo_indptr[b] .. qo_indptr[b + 1] - 1 (b * width ...)
    qo_indptr: torch.Tensor
    # [bs + 1]: request b's KV rows (prefix + width) in the KV slot list
    kv_indptr: torch.Tensor
    # [bs + 1]: request b's tree-mask bits (width x its KV rows), unpacked and packed 8 to a
    # byte
    mask_indptr: torch.Tensor
    packed_mask_indptr: torch.Tensor
    # [bs]: request b's KV rows, and the longest of them
    kv_lens: torch.Tensor
    max_kv_len: int


def fixed_width_kv_lens(
    seq_lens: torch.Tensor, width: int, min_kv_len: Optional[int] = None
) -> torch.Tensor:
    """[bs]: KV rows of each request, given seq_lens that already count the `width` rows.
    CUDA-graph padding requests carry a smaller placeholder, lifted to `width` so that none
    has fewer KV rows than query rows; or to min_kv_len where the KV rows do not count the
    query rows (a tree cascade's prefix pass, whose rows attend unmasked to the prefix).
    """
    return seq_lens.clamp(min=width if min_kv_len is None else min_kv_len)


def fixed_width_indptrs(
    kv_lens_cpu: torch.Tensor, width: int, min_kv_len: Optional[int] = None
) -> FixedWidthIndptrs:
    """Index pointers for `width` query rows per request over kv_lens_cpu [bs] KV rows, each
    lifted to at least `width`, or min_kv_len (fixed_width_kv_lens).

    They are planned between two CUDA-graph replays, on the host's critical path: numpy on
    the host's copy of the lengths, a few microseconds where a dozen torch ops on small CPU
    tensors cost tens each."""
    floor = width if min_kv_len is None else min_kv_len
    kv_lens = np.maximum(kv_lens_cpu.numpy(), floor).astype(np.int64)
    bs = kv_lens.shape[0]
    mask_bits = width * kv_lens
    table = np.zeros((5, bs + 1), dtype=np.int64)
    table[0] = np.arange(0, (bs + 1) * width, width)
    np.cumsum(kv_lens, out=table[1, 1:])
    np.cumsum(mask_bits, out=table[2, 1:])
    np.cumsum((mask_bits + 7) // 8, out=table[3, 1:])
    table[4, :bs] = kv_lens
    rows = torch.from_numpy(table.astype(np.int32))
    return FixedWidthIndptrs(
        qo_indptr=rows[0],
        kv_indptr=rows[1],
        mask_indptr=rows[2],
        packed_mask_indptr=rows[3],
        kv_lens=rows[4, :bs],
        max_kv_len=int(kv_lens.max()),
    )


def device_mask_indptrs(
    kv_lens: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([bs + 1], [bs + 1]) int32 on kv_lens' device: each request's tree-mask bits (width x its
    KV rows, lifted as fixed_width_kv_lens does) and the same packed eight to a byte; what
    fixed_width_indptrs computes on the host, from lengths that only the device knows exactly.
    """
    mask_bits = width * fixed_width_kv_lens(kv_lens, width).to(torch.int64)
    indptrs = torch.zeros(
        (2, kv_lens.shape[0] + 1), dtype=torch.int64, device=kv_lens.device
    )
    torch.cumsum(mask_bits, dim=0, out=indptrs[0, 1:])
    torch.cumsum((mask_bits + 7) // 8, dim=0, out=indptrs[1, 1:])
    indptrs = indptrs.to(torch.int32)
    return indptrs[0], indptrs[1]


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
    device_indptrs: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed mask [packed bytes] uint8, packed indptr [bs + 1] int32), both on the device.

    custom_mask: bool, each request's width x KV-rows bits one after another (FULL_MASK), at
    least as many as the real requests need; CUDA-graph padding requests, past its end, see
    everything. FlashInfer's segment_packbits reads the packed size back from the device;
    here it is known on the host. device_indptrs: device_mask_indptrs of the exact lengths,
    where indptrs were computed from bounds (which then only size the buffers)."""
    from flashinfer.quantization.packbits import get_quantization_module

    device = custom_mask.device
    num_bits = int(indptrs.mask_indptr[-1])
    num_bytes = int(indptrs.packed_mask_indptr[-1])
    mask = custom_mask.view(-1)[:num_bits]
    if mask.numel() < num_bits:
        pad = torch.ones(num_bits - mask.numel(), dtype=torch.bool, device=device)
        mask = torch.cat([mask, pad])
    if device_indptrs is None:
        mask_indptr = indptrs.mask_indptr.to(device, non_blocking=True)
        packed_indptr = indptrs.packed_mask_indptr.to(device, non_blocking=True)
    else:
        mask_indptr, packed_indptr = device_indptrs
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


def plans_from_host_lengths(wrapper) -> bool:
    """Whether plan_paged_prefill can stand in for `wrapper`'s own plan: FlashInfer's paged
    prefill wrapper itself (not a subclass that plans otherwise), on a precompiled fa2 or fa3
    backend; others (cudnn, trtllm-gen, JIT variants) take the wrapper's plan."""
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    return (
        getattr(type(wrapper), "plan", None) is BatchPrefillWithPagedKVCacheWrapper.plan
        and wrapper._backend in ("fa2", "fa3")
        and wrapper._jit_module is None
    )


def plan_paged_prefill(
    wrapper,
    heads: HeadConfig,
    indptrs: FixedWidthIndptrs,
    width: int,
    kv_indices: torch.Tensor,
    unsplit_once: bool = False,
    fixed_partition: bool = False,
) -> None:
    """What wrapper.plan(qo_indptr, kv_indptr, kv_indices, ones, heads..., page_size=1,
    q_data_type, kv_data_type, non_blocking=True) does, with the host values it would derive
    already known.

    unsplit_once (fa2 CUDA-graph wrappers): plan without split-KV, and only once per batch
    size and width. Unsplit, FlashInfer's partition (PrefillSplitQOKVIndptr) does not depend on
    the KV lengths, and each graph wrapper keeps its own int workspace, so later plans of the
    same shape only refresh the buffers the captured kernels read.

    fixed_partition: unsplit, and for a CUDA-graph wrapper planned once as unsplit_once is,
    but partitioned as an eager plan would be: the query tile sized by the rows a sequence
    has, not by the most the graph's batch could put in one, and no padded grid (the rows of
    every replay are the capture's, so the grid is). For sequences of a few rows each (a
    tree cascade's prefix pass with its rows split, flashinfer_tree_cascade) that is what
    gives each program a tile of its rows and not of 128.

    FlashInfer's plan re-derives each request's KV length from the index pointers (four torch
    ops) and takes the longest query and KV lengths with Python's max over a tensor, one torch
    comparison per request; here they are indptrs.kv_lens, `width` and indptrs.max_kv_len.
    Everything else it does for these arguments (the wrapper's fields, the copies into a CUDA
    graph's buffers, the compiled planner's arguments) is done the same way, in its order;
    test_flashinfer_host_plans compares both on a wrapper of the installed FlashInfer. Wrappers
    it does not cover (plans_from_host_lengths) are planned by their own plan."""
    bs = indptrs.kv_lens.shape[0]
    last_page_len = torch.ones(bs, dtype=torch.int32)  # one token a page
    if not plans_from_host_lengths(wrapper):
        split = {"disable_split_kv": True} if fixed_partition else {}
        wrapper.begin_forward(
            indptrs.qo_indptr,
            indptrs.kv_indptr,
            kv_indices,
            last_page_len,
            heads.num_qo_heads,
            heads.num_kv_heads,
            heads.head_dim,
            1,
            q_data_type=heads.q_data_type,
            kv_data_type=heads.kv_data_type,
            non_blocking=True,
            **split,
        )
        return
    # fa2's planner alone takes disable_split_kv; sm90's plan as for CUDA graphs.
    fixed_partition = fixed_partition and wrapper._backend == "fa2"
    unsplit_once = (
        (unsplit_once or fixed_partition)
        and wrapper.is_cuda_graph_enabled
        and wrapper._backend == "fa2"
    )
    if unsplit_once and getattr(wrapper, "_unsplit_plan_shape", None) == (bs, width):
        _refresh_graph_buffers(wrapper, indptrs, kv_indices, last_page_len)
        return
    total_num_rows = bs * width
    _record_batch_shape(wrapper, heads, indptrs, width)
    _place_plan_inputs(wrapper, indptrs, kv_indices, last_page_len, total_num_rows)
    _run_compiled_plan(
        wrapper,
        heads,
        indptrs,
        total_num_rows,
        unsplit_once or fixed_partition,
        plan_for_graph=wrapper.is_cuda_graph_enabled and not fixed_partition,
    )
    if unsplit_once:
        wrapper._unsplit_plan_shape = (bs, width)
    _record_attention_options(wrapper)


def _record_batch_shape(
    wrapper, heads: HeadConfig, indptrs: FixedWidthIndptrs, width: int
) -> None:
    """plan's record of the batch: sizes, head counts, each request's KV length and the
    longest query and KV lengths (from the host values, not from a device read)."""
    bs = indptrs.kv_lens.shape[0]
    wrapper._batch_size = bs
    wrapper._num_qo_heads = heads.num_qo_heads
    wrapper._num_kv_heads = heads.num_kv_heads
    wrapper._prefix_len_ptr = None
    wrapper._token_pos_in_items_ptr = None
    wrapper._token_pos_in_items_len = 0
    wrapper._max_item_len_ptr = None
    wrapper._qo_indptr_last = bs * width
    wrapper._max_q_len = width
    if bs > wrapper._kv_lens_buffer.shape[0]:
        wrapper._kv_lens_buffer = torch.empty(
            (bs,), dtype=torch.int32, device=wrapper.device
        )
    wrapper._kv_lens_buffer[:bs].copy_(indptrs.kv_lens, non_blocking=True)
    wrapper._max_kv_len = indptrs.max_kv_len


def _place_plan_inputs(
    wrapper,
    indptrs: FixedWidthIndptrs,
    kv_indices: torch.Tensor,
    last_page_len: torch.Tensor,
    total_num_rows: int,
) -> None:
    """The index pointers and KV indices where the kernels read them: copied into a CUDA
    graph's buffers (whose batch size and row budget must hold the batch), or the wrapper's own
    device copies."""
    bs = indptrs.kv_lens.shape[0]
    if wrapper.is_cuda_graph_enabled:
        if wrapper._max_total_num_rows is None:
            wrapper._max_total_num_rows = total_num_rows
        elif total_num_rows > wrapper._max_total_num_rows:
            raise ValueError(
                f"{total_num_rows} query rows exceed the CUDA graph's "
                f"{wrapper._max_total_num_rows}"
            )
        if bs != wrapper._fixed_batch_size:
            raise ValueError(
                f"batch size {bs} is not the CUDA graph's {wrapper._fixed_batch_size}"
            )
        _refresh_graph_buffers(wrapper, indptrs, kv_indices, last_page_len)
        return
    device = wrapper.device
    wrapper._qo_indptr_buf = indptrs.qo_indptr.to(device, non_blocking=True)
    wrapper._paged_kv_indptr_buf = indptrs.kv_indptr.to(device, non_blocking=True)
    wrapper._paged_kv_indices_buf = kv_indices.to(device, non_blocking=True)
    wrapper._paged_kv_last_page_len_buf = last_page_len.to(device, non_blocking=True)
    wrapper._custom_mask_buf = None
    wrapper._mask_indptr_buf = None


def _run_compiled_plan(
    wrapper,
    heads: HeadConfig,
    indptrs: FixedWidthIndptrs,
    total_num_rows: int,
    unsplit: bool,
    plan_for_graph: bool,
) -> None:
    """The compiled planner of the batch-prefill module for these types and head dims, called
    with plan's arguments (split-KV off where `unsplit`; plan_for_graph: the partition a CUDA
    graph's varying lengths need, else the one an eager plan of these rows gets); its answer
    is the plan."""
    from flashinfer.prefill import get_batch_prefill_module

    q_data_type, kv_data_type = heads.q_data_type, heads.kv_data_type
    wrapper._cached_q_data_type = q_data_type
    wrapper._cached_kv_data_type = kv_data_type
    wrapper._cached_o_data_type = q_data_type
    wrapper._cached_module = get_batch_prefill_module(
        wrapper._backend,
        q_data_type,
        kv_data_type,
        q_data_type,  # output
        indptrs.kv_indptr.dtype,
        heads.head_dim,
        heads.head_dim,
        0,  # PosEncodingMode.NONE
        False,  # sliding window
        False,  # logits soft cap
        False,  # fp16 qk reduction
    )
    wrapper._block_tables = None
    bs = indptrs.kv_lens.shape[0]
    args = [
        wrapper._float_workspace_buffer,
        wrapper._int_workspace_buffer,
        wrapper._pin_memory_int_workspace_buffer,
        indptrs.qo_indptr,
        indptrs.kv_indptr,
        indptrs.kv_lens,
        wrapper._max_total_num_rows or total_num_rows,
        bs,
        heads.num_qo_heads,
        heads.num_kv_heads,
        1,  # page size
        plan_for_graph,
        heads.head_dim,
        heads.head_dim,
        False,  # causal (a draft extend's run asks for causal attention itself)
        -1,  # window_left
    ]
    if wrapper._backend == "fa2":
        args += [-1, unsplit, 0]  # fixed split size, disable split-kv, colocated CTAs
    wrapper._plan_info = wrapper._cached_module.plan(*args)


def _record_attention_options(wrapper) -> None:
    """plan's record of the attention it was planned for: plain, non-causal softmax."""
    wrapper._causal = False
    wrapper._pos_encoding_mode = "NONE"
    wrapper._use_fp16_qk_reduction = False
    wrapper._window_left = -1
    wrapper._logits_soft_cap = 0.0
    wrapper._sm_scale = None
    wrapper._rope_scale = None
    wrapper._rope_theta = None
    wrapper._seq_lens_kv = None
    wrapper._seq_lens_q = None


def _refresh_graph_buffers(
    wrapper,
    indptrs: FixedWidthIndptrs,
    kv_indices: torch.Tensor,
    last_page_len: torch.Tensor,
) -> None:
    """The copies a CUDA-graph wrapper's plan makes into the buffers its kernels read."""
    if len(kv_indices) > len(wrapper._paged_kv_indices_buf):
        raise ValueError("the KV slot list exceeds the CUDA graph's buffer")
    wrapper._qo_indptr_buf.copy_(indptrs.qo_indptr, non_blocking=True)
    wrapper._paged_kv_indptr_buf.copy_(indptrs.kv_indptr, non_blocking=True)
    wrapper._paged_kv_last_page_len_buf.copy_(last_page_len, non_blocking=True)
    wrapper._paged_kv_indices_buf[: len(kv_indices)].copy_(
        kv_indices, non_blocking=kv_indices.device == wrapper.device
    )


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
    host_lens_are_bounds: bool = False,
    min_kv_len: Optional[int] = None,
    fixed_partition: bool = False,
) -> None:
    """Plan `wrapper` (a BatchPrefillWithPagedKVCacheWrapper over per-token KV slots) for
    `width` query rows per request. kv_lens [bs] (device) and kv_lens_cpu [bs] (host) hold the
    same KV lengths, the query rows included, or with host_lens_are_bounds, kv_lens_cpu holds
    an upper bound of each. With custom_mask (a tree verify) attention follows the mask, else
    it is causal, or, where the run asks, unmasked (a tree cascade's prefix pass: KV lengths
    without the query rows, min_kv_len 1, fixed_width_kv_lens). kv_indices_buf: the CUDA
    graph's slot buffer, or None (eager). Leaves the device's cumsum of the (lifted) KV
    lengths in kv_indptr_buf[: bs + 1]. fixed_partition: plan_paged_prefill's."""
    indptrs = fixed_width_indptrs(kv_lens_cpu, width, min_kv_len)
    device_kv_lens = fixed_width_kv_lens(kv_lens, width, min_kv_len)
    num_kv_rows = int(indptrs.kv_indptr[-1])
    if not host_lens_are_bounds:
        kv_indices = build_kv_indices(
            req_to_token,
            req_pool_indices,
            device_kv_lens,
            num_kv_rows,
            kv_indptr_buf,
            kv_indices_buf,
        )
        plan_paged_prefill(
            wrapper,
            heads,
            indptrs,
            width,
            kv_indices,
            unsplit_once=_UNSPLIT_PLAN,
            fixed_partition=fixed_partition,
        )
    else:
        _plan_from_bounds(
            wrapper,
            heads,
            indptrs,
            width,
            req_pool_indices,
            device_kv_lens,
            req_to_token,
            kv_indptr_buf,
            kv_indices_buf,
            fixed_partition,
        )
    if custom_mask is None:
        return
    # Planned without the mask, which FlashInfer would pack after reading its size back from
    # the device; its run reads the packed mask from these two fields (in a CUDA graph, from
    # the buffers it was captured with).
    device_indptrs = (
        device_mask_indptrs(device_kv_lens, width) if host_lens_are_bounds else None
    )
    if wrapper.is_cuda_graph_enabled:
        _, packed_indptr = pack_tree_mask(
            custom_mask, indptrs, wrapper._custom_mask_buf, device_indptrs
        )
        wrapper._mask_indptr_buf.copy_(packed_indptr)
    else:
        wrapper._custom_mask_buf, wrapper._mask_indptr_buf = pack_tree_mask(
            custom_mask, indptrs, None, device_indptrs
        )


def _plan_from_bounds(
    wrapper,
    heads: HeadConfig,
    indptrs: FixedWidthIndptrs,
    width: int,
    req_pool_indices: torch.Tensor,
    device_kv_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    kv_indptr_buf: torch.Tensor,
    kv_indices_buf: Optional[torch.Tensor],
    fixed_partition: bool = False,
) -> None:
    """plan_fixed_width's plan where indptrs come from bounds. FlashInfer's plan copies the
    host KV index pointer into the buffer its kernels read each request's KV length from, and
    the KV slots into theirs: plan first, then build the slot list and the exact index pointer
    on the device into the same buffers (in a CUDA graph the wrapper's are kv_indptr_buf and
    kv_indices_buf), so the device's values are what the kernels read. The bounds size the
    work partition and the slot list's length only; a KV chunk past a request's real length
    is empty, and fa2's paged prefill kernel clamps to it."""
    backend = getattr(wrapper, "_backend", "fa2")
    if backend != "fa2":
        # sm90's kernels read each request's KV length from the plan, not the device.
        raise ValueError(
            f"a plan from bounds needs FlashInfer's fa2 kernels, not {backend}"
        )
    bs = device_kv_lens.shape[0]
    num_kv_rows = int(indptrs.kv_indptr[-1])
    if kv_indices_buf is None:
        kv_indices = torch.empty(
            num_kv_rows, dtype=torch.int32, device=device_kv_lens.device
        )
    else:
        kv_indices = kv_indices_buf[:num_kv_rows]
    plan_paged_prefill(
        wrapper,
        heads,
        indptrs,
        width,
        kv_indices,
        unsplit_once=_UNSPLIT_PLAN,
        fixed_partition=fixed_partition,
    )
    build_kv_indices(
        req_to_token,
        req_pool_indices,
        device_kv_lens,
        num_kv_rows,
        kv_indptr_buf,
        kv_indices,
    )
    kv_indptr = kv_indptr_buf[: bs + 1]
    planned_indptr = wrapper._paged_kv_indptr_buf
    if planned_indptr.data_ptr() != kv_indptr.data_ptr():
        planned_indptr[: bs + 1].copy_(kv_indptr)
    planned_indices = wrapper._paged_kv_indices_buf
    if planned_indices.data_ptr() != kv_indices.data_ptr():
        planned_indices[: kv_indices.shape[0]].copy_(kv_indices)


def draft_decode_planned_at_capture_only(
    step_backends, unsplit_plan: bool = _UNSPLIT_PLAN
) -> bool:
    """Whether the multi-step draft decode's CUDA graphs are planned once, at capture, and not
    on replay; if so, each step's backend now plans its graphs without split-KV.

    With SGLANG_FLASHINFER_SPEC_UNSPLIT_PLAN=1 and every step decoding on tensor cores: that
    decode is FlashInfer's fa2 prefill kernel, one query row per draft branch, planned by
    PrefillSplitQOKVIndptr, whose partition without split-KV reads the query rows and not the
    KV lengths. Each graph wrapper keeps its own int workspace, and the kernels read the KV
    index pointer and slot list from the buffers generate_draft_decode_kv_indices writes on the
    device, so a replay under the capture's plan needs no plan. Off tensor cores FlashInfer's
    decode plan takes no disable_split_kv, so that decode keeps planning every replay.
    """
    once = unsplit_plan and all(b.decode_use_tensor_cores for b in step_backends)
    if once:
        for backend in step_backends:
            backend.disable_cuda_graph_kv_split = True
    return once


def draft_decode_kv_slots(num_branches: int, row_width: int) -> int:
    """Slots one step of the multi-step draft decode may lay out: each of num_branches draft
    branches (requests x topk) reads its request's prefix and its own draft tokens, together
    at most a req_to_token row of row_width. Upstream sized its CUDA-graph slot buffer per
    request (max_bs x the context length), topk times short for a tree: the draft decode
    wrote past it once the mean prefix passed context_len / topk (draft_decode_indptrs lays
    out what it writes)."""
    return num_branches * row_width


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
    match the KV slot list that kernel lays out, CUDA-graph padding requests included. Like
    fixed_width_indptrs, computed with numpy on the host's lengths.
    """
    branch_lens = np.repeat(seq_lens_cpu.numpy().astype(np.int64), topk)
    num_branches = branch_lens.shape[0]
    prefix_indptr = np.zeros(num_branches + 1, dtype=np.int64)
    np.cumsum(branch_lens, out=prefix_indptr[1:])
    branch = np.arange(num_branches + 1, dtype=np.int64)
    draft_tokens_read = np.arange(1, num_steps + 1, dtype=np.int64)
    indptrs = prefix_indptr[None, :] + draft_tokens_read[:, None] * branch[None, :]
    return torch.from_numpy(indptrs.astype(np.int32))
