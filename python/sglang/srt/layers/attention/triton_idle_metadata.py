"""Triton attention metadata for a speculative IDLE batch under DP attention.

A DP rank without requests still runs every forward of a speculative step (draft, target
verify, draft extend) so that the MLP sync lines up across ranks. With MAX_LEN padding that
IDLE batch is padded to the other ranks' token count: `input_ids` gets num_rows rows,
`batch_size` becomes num_rows // num_tokens_per_req, and `spec_info` is an idle draft or verify
input without KV indices or a tree. No attention kernel runs for IDLE (the base backend returns
an empty output), but ModelRunner.forward_idle still initialises metadata for a padded batch,
so it is built from what an idle batch has: one query row per input row, each reading KV
slot 0, the slot that padded requests point at.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.attention.triton_backend import (
        ForwardMetadata,
        TritonAttnBackend,
    )
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def idle_forward_metadata(
    backend: TritonAttnBackend, forward_batch: ForwardBatch
) -> ForwardMetadata:
    # Imported here: triton_backend imports this module.
    from sglang.srt.layers.attention.triton_backend import ForwardMetadata

    input_ids = forward_batch.input_ids
    num_rows = 0 if input_ids is None else input_ids.shape[0]
    device = backend.device
    # [num_rows + 1]: row i reads entry i of kv_indices
    kv_indptr = torch.arange(num_rows + 1, dtype=torch.int32, device=device)
    # [num_rows]
    kv_indices = torch.zeros(num_rows, dtype=torch.int64, device=device)
    # [num_rows]
    num_kv_splits = torch.ones(num_rows, dtype=torch.int32, device=device)

    def logits(
        v_head_dim: int,
    ) -> torch.Tensor:  # [num_rows, num_head, max_kv_splits, v_head_dim]
        return torch.empty(
            (num_rows, backend.num_head, backend.max_kv_splits, v_head_dim),
            dtype=torch.float32,
            device=device,
        )

    sliding_window = (
        backend.sliding_window_size is not None and backend.sliding_window_size > 0
    )
    return ForwardMetadata(
        attn_logits=logits(backend.v_head_dim),
        # [num_rows, num_head, max_kv_splits]
        attn_lse=torch.empty(
            (num_rows, backend.num_head, backend.max_kv_splits),
            dtype=torch.float32,
            device=device,
        ),
        max_extend_len=None,
        num_kv_splits=num_kv_splits,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        qo_indptr=None,
        custom_mask=None,  # no tree
        mask_indptr=None,
        window_kv_indptr=kv_indptr if sliding_window else None,
        window_kv_indices=kv_indices if sliding_window else None,
        window_num_kv_splits=num_kv_splits if sliding_window else None,
        window_kv_offsets=None,
        swa_attn_logits=(
            None if backend.swa_v_head_dim is None else logits(backend.swa_v_head_dim)
        ),
    )
