"""layers/attention/flashinfer_tree_cascade.py: which backends verify trees by the cascade, its
plan and its attention against the masked verify (flashinfer_tree_cascade_cases.py, under
triton's CPU interpreter), and on CUDA against FlashInfer's masked paged prefill as sglang's
backend plans it."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention import flashinfer_tree_cascade as cascade
from specpatch.testing.interpret import interpreter_suite

HERE = Path(__file__).resolve().parent

NAMES = [
    "test_the_prefix_pass_plans_each_prefix_unmasked[1-8-0]",
    "test_the_prefix_pass_plans_each_prefix_unmasked[3-32-0]",
    "test_the_prefix_pass_plans_each_prefix_unmasked[4-16-2]",
    "test_a_graph_replays_into_the_table_it_was_captured_with",
    "test_a_small_batchs_rows_are_split_into_sequences_over_the_whole_prefix[False]",
    "test_a_small_batchs_rows_are_split_into_sequences_over_the_whole_prefix[True]",
    "test_a_graph_too_wide_for_the_backends_buffers_keeps_its_rows_whole",
    "test_the_cascade_attends_as_the_masked_verify[1-8-0]",
    "test_the_cascade_attends_as_the_masked_verify[3-16-0]",
    "test_the_cascade_attends_as_the_masked_verify[2-16-64]",
    "test_a_capture_without_positions_shows_every_row_the_whole_block",
]
# build_kv_indices' kernel bounds a loop by a one-element array (numpy < 2.5 only warns).
interpreter_run, test_cascade_under_interpreter = interpreter_suite(
    HERE / "flashinfer_tree_cascade_cases.py", NAMES, strict_numpy=False
)

SERVED = dict(
    kv_cache_dtype=torch.bfloat16,
    model_dtype=torch.bfloat16,
    num_wrappers=1,
    skip_prefill=False,
    logit_caps=[0.0, 0.0],
    environ={},
)


LLAMA_8B_HEADS = dict(num_qo_heads=32, num_kv_heads=8)


@pytest.mark.parametrize(
    "bs,num_sms,pieces",
    [
        (1, 132, 8),  # 8 programs: 4 draft rows (16 query rows a KV head) a piece
        (4, 132, 8),  # 32 -> 256 programs
        (16, 132, 2),  # 128 -> 256
        (17, 132, 1),  # 136: the GPU is full
        (48, 132, 1),
        (4, 0, 1),  # no SM count: never split
    ],
)
def test_rows_are_split_while_the_batch_leaves_sms_idle(bs, num_sms, pieces):
    assert (
        cascade.row_pieces(
            bs=bs, num_draft_tokens=32, num_sms=num_sms, environ={}, **LLAMA_8B_HEADS
        )
        == pieces
    )


def test_row_pieces_keep_a_tile_of_rows_and_divide_the_draft_tokens():
    # 8 draft tokens x 4 query heads a KV head: two pieces of 16 query rows at most.
    assert (
        cascade.row_pieces(
            bs=1, num_draft_tokens=8, num_sms=132, environ={}, **LLAMA_8B_HEADS
        )
        == 2
    )
    # 12 draft tokens: 2 pieces of 6 rows (24 query rows), not 4 of 3 (12).
    assert (
        cascade.row_pieces(
            bs=1, num_draft_tokens=12, num_sms=132, environ={}, **LLAMA_8B_HEADS
        )
        == 2
    )


def test_row_pieces_from_the_env():
    env = {cascade.ROW_PIECES_ENV: "1"}
    kwargs = dict(bs=1, num_draft_tokens=32, num_sms=132, **LLAMA_8B_HEADS)
    assert cascade.row_pieces(environ=env, **kwargs) == 1
    assert cascade.row_pieces(environ={cascade.ROW_PIECES_ENV: "4"}, **kwargs) == 4
    with pytest.raises(ValueError, match="divides --speculative-num-draft-tokens"):
        cascade.row_pieces(environ={cascade.ROW_PIECES_ENV: "3"}, **kwargs)


def test_on_unless_the_env_says_0():
    assert cascade.enabled_by_env({})
    assert cascade.enabled_by_env({cascade.ENV: "1"})
    assert not cascade.enabled_by_env({cascade.ENV: "0"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_serves_a_plain_bf16_or_fp16_model(dtype):
    assert cascade.serves_model(
        **{**SERVED, "kv_cache_dtype": dtype, "model_dtype": dtype}
    )


@pytest.mark.parametrize(
    "what,change",
    [
        ("fp8 KV", dict(kv_cache_dtype=torch.float8_e4m3fn)),
        ("KV dtype not the model's", dict(kv_cache_dtype=torch.float16)),
        ("sliding window or cross attention", dict(num_wrappers=2)),
        ("a draft backend without prefill", dict(skip_prefill=True)),
        ("a soft-capped layer", dict(logit_caps=[0.0, 30.0])),
        ("the env", dict(environ={cascade.ENV: "0"})),
    ],
)
def test_keeps_the_masked_verify_for(what, change):
    assert not cascade.serves_model(**{**SERVED, **change}), what


def test_reads_each_attention_layers_soft_cap():
    from sglang.srt.layers.radix_attention import RadixAttention

    def layer(cap):
        m = RadixAttention.__new__(RadixAttention)
        torch.nn.Module.__init__(m)
        m.logit_cap = cap
        return m

    model = torch.nn.Sequential(layer(0.0), torch.nn.Linear(2, 2), layer(None))
    assert cascade.logit_caps_of(SimpleNamespace(model=model)) == [0.0, 0.0]
    model.append(layer(50.0))
    assert cascade.logit_caps_of(SimpleNamespace(model=model)) == [0.0, 0.0, 50.0]


@pytest.mark.gpu
@pytest.mark.parametrize("row_split", [False, True], ids=["whole-rows", "row-split"])
@pytest.mark.parametrize("bs,width,padding", [(1, 32, 0), (4, 8, 0), (16, 32, 3)])
def test_matches_flashinfers_masked_verify_on_cuda(bs, width, padding, row_split):
    """The masked paged prefill as the backend plans it (plan_fixed_width with the tree's
    mask), and the cascade as it plans and runs it, on FlashInfer's kernels: the same rows.
    Llama-3-8B's heads (32 / 8, dim 128); row-split: the GPU's SM count given, so the prefix
    pass splits the rows of these small batches (row_pieces), unsplit KV."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import flashinfer_tree_cascade_cases as cases
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    from sglang.srt.layers.attention.flashinfer_host_plans import plan_fixed_width

    heads, kv_heads, dim = 32, 8, 128
    verify = cases.make_verify(bs, width, seed=bs, padding=padding)
    dev = "cuda"
    mask = verify.spec_info.custom_mask.to(dev)
    spec_info = SimpleNamespace(**{**vars(verify.spec_info), "custom_mask": mask})
    seq_lens = verify.seq_lens.to(dev)
    req_to_token = verify.req_to_token.to(dev)
    req_pool_indices = verify.req_pool_indices.to(dev)
    rows = seq_lens.shape[0] * width
    slots = req_to_token.numel()
    gen = torch.Generator(device=dev).manual_seed(bs)
    k = torch.randn(slots, kv_heads, dim, device=dev, generator=gen).bfloat16()
    v = torch.randn(slots, kv_heads, dim, device=dev, generator=gen).bfloat16()
    q = torch.randn(rows, heads, dim, device=dev, generator=gen).bfloat16()
    updater = cases.updater(req_to_token, heads, kv_heads, dim)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    # As long as a backend's: room for each request's rows as sequences of their own.
    indptr = torch.zeros(seq_lens.shape[0] * width + 1, dtype=torch.int32, device=dev)

    masked = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    plan_fixed_width(
        masked,
        cascade.head_config_of(updater),
        width=width,
        req_pool_indices=req_pool_indices,
        kv_lens=seq_lens + width,
        kv_lens_cpu=verify.seq_lens + width,
        req_to_token=req_to_token,
        kv_indptr_buf=indptr,
        kv_indices_buf=None,
        custom_mask=mask,
    )
    expected = masked.forward(q, (k, v), causal=True, sm_scale=dim**-0.5)

    prefix = BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(256 << 20, dtype=torch.uint8, device=dev), "NHD", backend="fa2"
    )
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    tree_cascade = cascade.TreeCascade(serves=True, num_sms=num_sms if row_split else 0)
    tree_cascade.plan(
        prefix,
        updater,
        kv_indptr_buf=indptr,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        seq_lens_cpu=verify.seq_lens,
        spec_info=spec_info,
        kv_indices_buf=None,
        host_lens_are_bounds=False,
    )
    got = tree_cascade.attend(prefix, q, k, v, dim**-0.5)
    real = verify.seq_lens.shape[0] - padding
    torch.testing.assert_close(
        got[: real * width], expected[: real * width], atol=2e-2, rtol=2e-2
    )
    assert math.isfinite(got.float().abs().max().item())


def test_the_cascade_launches_compile_for_sm90():
    """Triton's compiler takes the cascade's types: a bf16 query and cache, the expand
    table's int32 slots and counts, FlashInfer's fp32 LSE as a [heads, rows] view, ln 2.
    """
    from sglang.srt.layers.attention import fa3_tree_expand
    from specpatch.testing.sm90_compile import launches_compile_for_sm90

    rows, heads, kv_heads, dim = 64, 32, 8, 128
    table = cascade.ExpandTable.empty(rows, 32, "cpu")
    cache = torch.zeros(256, kv_heads, dim, dtype=torch.bfloat16)
    q = torch.zeros(rows, heads, dim, dtype=torch.bfloat16)
    lse = torch.zeros(rows, heads, dtype=torch.float32)
    with launches_compile_for_sm90() as compiled:
        fa3_tree_expand.attend_and_merge(
            q,
            cache,
            cache,
            table.page_table,
            table.num_visible,
            torch.zeros_like(q),
            lse.T,
            dim**-0.5,
            lse_scale=math.log(2.0),
        )
    assert compiled == ["_attend_and_merge_kernel"]
