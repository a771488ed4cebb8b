"""The per-token captures a spec v2 verify forward produces, for tree compaction.

With --enable-return-routed-experts (RoutedExpertsCapturer) or --enable-return-indexer-topk
(IndexerTopkCapturer), every target forward records one row per token in the capturer's device
cache: the routed experts, [num_layers, topk] int32, or the NSA indexer's selected top-k,
[num_indexer_layers, index_topk] int32, rows in the forward's token order. The scheduler then
writes row r to the host cache at KV slot out_cache_loc[r] (TopkCaptureOutput.finalize) and
returns a finished request's rows by its slots (BaseTopkCapturer.get_topk reads
req_to_token[req, :seqlen - 1]). So a capture is keyed by KV slot, like the KV itself.

Spec v2 tree compaction (tree_compaction) moves each request's accepted path to the front of
its block: afterwards the slot of committed position seq_len + i must hold accepted node i's KV,
and its capture too. On the overlap scheduler (which spec v2 is) the verify's result still holds
each capture as a device tensor of verify rows (on_forward_end defers the copy to the host:
no_copy_to_cpu), laid out like predict and hidden_states rather than indexed by slot. So the
captures are compacted as rows, in the kernel that moves predict and hidden_states; when
finalize writes row b * num_draft_tokens + i to that row's slot, it writes node i's capture, which
is what the KV move does to the slot (tgt <- src).

NSA: the indexer's per-slot state, its fp8 K and scales (NSATokenToKVPool's
index_k_with_scale_buffer), lives in the KV pool and moves with the KV (kv_move.move_nsa_kv,
the spec-kv-moves-for-all-pools patch). Its top-k selection is not stored per slot; it exists
only as the capture above.
"""

from __future__ import annotations

import dataclasses

import torch

from sglang.srt.state_capturer.base import TopkCaptureOutput


def verify_topk_captures(result) -> list[TopkCaptureOutput]:
    """Every TopkCaptureOutput field of a verify's result (a GenerationBatchResult), in field
    order: today routed_experts_output and indexer_topk_output, each None unless its capturer is
    on. Walking the fields means a capture added upstream later moves too."""
    captures = []
    for field in dataclasses.fields(result):
        value = getattr(result, field.name)
        if isinstance(value, TopkCaptureOutput):
            captures.append(value)
    return captures


def verify_capture_rows(
    result, verify_out_cache_loc: torch.Tensor
) -> list[torch.Tensor]:
    """The device rows of every per-token capture of a verify result, each
    [bs * num_draft_tokens, num_layers, k] in verify row order, to compact with predict.

    verify_out_cache_loc: [bs * num_draft_tokens], the slots verify wrote. A capture of other
    rows, or whose rows were already copied to the host, could not be fixed by compacting
    rows: that is an error, not silent wrong data. (Shapes only: reading slots would sync.)
    """
    num_rows = verify_out_cache_loc.shape[0]
    rows = []
    for capture in verify_topk_captures(result):
        if (
            capture.out_cache_loc.shape[0] != num_rows
            or capture.topk.shape[0] != num_rows
        ):
            raise ValueError(
                f"a verify capture holds {capture.topk.shape[0]} rows for "
                f"{capture.out_cache_loc.shape[0]} slots; the verify wrote {num_rows}"
            )
        if capture.topk.device != verify_out_cache_loc.device:
            raise ValueError(
                "a verify capture was already copied to the host; compaction moves device rows"
            )
        rows.append(capture.topk)
    return rows
