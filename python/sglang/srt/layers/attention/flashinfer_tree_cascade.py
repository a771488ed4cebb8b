"""FlashInfer's tree verify as a cascade: an unmasked pass over each request's prefix, then each
draft row's visible draft tokens attended and merged in one triton launch.

sglang's FlashInfer backend verifies a tree (topk > 1) as one paged prefill a layer under the
tree's custom mask, one bit per (draft row, key) over the prefix and the draft block, which
FlashInfer's fa2 kernel reads for every key. The mask hides nothing of the prefix (every draft
row sees all of it) and all of the draft block but a row's ancestors and itself (at most
num_steps + 1 of num_draft_tokens). Here:

1. the prefix pass is the same paged prefill planned over the prefix alone, without a mask
   (plan_prefix_pass; there is no mask to pack either), its LSE returned;
2. the draft block is fa3_tree_expand.attend_and_merge over an expand table (ExpandTable: a
   row's visible draft slots first) that fa3_tree_metadata builds from the same mask once a
   step, merging into the prefix pass's output in place and reading FlashInfer's LSE where
   it lies (base 2, [rows, heads]).

The prefix pass is one program per (request, KV head) and query tile, a request's draft rows
times the query heads of a KV head (128 rows for 32 draft rows and four query heads a KV
head): at small batch a few dozen programs, each a whole prefix long, where the GPU has more
than a hundred SMs. In CUDA graphs FlashInfer's plan splits the KV to fill them and merges the
splits in a second kernel. Here, where the batch has fewer programs than the GPU has SMs, each
request's rows are split instead (`row_pieces`): `pieces` sequences of their own, each over
the request's whole prefix, unsplit, so more and smaller programs, no merge, and a plan that
depends on the rows alone (made once per CUDA graph: plan_fixed_width(fixed_partition=True)).
The rows stay in order, so the output needs nothing rearranged. SGLANG_FLASHINFER_TREE_ROW_PIECES
sets the pieces (1: FlashInfer's split; default "auto").

A backend holds one TreeCascade: whether it serves the model (`serves_model`: bf16 / fp16 KV
without scales, one wrapper, so no sliding window or cross attention, no logit soft-cap), the
table the next verify forward reads, and the tables its CUDA graphs were captured with.
SGLANG_FLASHINFER_TREE_CASCADE=0 keeps the masked prefill (for an A/B).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.layers.attention import fa3_tree_expand
from sglang.srt.layers.attention.fa3_tree_metadata import fill_tree_verify_expand
from sglang.srt.layers.attention.flashinfer_host_plans import (
    HeadConfig,
    plan_fixed_width,
)

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

ENV = "SGLANG_FLASHINFER_TREE_CASCADE"
ROW_PIECES_ENV = "SGLANG_FLASHINFER_TREE_ROW_PIECES"
# A piece keeps at least this many query rows a KV head (its draft rows x the query heads of
# a KV head): FlashInfer's smallest query tile.
MIN_PACKED_ROWS = 16

# FlashInfer returns log2 of the softmax denominator; attend_and_merge merges natural logs.
_LN_2 = math.log(2.0)


def enabled_by_env(environ=os.environ) -> bool:
    """On unless SGLANG_FLASHINFER_TREE_CASCADE=0 (the masked paged prefill)."""
    return environ.get(ENV, "1") != "0"


def logit_caps_of(model_runner: "ModelRunner") -> list[float]:
    """Every attention layer's logit soft-cap (0 where it has none), read from the model."""
    from sglang.srt.layers.radix_attention import RadixAttention

    return [
        float(m.logit_cap or 0.0)
        for m in model_runner.model.modules()
        if isinstance(m, RadixAttention)
    ]


def serves_model(
    *,
    kv_cache_dtype: torch.dtype,
    model_dtype: torch.dtype,
    num_wrappers: int,
    skip_prefill: bool,
    logit_caps: list[float],
    environ=os.environ,
) -> bool:
    """Whether a FlashInfer backend verifies trees by the cascade: what attend_and_merge
    computes exactly (fa3_tree_expand.serves: a plain bf16 / fp16 cache, no soft-cap) on the
    one-wrapper backend whose tree verify is planned from host lengths. logit_caps: every
    attention layer's `logit_cap` (0 where none)."""
    return (
        enabled_by_env(environ)
        and not skip_prefill
        and num_wrappers == 1
        and kv_cache_dtype in (torch.bfloat16, torch.float16)
        and kv_cache_dtype == model_dtype
        and not any(logit_caps)
    )


def row_pieces(
    *,
    bs: int,
    num_draft_tokens: int,
    num_qo_heads: int,
    num_kv_heads: int,
    num_sms: int,
    environ=os.environ,
) -> int:
    """How many sequences the prefix pass makes of each request's draft rows: doubled from 1
    while the batch has fewer programs (bs x pieces x KV heads) than the GPU has SMs and each
    piece keeps MIN_PACKED_ROWS query rows a KV head; or SGLANG_FLASHINFER_TREE_ROW_PIECES, a
    number that divides num_draft_tokens."""
    setting = environ.get(ROW_PIECES_ENV, "auto")
    if setting != "auto":
        pieces = int(setting)
        if pieces < 1 or num_draft_tokens % pieces:
            raise ValueError(
                f"{ROW_PIECES_ENV}={setting} must be 'auto' or a number of pieces that "
                f"divides --speculative-num-draft-tokens ({num_draft_tokens})"
            )
        return pieces
    group = num_qo_heads // num_kv_heads
    pieces = 1
    while (
        bs * pieces * num_kv_heads < num_sms
        and num_draft_tokens % (2 * pieces) == 0
        and num_draft_tokens // (2 * pieces) * group >= MIN_PACKED_ROWS
    ):
        pieces *= 2
    return pieces


@dataclass(frozen=True)
class RowPieceBuffers:
    """A CUDA-graph wrapper's index buffers are sized for its batch, bs + 1 sequences; a
    prefix pass of bs x pieces sequences reads longer slices of the same backend buffers
    (each at least max_bs + 1 long)."""

    qo_indptr: torch.Tensor  # int32, the backend's whole CUDA-graph qo_indptr
    kv_indptr: torch.Tensor  # int32, its whole kv_indptr
    last_page_len: torch.Tensor  # int32 ones, its whole kv_last_page_len

    def holds(self, sequences: int) -> bool:
        return (
            self.qo_indptr.numel() > sequences
            and self.kv_indptr.numel() > sequences
            and self.last_page_len.numel() >= sequences
        )

    def point(self, wrapper, sequences: int) -> None:
        """Point a CUDA-graph wrapper (before its capture's plan) at `sequences` sequences."""
        wrapper._qo_indptr_buf = self.qo_indptr[: sequences + 1]
        wrapper._paged_kv_indptr_buf = self.kv_indptr[: sequences + 1]
        wrapper._paged_kv_last_page_len_buf = self.last_page_len[:sequences]
        wrapper._fixed_batch_size = sequences


@dataclass(frozen=True)
class ExpandTable:
    """Which draft tokens each draft row of a tree verify sees, as KV slots."""

    # [rows, num_draft_tokens] int32: row r's num_visible[r] visible draft slots first
    page_table: torch.Tensor
    # [rows] int32: how many draft tokens row r sees (its ancestors and itself)
    num_visible: torch.Tensor

    @classmethod
    def empty(cls, rows: int, num_draft_tokens: int, device) -> "ExpandTable":
        # Every entry a row reads is written by the fill (fill_tree_verify_expand).
        return cls(
            torch.empty(rows, num_draft_tokens, dtype=torch.int32, device=device),
            torch.empty(rows, dtype=torch.int32, device=device),
        )


def plan_prefix_pass(
    wrapper,
    heads: HeadConfig,
    *,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    req_to_token: torch.Tensor,
    kv_indptr_buf: torch.Tensor,
    kv_indices_buf: Optional[torch.Tensor],
    host_lens_are_bounds: bool,
    custom_mask: torch.Tensor,
    num_masked_rows: int,
    num_draft_tokens: int,
    table: ExpandTable,
    pieces: int = 1,
) -> None:
    """Plan a tree verify's two passes: `wrapper` over each request's seq_lens [bs] prefix
    slots for its num_draft_tokens rows, unmasked (at least one KV row each: a CUDA graph's
    padding requests), its rows as `pieces` sequences each (row_pieces; a CUDA-graph wrapper
    pointed at buffers for bs x pieces sequences: RowPieceBuffers.point), and `table` from
    custom_mask (the verify's FULL_MASK bits, real requests only: num_masked_rows = their
    rows). seq_lens_cpu: the host's copy, or bounds of it where host_lens_are_bounds."""
    bs = seq_lens.shape[0]
    if pieces == 1:
        sequences = (req_pool_indices, seq_lens, seq_lens_cpu)
    else:
        sequences = tuple(
            x.repeat_interleave(pieces)
            for x in (req_pool_indices, seq_lens, seq_lens_cpu)
        )
    plan_fixed_width(
        wrapper,
        heads,
        width=num_draft_tokens // pieces,
        req_pool_indices=sequences[0],
        kv_lens=sequences[1],
        kv_lens_cpu=sequences[2],
        req_to_token=req_to_token,
        kv_indptr_buf=kv_indptr_buf,
        kv_indices_buf=kv_indices_buf,
        host_lens_are_bounds=host_lens_are_bounds,
        min_kv_len=1,
        fixed_partition=pieces > 1,
    )
    if pieces == 1:
        # plan_fixed_width left the device's prefix lengths' cumsum here.
        prefix_cu_seqlens = kv_indptr_buf[: bs + 1]
    else:
        prefix_cu_seqlens = torch.zeros(
            bs + 1, dtype=torch.int32, device=seq_lens.device
        )
        prefix_cu_seqlens[1:] = torch.cumsum(seq_lens.clamp(min=1), dim=0)
    fill_tree_verify_expand(
        custom_mask=custom_mask,
        seq_lens=seq_lens,
        # Where each request's mask block starts.
        prefix_cu_seqlens=prefix_cu_seqlens,
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        num_masked_rows=num_masked_rows,
        num_draft_tokens=num_draft_tokens,
        page_table=table.page_table,
        cache_seqlens=table.num_visible,
    )


def attend(
    wrapper,
    q: torch.Tensor,
    key_buffer: torch.Tensor,
    value_buffer: torch.Tensor,
    table: ExpandTable,
    sm_scale: float,
) -> torch.Tensor:
    """One layer's tree verify: q [rows, heads, head_dim] over the prefix (wrapper, planned
    by plan_prefix_pass) and the visible draft tokens; key_buffer / value_buffer: the layer's
    KV cache, [slots, kv_heads, head_dim]. Returns [rows, heads, head_dim].

    The output is allocated uninitialised: FlashInfer's run zero-fills the one it allocates
    (a fill kernel a layer), and every row here has at least one prefix row to attend
    (plan_prefix_pass), so its kernel writes every element."""
    # What forward_return_lse records before its run (the plan recorded the rest).
    wrapper._causal = False
    wrapper._sm_scale = sm_scale
    out, lse = wrapper.run(
        q, (key_buffer, value_buffer), out=torch.empty_like(q), return_lse=True
    )
    return fa3_tree_expand.attend_and_merge(
        q,
        key_buffer,
        value_buffer,
        table.page_table,
        table.num_visible,
        out,
        lse.T,  # [heads, rows] as a view
        sm_scale,
        lse_scale=_LN_2,
    )


class TreeCascade:
    """A FlashInfer backend's tree verifies by the cascade: whether it serves the backend's
    model, the expand table the next verify forward reads (None: that forward is not a
    cascade), and the tables CUDA graphs captured, by (rows, num_draft_tokens), which their
    replays refill."""

    def __init__(self, serves: bool, num_sms: int = 0):
        self.serves = serves
        # The GPU's SMs, which row_pieces fills (0: never split rows).
        self.num_sms = num_sms
        self.table: Optional[ExpandTable] = None
        self._graph_tables: dict[tuple[int, int], ExpandTable] = {}

    @classmethod
    def for_backend(
        cls, model_runner: "ModelRunner", *, num_wrappers: int, skip_prefill: bool
    ) -> "TreeCascade":
        serves = serves_model(
            kv_cache_dtype=model_runner.kv_cache_dtype,
            model_dtype=model_runner.dtype,
            num_wrappers=num_wrappers,
            skip_prefill=skip_prefill,
            logit_caps=logit_caps_of(model_runner),
        )
        num_sms = 0
        if serves and torch.cuda.is_available():
            num_sms = torch.cuda.get_device_properties(
                model_runner.device
            ).multi_processor_count
        return cls(serves, num_sms)

    def reset(self) -> None:
        """A forward is being planned: no table until a cascade verify plans one."""
        self.table = None

    def plan(
        self,
        wrapper,
        updater,
        *,
        kv_indptr_buf: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        spec_info,
        kv_indices_buf: Optional[torch.Tensor],
        host_lens_are_bounds: bool,
        row_buffers: Optional[RowPieceBuffers] = None,
    ) -> None:
        """plan_prefix_pass for a verify of spec_info (EAGLE's: custom_mask, draft_token_num,
        positions of the real requests' rows, None at a capture); updater: the backend's
        prefill indices updater (heads, dtypes, req_to_token). kv_indices_buf: a CUDA
        graph's slot buffer (capture or replay) or None (eager); row_buffers: the backend's
        whole CUDA-graph index buffers (None: the rows of a graphed verify stay whole).
        """
        width = spec_info.draft_token_num
        bs = seq_lens.shape[0]
        rows = bs * width
        graphed = kv_indices_buf is not None
        heads = head_config_of(updater)
        pieces = row_pieces(
            bs=bs,
            num_draft_tokens=width,
            num_qo_heads=heads.num_qo_heads,
            num_kv_heads=heads.num_kv_heads,
            num_sms=self.num_sms,
        )
        if pieces > 1 and kv_indptr_buf.numel() <= bs * pieces:
            pieces = 1  # a request pool smaller than the pieces
        if graphed and pieces > 1:
            if row_buffers is None or not row_buffers.holds(bs * pieces):
                pieces = 1
            # The capture's plan: its wrapper was made for bs sequences.
            elif getattr(wrapper, "_fixed_batch_size", None) != bs * pieces:
                row_buffers.point(wrapper, bs * pieces)
        table = self._graph_tables.get((rows, width)) if graphed else None
        if table is None:
            table = ExpandTable.empty(rows, width, seq_lens.device)
            if graphed:
                self._graph_tables[(rows, width)] = table
        plan_prefix_pass(
            wrapper,
            heads,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            req_to_token=updater.req_to_token,
            kv_indptr_buf=kv_indptr_buf,
            kv_indices_buf=kv_indices_buf,
            host_lens_are_bounds=host_lens_are_bounds,
            custom_mask=spec_info.custom_mask,
            num_masked_rows=_real_rows(spec_info),
            num_draft_tokens=width,
            table=table,
            pieces=pieces,
        )
        self.table = table

    def attend(
        self,
        wrapper,
        q: torch.Tensor,
        key_buffer: torch.Tensor,
        value_buffer: torch.Tensor,
        sm_scale: float,
    ) -> torch.Tensor:
        """attend() over the planned table."""
        return attend(wrapper, q, key_buffer, value_buffer, self.table, sm_scale)


def _real_rows(spec_info) -> int:
    """The verify rows the mask covers: positions' (one a row of a real request); none at a
    CUDA graph's capture, whose spec_info has no positions and a placeholder mask."""
    positions = spec_info.positions
    return 0 if positions is None else positions.numel()


def head_config_of(updater) -> HeadConfig:
    """The heads and dtypes FlashInfer's plan needs, from a FlashInferIndicesUpdaterPrefill."""
    return HeadConfig(
        updater.num_qo_heads,
        updater.num_kv_heads,
        updater.head_dim,
        updater.q_data_type,
        updater.data_type,
    )
