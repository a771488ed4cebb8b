"""FA3 metadata for a DP rank's speculative IDLE batch (the fa3-idle-speculative-metadata
patch, flashattention_idle_metadata.py).

The idle rank's draft decode, verify and draft extend batches are padded to the other ranks'
token count and carry an idle spec input without a tree. Eagerly, ModelRunner.forward_idle
initialises metadata on the runner's own backend, built with speculative_num_steps 0, whose
tree branch raised on them. The real init_forward_metadata must size the metadata by the input
rows, read no host lengths and no req_to_token row, and drop the tree's expand metadata; IDLE
batches without a spec input keep the plain decode path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention.flashattention_backend import (
    FlashAttentionBackend,
    FlashAttentionMetadata,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode

TOPK, NUM_DRAFT_TOKENS = 4, 8
STALE = FlashAttentionMetadata(max_seq_len_q=99)


def bare_backend(topk=TOPK, use_sliding_window_kv_pool=False) -> FlashAttentionBackend:
    """The attributes init_forward_metadata reads, on the CPU (__init__ needs a model runner
    and sgl_kernel's FA3). As the target's and the draft runner's backends are built:
    speculative_num_steps 0, step id 0."""
    backend = object.__new__(FlashAttentionBackend)
    backend.__dict__.update(
        device="cpu",
        topk=topk,
        speculative_num_steps=0,
        speculative_step_id=0,
        speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
        page_size=1,
        use_mla=False,
        use_sliding_window_kv_pool=use_sliding_window_kv_pool,
        has_local_attention=False,
        _get_scheduler_metadata=None,
        forward_metadata=STALE,
        forward_metadata_spec_decode_expand=STALE,
    )
    return backend


def idle_batch(
    num_rows: int, num_tokens_per_req: int, spec_info, host_lengths: bool = True
) -> SimpleNamespace:
    """What prepare_mlp_sync_batch leaves on an idle rank: padded rows, seq_lens of 1, slot 0.

    host_lengths False: no seq_lens_cpu and no req_to_token_pool, so reading either raises.
    """
    bs = num_rows // num_tokens_per_req
    batch = SimpleNamespace(
        forward_mode=ForwardMode.IDLE,
        spec_info=spec_info,
        batch_size=bs,
        input_ids=torch.zeros(num_rows, dtype=torch.int64),
        seq_lens=torch.ones(bs, dtype=torch.int64),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64),
        out_cache_loc=torch.zeros(num_rows, dtype=torch.int64),
        encoder_lens=None,
    )
    if host_lengths:
        batch.seq_lens_cpu = torch.ones(bs, dtype=torch.int64)
        batch.req_to_token_pool = SimpleNamespace(
            req_to_token=torch.zeros((4, 64), dtype=torch.int32)
        )
    else:
        batch.seq_lens_cpu = None
    return batch


# An idle EagleVerifyInput: empty positions and custom mask, no tree.
VERIFY_INPUT = SimpleNamespace(
    draft_token_num=NUM_DRAFT_TOKENS,
    positions=torch.empty(0, dtype=torch.int64),
    custom_mask=torch.empty(0, dtype=torch.bool),
)
# An idle EagleDraftInput.
DRAFT_INPUT = SimpleNamespace(topk_p=torch.empty(0, TOPK), positions=None)


@pytest.mark.parametrize(
    "num_rows,num_tokens_per_req,spec_info,topk",
    [
        pytest.param(4, TOPK, DRAFT_INPUT, TOPK, id="draft decode, topk 4"),
        pytest.param(8, NUM_DRAFT_TOKENS, VERIFY_INPUT, TOPK, id="verify, 8 tokens"),
        pytest.param(8, NUM_DRAFT_TOKENS, DRAFT_INPUT, TOPK, id="draft extend, 8 rows"),
        pytest.param(48, NUM_DRAFT_TOKENS, VERIFY_INPUT, TOPK, id="verify, bs 6"),
        pytest.param(4, 4, VERIFY_INPUT, 1, id="verify, chain of 4"),
        pytest.param(10, NUM_DRAFT_TOKENS, VERIFY_INPUT, TOPK, id="rows rounded up"),
        pytest.param(0, NUM_DRAFT_TOKENS, VERIFY_INPUT, TOPK, id="unpadded, bs 0"),
    ],
)
def test_idle_spec_batch_gets_one_kv_slot_per_input_row(
    num_rows, num_tokens_per_req, spec_info, topk
):
    backend = bare_backend(topk=topk)
    backend.init_forward_metadata(idle_batch(num_rows, num_tokens_per_req, spec_info))
    m = backend.forward_metadata
    rows = list(range(num_rows + 1))
    assert m.cu_seqlens_q.tolist() == rows and m.cu_seqlens_k.tolist() == rows
    assert m.cu_seqlens_q.dtype == m.cu_seqlens_k.dtype == torch.int32
    assert m.cache_seqlens_int32.tolist() == [1] * num_rows
    assert m.cache_seqlens_int32.dtype == torch.int32
    assert m.page_table.shape == (num_rows, 1) and m.page_table.dtype == torch.int32
    assert not m.page_table.any()  # KV slot 0, the padding slot
    assert (m.max_seq_len_q, m.max_seq_len_k) == (1, 1)
    assert m.swa_page_table is None and m.local_attn_metadata is None
    assert m.swa_spec_metadata is None and m.scheduler_metadata is None
    # The tree's second half from an earlier forward must not outlive it.
    assert backend.forward_metadata_spec_decode_expand is None


def test_idle_spec_batch_reads_no_host_lengths_and_no_req_to_token_row():
    backend = bare_backend()
    batch = idle_batch(8, NUM_DRAFT_TOKENS, VERIFY_INPUT, host_lengths=False)
    backend.init_forward_metadata(batch)
    assert backend.forward_metadata.cu_seqlens_q.tolist() == list(range(9))


def test_sliding_window_pool_reads_its_padding_slot_too():
    backend = bare_backend(use_sliding_window_kv_pool=True)
    backend.init_forward_metadata(idle_batch(8, NUM_DRAFT_TOKENS, VERIFY_INPUT))
    m = backend.forward_metadata
    assert m.swa_page_table is not None and torch.equal(m.swa_page_table, m.page_table)


def test_idle_batch_without_spec_input_keeps_the_plain_decode_path():
    """Non-speculative DP attention: the padded rows' metadata comes from req_to_token."""
    backend = bare_backend(topk=0)
    req_to_token = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    batch = SimpleNamespace(
        forward_mode=ForwardMode.IDLE,
        spec_info=None,
        batch_size=2,
        input_ids=torch.zeros(2, dtype=torch.int64),
        seq_lens=torch.tensor([3, 1]),
        seq_lens_cpu=torch.tensor([3, 1]),
        req_pool_indices=torch.tensor([2, 0]),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        encoder_lens=None,
    )
    backend.init_forward_metadata(batch)
    m = backend.forward_metadata
    assert m.cache_seqlens_int32.tolist() == [3, 1]
    assert m.cu_seqlens_k.tolist() == [0, 3, 4] and m.max_seq_len_k == 3
    assert torch.equal(m.page_table, req_to_token[[2, 0], :3])
