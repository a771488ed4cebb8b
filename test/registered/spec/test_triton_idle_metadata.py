"""Triton metadata for a DP rank's speculative IDLE batch (the triton-idle-speculative-metadata
patch, triton_idle_metadata.py).

The idle rank's draft, verify and draft extend batches are padded to the other ranks' token
count and carry an idle spec input without KV indices: the real init_forward_metadata must
size its metadata by the input rows, without a tree, and leave the backend's shared buffers
alone; IDLE batches without a spec input keep the plain decode path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention import triton_backend
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

NUM_HEAD, MAX_KV_SPLITS, V_HEAD_DIM = 4, 8, 16


def bare_backend(swa_v_head_dim=None, sliding_window_size=None) -> TritonAttnBackend:
    """The attributes init_forward_metadata reads, on the CPU (__init__ needs a model runner)."""
    backend = object.__new__(TritonAttnBackend)
    backend.__dict__.update(
        device="cpu",
        num_head=NUM_HEAD,
        max_kv_splits=MAX_KV_SPLITS,
        v_head_dim=V_HEAD_DIM,
        swa_v_head_dim=swa_v_head_dim,
        sliding_window_size=sliding_window_size,
        kv_indptr=torch.zeros(65, dtype=torch.int32),
        window_kv_indptr=torch.zeros(65, dtype=torch.int32),
        req_to_token=torch.zeros((4, 32), dtype=torch.int32),
    )
    return backend


def idle_batch(num_rows: int, num_tokens_per_req: int, spec_info) -> SimpleNamespace:
    """What prepare_mlp_sync_batch leaves on an idle rank: padded rows, seq_lens of 1, slot 0."""
    bs = num_rows // num_tokens_per_req
    return SimpleNamespace(
        forward_mode=ForwardMode.IDLE,
        spec_info=spec_info,
        batch_size=bs,
        input_ids=torch.zeros(num_rows, dtype=torch.int64),
        seq_lens=torch.ones(bs, dtype=torch.int32),
        seq_lens_sum=bs,
        req_pool_indices=torch.zeros(bs, dtype=torch.int64),
    )


VERIFY_INPUT = SimpleNamespace(
    draft_token_num=8
)  # an idle EagleVerifyInput has no kv_indptr
DRAFT_INPUT = SimpleNamespace(
    kv_indptr=None, kv_indices=None
)  # an idle EagleDraftInput's is None


@pytest.mark.parametrize(
    "stage,num_rows,num_tokens_per_req,spec_info",
    [
        ("draft topk 4", 4, 4, DRAFT_INPUT),
        ("verify 8 draft tokens", 8, 8, VERIFY_INPUT),
        ("draft extend 8 rows", 8, 8, DRAFT_INPUT),
        ("verify, chain of 4", 4, 4, VERIFY_INPUT),
        ("rows rounded up to the attention TP size", 10, 8, VERIFY_INPUT),
        ("unpadded, bs 0", 0, 8, VERIFY_INPUT),
    ],
)
def test_idle_spec_batch_gets_one_kv_slot_per_input_row(
    stage, num_rows, num_tokens_per_req, spec_info
):
    backend = bare_backend()
    shared = backend.kv_indptr.clone()
    backend.init_forward_metadata(idle_batch(num_rows, num_tokens_per_req, spec_info))
    m = backend.forward_metadata
    assert m.kv_indptr.tolist() == list(range(num_rows + 1)), stage
    assert m.kv_indices.tolist() == [0] * num_rows
    assert m.num_kv_splits.tolist() == [1] * num_rows
    assert m.attn_logits.shape == (num_rows, NUM_HEAD, MAX_KV_SPLITS, V_HEAD_DIM)
    assert m.attn_lse.shape == (num_rows, NUM_HEAD, MAX_KV_SPLITS)
    assert m.custom_mask is None and m.mask_indptr is None and m.qo_indptr is None
    assert m.swa_attn_logits is None and m.window_kv_indptr is None
    assert torch.equal(
        backend.kv_indptr, shared
    )  # the backend's CUDA-graph buffer is untouched


def test_sliding_window_and_swa_head_dim_follow_the_rows():
    backend = bare_backend(swa_v_head_dim=8, sliding_window_size=128)
    backend.init_forward_metadata(idle_batch(8, 8, VERIFY_INPUT))
    m = backend.forward_metadata
    assert (
        m.window_kv_indptr.tolist() == list(range(9))
        and m.window_num_kv_splits.tolist() == [1] * 8
    )
    assert m.swa_attn_logits.shape == (8, NUM_HEAD, MAX_KV_SPLITS, 8)


def test_idle_batch_without_spec_input_keeps_the_plain_decode_path(monkeypatch):
    """Non-speculative DP attention: the kv-indices kernel still builds the padded rows' metadata."""
    launched = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args: launched.append(grid)

    monkeypatch.setattr(
        triton_backend, "create_flashinfer_kv_indices_triton", FakeKernel()
    )
    backend = bare_backend()
    monkeypatch.setattr(
        backend,
        "get_num_kv_splits",
        lambda num_kv_splits, seq_lens: num_kv_splits.fill_(1),
        raising=False,
    )
    backend.init_forward_metadata(idle_batch(2, 1, None))
    assert launched == [(2,)]
    assert backend.forward_metadata.kv_indptr.tolist() == [0, 1, 2]
