"""FA3 on spec v2 trees with --page-size > 1 (docs/paged-trees.md): FlashAttentionBackend plans
with pages of one token, so its tree draft-decode metadata reads the flat branch layout.

The backend is built by its own __init__ from a model runner's attributes (no GPU: the metadata
is plain torch on the CPU). The request's positions map to slots through non-contiguous pages of
16 tokens, with a prefix that ends mid-page: what a draft step attends to, read off the metadata
(prefix page table, then the branch's own "expand" slots), must be the committed prefix and the
branch's own steps, paged_tree_layout.draft_decode_kv_positions.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.paged_tree_layout import draft_decode_kv_positions

PAGE, TOPK, NUM_STEPS, NUM_DRAFT_TOKENS = 16, 4, 3, 8
ROW_LEN = 128


def server_args(overlap: bool) -> SimpleNamespace:
    return SimpleNamespace(
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=TOPK,
        speculative_num_steps=NUM_STEPS,
        speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
        disable_overlap_schedule=not overlap,
        kv_cache_dtype="auto",
        enable_deterministic_inference=False,
        disable_cuda_graph=False,
        is_embedding=False,
        chunked_prefill_size=8192,
        disable_radix_cache=False,
        enable_dp_attention=False,
    )


def model_runner(req_to_token: torch.Tensor, overlap: bool) -> SimpleNamespace:
    hf = SimpleNamespace(num_attention_heads=4)
    model_config = SimpleNamespace(
        is_encoder_decoder=False,
        context_len=ROW_LEN,
        attention_arch=AttentionArch.MHA,
        is_local_attention_model=False,
        head_dim=64,
        hf_text_config=hf,
        get_num_kv_heads=lambda tp_size: 2,
    )
    return SimpleNamespace(
        sliding_window_size=None,
        model_config=model_config,
        device="cpu",
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        kv_cache_dtype=torch.bfloat16,
        server_args=server_args(overlap),
        page_size=PAGE,
        attn_cp_size=1,
        token_to_kv_pool=None,
        tp_size=1,
    )


def paged_rows(seq_lens: list[int], seed: int = 0) -> torch.Tensor:
    """req_to_token rows whose pages of PAGE tokens are scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    pages_per_row = ROW_LEN // PAGE
    pages = torch.randperm(len(seq_lens) * pages_per_row * 3, generator=g)[
        : len(seq_lens) * pages_per_row
    ].view(len(seq_lens), pages_per_row)
    offsets = torch.arange(ROW_LEN) % PAGE
    return (pages.repeat_interleave(PAGE, dim=1) * PAGE + offsets + PAGE).to(
        torch.int32
    )


def draft_decode_batch(req_to_token, seq_lens: list[int], step: int):
    """A tree draft-decode forward (step `step`) on spec v2's flat layout: branch t's step s is
    at position seq_len + t * NUM_STEPS + s (eagle_info_v2.assign_draft_cache_locs_page_size_1).
    """
    bs = len(seq_lens)
    positions = torch.tensor(seq_lens)[:, None] + torch.arange(TOPK * NUM_STEPS)
    out_cache_loc = torch.gather(req_to_token[:bs].long(), 1, positions).view(-1)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        spec_info=SimpleNamespace(),
        batch_size=bs,
        seq_lens=lens,
        seq_lens_cpu=lens.clone(),
        req_pool_indices=torch.arange(bs),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        out_cache_loc=out_cache_loc,
        encoder_lens=None,
    )


@pytest.mark.parametrize("step", [0, 1], ids=["step0", "step1"])
@pytest.mark.parametrize(
    "seq_lens",
    [[21], [16, 37, 5]],
    ids=["bs1-mid-page", "bs3-boundary-mid-short"],
)
def test_spec_v2_tree_draft_step_attends_to_prefix_and_own_branch(seq_lens, step):
    req_to_token = paged_rows(seq_lens)
    backend = FlashAttentionBackend(
        model_runner(req_to_token, overlap=True),
        speculative_step_id=step,
        topk=TOPK,
        speculative_num_steps=NUM_STEPS,
    )
    assert backend.page_size == 1
    backend.init_forward_metadata(draft_decode_batch(req_to_token, seq_lens, step))
    prefix, expand = (
        backend.forward_metadata,
        backend.forward_metadata_spec_decode_expand,
    )
    for b, seq_len in enumerate(seq_lens):
        n = int(prefix.cache_seqlens_int32[b])
        prefix_slots = prefix.page_table[b, :n].tolist()
        for t in range(TOPK):
            row = b * TOPK + t
            m = int(expand.cache_seqlens_int32[row])
            read = prefix_slots + expand.page_table[row, :m].tolist()
            wanted = draft_decode_kv_positions(seq_len, t, step, NUM_STEPS)
            assert read == req_to_token[b, wanted].tolist(), (b, t)


def test_pages_stay_for_spec_v1_trees_and_for_no_tree():
    """Spec v1 gives each branch its own pages, which the paged metadata reads."""
    rows = paged_rows([21])
    runner = model_runner(rows, overlap=False)
    assert FlashAttentionBackend(runner).page_size == PAGE
    runner.server_args.disable_overlap_schedule = False
    runner.server_args.speculative_eagle_topk = 1
    assert FlashAttentionBackend(runner).page_size == PAGE


@pytest.mark.parametrize("topk", [1, TOPK], ids=["chain", "tree"])
def test_graph_page_tables_hold_the_columns_past_the_context_length(topk):
    """A speculative step near the context length reads up to a step's tokens past it, from
    req_to_token's extra columns: every page table the CUDA graphs copy rows into must be as
    wide as those rows, or the last row's reads run past the table."""
    extra = NUM_DRAFT_TOKENS + 8
    rows = torch.arange(4 * (ROW_LEN + extra), dtype=torch.int32).view(4, -1)
    runner = model_runner(rows, overlap=True)
    runner.server_args.speculative_eagle_topk = topk
    runner.page_size = 1
    backend = FlashAttentionBackend(runner, topk=topk, speculative_num_steps=NUM_STEPS)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4 * NUM_DRAFT_TOKENS)
    tables = {
        "decode": backend.decode_cuda_graph_metadata["page_table"],
        "target_verify": backend.target_verify_metadata["page_table"],
    }
    if topk > 1:
        tables["draft_decode_prefix"] = backend.draft_decode_metadata_topk_normal[
            "page_table"
        ]
    for name, table in tables.items():
        assert table.shape[1] == ROW_LEN + extra, name
    strided = backend.decode_cuda_graph_metadata["strided_indices"]
    assert int(strided[-1]) == ROW_LEN + extra - 1
