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

`masked_kv` is plain torch, checked on the CPU
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


def _planned_wrapper(
    inputs: CascadeInputs,
    workspace: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor | None,
):
    """A FlashInfer paged prefill wrapper planned as sglang's backend plans a verify (fa2,
    NHD, pages of one token, not causal: the mask, where given, says what a row sees).
    """
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    heads, dim = inputs.q.shape[1], inputs.q.shape[2]
    bs = kv_indptr.shape[0] - 1
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    wrapper.plan(
        inputs.prefix.cu_q,
        kv_indptr,
        kv_indices,
        torch.ones(bs, dtype=torch.int32, device=kv_indptr.device),
        heads,
        inputs.k_cache.shape[2],
        dim,
        1,
        custom_mask=custom_mask,
        causal=False,
        sm_scale=dim**-0.5,
        q_data_type=inputs.q.dtype,
        kv_data_type=inputs.k_cache.dtype,
    )
    return wrapper


@dataclass(frozen=True)
class FlashInferVerify:
    """One layer's verify three ways, each a call that returns [rows, heads, dim]."""

    masked_pass: Callable[[], torch.Tensor]  # what sglang runs
    prefix_pass: Callable[[], torch.Tensor]  # the cascade's first half alone
    cascade: Callable[[], torch.Tensor]  # the prefix pass + fa3_tree_expand


def flashinfer_verify(
    inputs: CascadeInputs, custom_mask: torch.Tensor
) -> FlashInferVerify:
    """custom_mask: the verify batch's flattened bool mask, [draft_tokens, prefix_len +
    draft_tokens] per request (bench_verify_attention.verify_batch)."""
    dev = inputs.q.device
    kv = masked_kv(inputs)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    masked = _planned_wrapper(
        inputs, workspace, kv.kv_indptr, kv.kv_indices, custom_mask
    )
    prefix: PagedPass = inputs.prefix
    bs, prefix_len = prefix.page_table.shape
    prefix_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    unmasked = _planned_wrapper(
        inputs,
        prefix_workspace,
        torch.arange(0, bs * prefix_len + 1, prefix_len, dtype=torch.int32, device=dev),
        prefix.page_table.flatten(),
        None,
    )
    cache = (inputs.k_cache, inputs.v_cache)

    def cascade() -> torch.Tensor:
        out, lse = unmasked.run(inputs.q, cache, return_lse=True)
        # FlashInfer's LSE read where it lies: [rows, heads] base 2, as its transposed view.
        return expand_and_merge_in_triton(inputs, out, lse.T, lse_scale=math.log(2.0))

    return FlashInferVerify(
        masked_pass=lambda: masked.run(inputs.q, cache),
        prefix_pass=lambda: unmasked.run(inputs.q, cache),
        cascade=cascade,
    )
