"""FlashAttention (FA3) metadata for a speculative IDLE batch under DP attention.

A DP rank without requests still runs every forward of a speculative step (draft decode,
target verify, draft extend) so that the MLP sync lines up across ranks. With MAX_LEN padding
that IDLE batch is padded to the other ranks' token count: `input_ids` gets num_rows rows,
`batch_size` becomes num_rows // num_tokens_per_req, and `spec_info` is an idle draft or
verify input without a tree (empty positions, custom mask and out_cache_loc).

Run eagerly, ModelRunner.forward_idle initialises metadata on the model runner's own backend:
the target's, and for the draft decode and draft extend the draft runner's. Both are built
with speculative_num_steps 0, so upstream's draft-decode branch, which an IDLE batch with a
spec input takes, reshapes out_cache_loc to (-1, 0) for a tree (topk > 1) and raises. No
attention kernel runs for IDLE (AttentionBackend.forward returns an empty output), so the
metadata is built from what an idle batch has: one query row per input row, each reading one
KV slot, slot 0, the slot that padded requests point at. It reads no seq_lens_cpu and no
req_to_token row.

CUDA-graph replays never see IDLE: the runners pass the mode they captured (DECODE, TARGET_VERIFY,
DRAFT_EXTEND_V2), and an idle rank's rows are padding rows like any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.attention.flashattention_backend import (
        FlashAttentionBackend,
        FlashAttentionMetadata,
    )
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def idle_forward_metadata(
    backend: FlashAttentionBackend, forward_batch: ForwardBatch
) -> FlashAttentionMetadata:
    # Imported here: flashattention_backend imports this module.
    from sglang.srt.layers.attention.flashattention_backend import (
        FlashAttentionMetadata,
    )

    input_ids = forward_batch.input_ids
    num_rows = 0 if input_ids is None else input_ids.shape[0]
    device = backend.device
    # [num_rows + 1]: row i is query i and KV entry i; queries and keys have the same offsets.
    row_offsets = torch.arange(num_rows + 1, dtype=torch.int32, device=device)
    # [num_rows, 1]: each row's single page, KV slot 0
    page_table = torch.zeros((num_rows, 1), dtype=torch.int32, device=device)
    return FlashAttentionMetadata(
        # [num_rows]
        cache_seqlens_int32=torch.ones(num_rows, dtype=torch.int32, device=device),
        max_seq_len_q=1,
        max_seq_len_k=1,
        cu_seqlens_q=row_offsets,
        cu_seqlens_k=row_offsets,
        page_table=page_table,
        # Slot 0 is the padding slot of the sliding-window pool too.
        swa_page_table=page_table if backend.use_sliding_window_kv_pool else None,
    )
