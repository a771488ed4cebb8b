"""FA3's tree verify, as sglang's FlashAttention backend runs it, for kernel-level timing.

FA3 has no custom-mask kernel, so for a tree (topk > 1) sglang's backend verifies in a cascade
(flashattention_backend.forward_extend, `use_cascade_attn`), per layer:

1. prefix: every draft row of a request attends to the request's committed prefix, no mask
   (one varlen FA3 call, query rows per request = num_draft_tokens, pages of one token);
2. expand: every draft row is a sequence of its own whose KV is the draft tokens the tree
   mask lets it see (a page table row of their slots);
3. merge: the two partial outputs weighed by their log-sum-exps (merge_state_v2, after
   transposing FA3's [heads, rows] LSE to [rows, heads]).

`cascade_inputs` builds those inputs from a triton extend batch (bench_verify_attention's
verify_batch: prefix slots, the draft tokens' K/V, the custom mask), `run_cascade` runs the
FA3 kernels, and `reference_cascade` is the same three steps in plain torch, which a CPU test
checks against the plain-torch extend attention: the timed kernels attend as the verify does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.layers.attention import fa3_tree_expand


@dataclass(frozen=True)
class PagedPass:
    """One varlen FA3 call over pages of one token: sequence i's query rows
    cu_q[i]:cu_q[i + 1] attend, unmasked, to the first lens[i] slots of page_table[i].
    """

    page_table: torch.Tensor  # [sequences, width] int32: KV slots
    lens: torch.Tensor  # [sequences] int32
    cu_q: torch.Tensor  # [sequences + 1] int32
    max_q_rows: int


@dataclass(frozen=True)
class CascadeInputs:
    """A verify of bs requests with n = bs x draft_tokens query rows. The draft tokens' K/V
    sit in the cache after the prefix pool (the verify writes them before attending)."""

    q: torch.Tensor  # [n, heads, dim]
    k_cache: torch.Tensor  # [slots, 1, kv_heads, dim]: pages of one token
    v_cache: torch.Tensor  # [slots, 1, kv_heads, dim]
    prefix: PagedPass  # bs sequences: a request's draft rows over its prefix
    expand: PagedPass  # n sequences: a draft row over the draft tokens its mask shows


def cascade_inputs(batch: dict) -> CascadeInputs:
    """FA3's cascade inputs for a triton extend batch whose prefixes are equally long (as
    verify_batch makes them); the custom mask may be any tree's."""
    qo_indptr, kv_indptr = batch["qo_indptr"], batch["kv_indptr"]
    bs = qo_indptr.shape[0] - 1
    draft_tokens = int(qo_indptr[1] - qo_indptr[0])
    prefix_len = int(kv_indptr[1] - kv_indptr[0])
    n = bs * draft_tokens
    dev = batch["q_extend"].device
    pool = batch["k_buffer"].shape[0]

    # The extend block of each request's mask: [n, draft_tokens].
    masks = batch["custom_mask"].view(bs, draft_tokens, prefix_len + draft_tokens)
    visible = masks[:, :, prefix_len:].reshape(n, draft_tokens).bool()
    # Row r of request b sees draft token j at slot pool + b * draft_tokens + j: its
    # visible slots first, in order, the rest of its page-table row unread.
    draft_slots = pool + torch.arange(n, device=dev, dtype=torch.int32).view(
        bs, 1, draft_tokens
    ).expand(bs, draft_tokens, draft_tokens).reshape(n, draft_tokens)
    visible_first = torch.argsort((~visible).to(torch.int8), dim=1, stable=True)
    return CascadeInputs(
        q=batch["q_extend"],
        k_cache=torch.cat([batch["k_buffer"], batch["k_extend"]]).unsqueeze(1),
        v_cache=torch.cat([batch["v_buffer"], batch["v_extend"]]).unsqueeze(1),
        prefix=PagedPass(
            page_table=batch["kv_indices"].to(torch.int32).view(bs, prefix_len),
            lens=torch.full((bs,), prefix_len, dtype=torch.int32, device=dev),
            cu_q=qo_indptr.to(torch.int32),
            max_q_rows=draft_tokens,
        ),
        expand=PagedPass(
            page_table=torch.gather(draft_slots, 1, visible_first).contiguous(),
            lens=visible.sum(1, dtype=torch.int32),
            cu_q=torch.arange(n + 1, dtype=torch.int32, device=dev),
            max_q_rows=1,
        ),
    )


def with_wide_prefix_table(inputs: CascadeInputs, width: int) -> CascadeInputs:
    """The same verify with the prefix page table `width` columns wide, the lengths unchanged:
    what FA3 sees in sglang's CUDA graphs, whose verify metadata rows are as wide as the
    context (FA3 takes the longest KV from the table's width and plans its splits from it).
    """
    table = inputs.prefix.page_table
    wide = torch.zeros(table.shape[0], width, dtype=table.dtype, device=table.device)
    wide[:, : table.shape[1]] = table
    prefix = dataclasses.replace(inputs.prefix, page_table=wide)
    return dataclasses.replace(inputs, prefix=prefix)


def _paged_attention_reference(
    inputs: CascadeInputs, paged: PagedPass, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass in fp32: (out [rows, heads, dim], lse [heads, rows]) as FA3 returns them."""
    q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
    heads = q.shape[1]
    group = heads // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(heads, q.shape[0], dtype=torch.float32, device=q.device)
    for i in range(paged.cu_q.shape[0] - 1):
        r0, r1 = int(paged.cu_q[i]), int(paged.cu_q[i + 1])
        slots = paged.page_table[i, : int(paged.lens[i])].long()
        keys = k_cache[slots, 0].float().repeat_interleave(group, dim=1)
        values = v_cache[slots, 0].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[r0:r1].float(), keys) * sm_scale
        lse[:, r0:r1] = scores.logsumexp(-1)
        out[r0:r1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out, lse


def _merge_reference(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """merge_state_v2's math: outputs [rows, heads, dim], LSEs [rows, heads]."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = (lse_a - lse).exp().unsqueeze(-1)
    weight_b = (lse_b - lse).exp().unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b


def reference_cascade(inputs: CascadeInputs, sm_scale: float) -> torch.Tensor:
    """The cascade in plain torch: [n, heads, dim] in the query's dtype."""
    prefix_out, prefix_lse = _paged_attention_reference(inputs, inputs.prefix, sm_scale)
    expand_out, expand_lse = _paged_attention_reference(inputs, inputs.expand, sm_scale)
    merged = _merge_reference(prefix_out, prefix_lse.T, expand_out, expand_lse.T)
    return merged.to(inputs.q.dtype)


def prefix_scheduler_metadata(
    inputs: CascadeInputs, num_splits: int = 0, pack_gqa: Optional[bool] = None
) -> torch.Tensor:
    """FA3's tile schedule for the prefix pass, made once for every layer of a step (what
    sglang precomputes for decode only; each verify call otherwise launches its own)."""
    from sgl_kernel.flash_attn import get_scheduler_metadata

    heads, dim = inputs.q.shape[1], inputs.q.shape[2]
    return get_scheduler_metadata(
        batch_size=inputs.prefix.lens.shape[0],
        max_seqlen_q=inputs.prefix.max_q_rows,
        max_seqlen_k=inputs.prefix.page_table.shape[1],
        num_heads=heads,
        num_heads_k=inputs.k_cache.shape[2],
        headdim=dim,
        cache_seqlens=inputs.prefix.lens,
        qkv_dtype=inputs.q.dtype,
        cu_seqlens_q=inputs.prefix.cu_q,
        page_size=1,
        num_splits=num_splits,
        pack_gqa=pack_gqa,
    )


def _fa3_pass(inputs: CascadeInputs, paged: PagedPass, **options):
    """One pass on FA3, as sglang calls it for a tree verify: (out, lse [heads, rows], ...)."""
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache(
        q=inputs.q,
        k_cache=inputs.k_cache,
        v_cache=inputs.v_cache,
        page_table=paged.page_table,
        cache_seqlens=paged.lens,
        cu_seqlens_q=paged.cu_q,
        max_seqlen_q=paged.max_q_rows,
        causal=False,
        return_softmax_lse=True,
        **options,
    )


def expand_and_merge_in_triton(
    inputs: CascadeInputs, out: torch.Tensor, lse: torch.Tensor, lse_scale: float = 1.0
) -> torch.Tensor:
    """The draft rows attended and merged into a prefix pass's output `out` in place, in one
    triton launch (fa3_tree_expand.attend_and_merge); lse: [heads, rows], natural log as FA3
    returns it unless lse_scale says otherwise (FlashInfer's base 2: ln 2)."""
    return fa3_tree_expand.attend_and_merge(
        inputs.q,
        inputs.k_cache,
        inputs.v_cache,
        inputs.expand.page_table,
        inputs.expand.lens,
        out,
        lse,
        inputs.q.shape[-1] ** -0.5,
        lse_scale=lse_scale,
    )


def run_cascade(
    inputs: CascadeInputs,
    *,
    num_splits: int = 0,
    pack_gqa: Optional[bool] = None,
    scheduler_metadata: Optional[torch.Tensor] = None,
    prefix_only: bool = False,
    triton_expand: bool = False,
) -> torch.Tensor:
    """One layer's cascade on FA3 with sglang's arguments (num_splits 0 and pack_gqa None are
    its own); prefix_only stops after the prefix pass, to split the time; triton_expand
    attends the draft rows and merges in one triton launch (fa3_tree_expand.py, the series'
    default) instead of FA3's expand pass and merge_state_v2."""
    from sgl_kernel import merge_state_v2

    options = dict(num_splits=num_splits, pack_gqa=pack_gqa)
    out, lse, *_ = _fa3_pass(
        inputs, inputs.prefix, scheduler_metadata=scheduler_metadata, **options
    )
    if prefix_only:
        return out
    if triton_expand:
        return expand_and_merge_in_triton(inputs, out, lse)
    out_expand, lse_expand, *_ = _fa3_pass(inputs, inputs.expand, **options)
    merged, _ = merge_state_v2(
        out, lse.T.contiguous(), out_expand, lse_expand.T.contiguous()
    )
    return merged
