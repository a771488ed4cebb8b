"""FlashInfer's tree verify, as sglang's FlashInfer backend runs it, and a cascade in its
place, for kernel-level timing (bench_verify_attention.py --flashinfer).

sglang's backend verifies a tree in one paged prefill call per layer: every draft row of a
request attends to the request's prefix and draft tokens under the custom mask, one bit per
(row, key) over prefix + draft tokens (`masked_pass`). FA3 has no such mask and verifies in a
cascade (fa3_cascade.py); the series runs its second half in one triton launch
(fa3_tree_expand.attend_and_merge). `cascade` is that split on FlashInfer: the prefix pass
unmasked, then the draft rows attended and merged in place by the same triton launch, which
reads the prefix pass's LSE where FlashInfer leaves it (base 2, [rows, heads]: its transposed
view, scaled by ln 2).

In the server's CUDA graphs FlashInfer's planner always splits the KV (its graph plans keep
one grid whatever the lengths) and merges the splits in a second kernel: `graph_prefix_pass`
and `graph_cascade` run the prefix pass through such a wrapper, replayed from a graph. The
prefix pass has bs x KV heads programs for bs requests (one query tile each: a request's
draft rows times the query heads of a KV head); `rows_split_*` gives it more without splitting
the KV: each request's draft rows as `pieces` sequences of their own, each over the whole
prefix (`rows_split_kv`), unsplit, so no merge and a plan that depends on the rows alone.

`masked_kv` and `rows_split_kv` are plain torch, checked on the CPU
(test/registered/foundation/test_fa3_cascade_bench.py); the FlashInfer calls need a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from fa3_cascade import CascadeInputs, PagedPass, expand_and_merge_in_triton

WORKSPACE_BYTES = 256 << 20


@dataclass(frozen=True)
class MaskedKV:
    """The paged KV a masked verify call reads, pages of one token: request b's prefix slots,
    then its draft tokens' slots, kv_indices[kv_indptr[b]:kv_indptr[b + 1]]."""

    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # [bs * (prefix_len + draft_tokens)] int32


def masked_kv(inputs: CascadeInputs) -> MaskedKV:
    """The masked call's KV for cascade inputs: the prefix pass's page table followed by the
    request's draft slots (the expand pass's slots, in draft-token order)."""
    prefix = inputs.prefix.page_table  # [bs, prefix_len]
    bs, prefix_len = prefix.shape
    draft_tokens = inputs.expand.page_table.shape[1]
    # Draft token j of request b is in slot `first + b * draft_tokens + j` (cascade_inputs).
    first_draft_slot = inputs.k_cache.shape[0] - bs * draft_tokens
    draft = first_draft_slot + torch.arange(
        bs * draft_tokens, dtype=torch.int32, device=prefix.device
    ).view(bs, draft_tokens)
    width = prefix_len + draft_tokens
    return MaskedKV(
        kv_indptr=torch.arange(
            0, bs * width + 1, width, dtype=torch.int32, device=prefix.device
        ),
        kv_indices=torch.cat([prefix, draft], dim=1).flatten(),
    )


@dataclass(frozen=True)
class RowsSplitKV:
    """A prefix pass whose bs requests' draft rows are bs x pieces sequences: sequence i is
    rows qo_indptr[i]:qo_indptr[i + 1] (request i // pieces' rows, piece i % pieces of them)
    over request i // pieces' whole prefix, kv_indices[kv_indptr[i]:kv_indptr[i + 1]].
    """

    qo_indptr: torch.Tensor  # [bs * pieces + 1] int32
    kv_indptr: torch.Tensor  # [bs * pieces + 1] int32
    kv_indices: torch.Tensor  # [bs * pieces * prefix_len] int32


def rows_split_kv(prefix: PagedPass, pieces: int) -> RowsSplitKV:
    """The prefix pass's sequences with each request's rows cut into `pieces` (which must
    divide the draft tokens): the rows stay in order, so the output needs no reordering.
    """
    bs, prefix_len = prefix.page_table.shape
    rows = int(prefix.cu_q[-1])
    draft_tokens = rows // bs
    if draft_tokens % pieces:
        raise ValueError(f"{pieces} pieces do not divide {draft_tokens} draft rows")
    dev = prefix.page_table.device
    sequences = bs * pieces
    return RowsSplitKV(
        qo_indptr=torch.arange(
            0, rows + 1, draft_tokens // pieces, dtype=torch.int32, device=dev
        ),
        kv_indptr=torch.arange(
            0, sequences * prefix_len + 1, prefix_len, dtype=torch.int32, device=dev
        ),
        kv_indices=prefix.page_table.repeat_interleave(pieces, dim=0).flatten(),
    )


def _planned_wrapper(
    inputs: CascadeInputs,
    workspace: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor | None,
    qo_indptr: torch.Tensor | None = None,
    graph: bool = False,
    disable_split_kv: bool = False,
):
    """A FlashInfer paged prefill wrapper planned as sglang's backend plans a verify (fa2,
    NHD, pages of one token, not causal: the mask, where given, says what a row sees).
    qo_indptr: the sequences' rows (default: the prefix pass's, a request each); graph: a
    CUDA-graph wrapper, as the server's (its plan splits the KV); disable_split_kv: no split.
    """
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    heads, dim = inputs.q.shape[1], inputs.q.shape[2]
    bs = kv_indptr.shape[0] - 1
    qo_indptr = inputs.prefix.cu_q if qo_indptr is None else qo_indptr
    last_page_len = torch.ones(bs, dtype=torch.int32, device=kv_indptr.device)
    buffers = {}
    if graph:
        buffers = dict(
            use_cuda_graph=True,
            qo_indptr_buf=qo_indptr.clone(),
            paged_kv_indptr_buf=kv_indptr.clone(),
            paged_kv_indices_buf=kv_indices.clone(),
            paged_kv_last_page_len_buf=last_page_len.clone(),
        )
    wrapper = BatchPrefillWithPagedKVCacheWrapper(
        workspace, "NHD", backend="fa2", **buffers
    )
    wrapper.plan(
        qo_indptr,
        kv_indptr,
        kv_indices,
        last_page_len,
        heads,
        inputs.k_cache.shape[2],
        dim,
        1,
        custom_mask=custom_mask,
        causal=False,
        sm_scale=dim**-0.5,
        q_data_type=inputs.q.dtype,
        kv_data_type=inputs.k_cache.dtype,
        disable_split_kv=disable_split_kv,
    )
    return wrapper


@dataclass(frozen=True)
class FlashInferVerify:
    """One layer's verify several ways, each a call that returns [rows, heads, dim]."""

    masked_pass: Callable[[], torch.Tensor]  # what sglang runs
    prefix_pass: Callable[[], torch.Tensor]  # the cascade's first half alone
    cascade: Callable[[], torch.Tensor]  # the prefix pass + fa3_tree_expand
    # The same through a CUDA-graph wrapper (split KV and its merge), as the server runs it.
    graph_prefix_pass: Callable[[], torch.Tensor]
    graph_cascade: Callable[[], torch.Tensor]
    # By pieces: the prefix pass with each request's rows in that many sequences, unsplit.
    rows_split_prefix_pass: dict[int, Callable[[], torch.Tensor]]
    rows_split_cascade: dict[int, Callable[[], torch.Tensor]]


def flashinfer_verify(
    inputs: CascadeInputs,
    custom_mask: torch.Tensor,
    pieces: tuple[int, ...] = (2, 4, 8),
) -> FlashInferVerify:
    """custom_mask: the verify batch's flattened bool mask, [draft_tokens, prefix_len +
    draft_tokens] per request (bench_verify_attention.verify_batch); pieces: the row splits
    to build (those that divide the draft tokens)."""
    dev = inputs.q.device
    kv = masked_kv(inputs)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    masked = _planned_wrapper(
        inputs, workspace, kv.kv_indptr, kv.kv_indices, custom_mask
    )
    prefix: PagedPass = inputs.prefix
    bs, prefix_len = prefix.page_table.shape
    # Each request's prefix slots, a sequence each: (kv_indptr, kv_indices).
    prefix_kv = (
        torch.arange(0, bs * prefix_len + 1, prefix_len, dtype=torch.int32, device=dev),
        prefix.page_table.flatten(),
    )
    unmasked = _planned_wrapper(
        inputs,
        torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev),
        *prefix_kv,
        None,
    )
    graphed = _planned_wrapper(
        inputs,
        torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev),
        *prefix_kv,
        None,
        graph=True,
    )
    split_rows = {}
    draft_tokens = int(prefix.cu_q[-1]) // bs
    for n in pieces:
        if draft_tokens % n:
            continue
        kv = rows_split_kv(prefix, n)
        split_rows[n] = _planned_wrapper(
            inputs,
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev),
            kv.kv_indptr,
            kv.kv_indices,
            None,
            qo_indptr=kv.qo_indptr,
            disable_split_kv=True,
        )
    cache = (inputs.k_cache, inputs.v_cache)

    def cascade_through(wrapper) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            out, lse = wrapper.run(inputs.q, cache, return_lse=True)
            # FlashInfer's LSE read where it lies: [rows, heads] base 2, as its transposed
            # view.
            return expand_and_merge_in_triton(
                inputs, out, lse.T, lse_scale=math.log(2.0)
            )

        return run

    def prefix_through(wrapper) -> Callable[[], torch.Tensor]:
        return lambda: wrapper.run(inputs.q, cache)

    return FlashInferVerify(
        masked_pass=lambda: masked.run(inputs.q, cache),
        prefix_pass=prefix_through(unmasked),
        cascade=cascade_through(unmasked),
        graph_prefix_pass=prefix_through(graphed),
        graph_cascade=cascade_through(graphed),
        rows_split_prefix_pass={n: prefix_through(w) for n, w in split_rows.items()},
        rows_split_cascade={n: cascade_through(w) for n, w in split_rows.items()},
    )
