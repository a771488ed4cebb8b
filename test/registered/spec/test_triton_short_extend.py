"""Triton's extend attention with a query tile as long as a short extend (patch
triton-short-extend-query-tile): the tile choice on the CPU, and on the GPU the kernel's output
against plain torch attention for speculative verify shapes (a prefix every row sees, then the
draft block under its tree mask)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.attention import triton_short_extend, triton_split_prefix
from sglang.srt.layers.attention.triton_short_extend import (
    enabled_by_env,
    short_extend_launch,
)
from specpatch.testing import engine as eng
from specpatch.testing import synth

HOPPER = (128, 8)  # upstream's prefill tile and warps on Hopper


@pytest.mark.parametrize(
    "max_len_extend,expected",
    [
        (1, (16, 4)),  # a draft extend of one accepted token
        (2, (16, 4)),  # chain 1,1,2
        (8, (16, 4)),  # tree 4,3,8
        (17, (32, 4)),
        (32, (32, 4)),  # tree 16,3,32
        (64, (64, 8)),  # tree ..,64
        (128, HOPPER),  # a prefill fills upstream's tile: unchanged
        (4096, HOPPER),
    ],
)
def test_the_tile_follows_the_longest_extend(max_len_extend, expected, monkeypatch):
    monkeypatch.setattr(triton_short_extend, "_ENABLED", True)
    assert short_extend_launch(max_len_extend, 64, 32, *HOPPER) == expected


def test_upstream_tile_where_short_tiles_do_not_pay(monkeypatch):
    monkeypatch.setattr(triton_short_extend, "_ENABLED", True)
    assert short_extend_launch(48, 64, 32, 32, 4) == (32, 4)  # never grown
    # bs 1 of a 32-head model: 32 programs, each walking the whole prefix.
    assert short_extend_launch(2, 1, 32, *HOPPER) == HOPPER
    assert short_extend_launch(2, 8, 32, *HOPPER) == (16, 4)
    # A length on the device (no host sync to read it).
    assert short_extend_launch(torch.tensor(2), 64, 32, *HOPPER) == HOPPER
    monkeypatch.setattr(triton_short_extend, "_ENABLED", False)
    assert short_extend_launch(2, 64, 32, *HOPPER) == HOPPER


def test_short_tiles_are_on_unless_the_env_says_0():
    assert enabled_by_env({})
    assert enabled_by_env({"SGLANG_TRITON_SHORT_EXTEND_TILE": "1"})
    assert not enabled_by_env({"SGLANG_TRITON_SHORT_EXTEND_TILE": "0"})


# ----------------------------------------------------------------------------- GPU


def verify_inputs(bs, prefix_lens, draft_tokens, heads, kv_heads, dim, seed):
    """Random q/k/v of a verify: request b has prefix_lens[b] tokens in the KV pool (scattered
    slots) and draft_tokens query rows with a random tree mask (each row sees itself).
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    total_prefix = sum(prefix_lens)
    pool = total_prefix + 64
    k_buffer = torch.randn(pool, kv_heads, dim, device=dev, dtype=dt, generator=g)
    v_buffer = torch.randn(pool, kv_heads, dim, device=dev, dtype=dt, generator=g)
    slots = torch.randperm(pool, device=dev, generator=g)[:total_prefix]
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.tensor(prefix_lens, device=dev).cumsum(0)
    n = bs * draft_tokens
    q = torch.randn(n, heads, dim, device=dev, dtype=dt, generator=g)
    k = torch.randn(n, kv_heads, dim, device=dev, dtype=dt, generator=g)
    v = torch.randn(n, kv_heads, dim, device=dev, dtype=dt, generator=g)
    qo_indptr = torch.arange(0, n + 1, draft_tokens, dtype=torch.int32, device=dev)
    # Row i sees column j < i with probability 1/2 (a tree's ancestors), and itself.
    draft_mask = (
        torch.rand(bs, draft_tokens, draft_tokens, device=dev, generator=g) < 0.5
    ).tril(-1) | torch.eye(draft_tokens, dtype=torch.bool, device=dev)
    # The kernel's custom mask covers prefix + draft columns per row, flattened per request.
    full = torch.cat(
        [
            torch.cat(
                [
                    torch.ones(draft_tokens, p, dtype=torch.bool, device=dev),
                    draft_mask[b],
                ],
                dim=1,
            ).flatten()
            for b, p in enumerate(prefix_lens)
        ]
    )
    mask_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=dev)
    mask_indptr[1:] = torch.tensor(
        [draft_tokens * (p + draft_tokens) for p in prefix_lens], device=dev
    ).cumsum(0)
    return dict(
        q=q,
        k=k,
        v=v,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        slots=slots,
        kv_indptr=kv_indptr,
        qo_indptr=qo_indptr,
        draft_mask=draft_mask,
        custom_mask=full,
        mask_indptr=mask_indptr,
    )


def reference(x, prefix_lens, draft_tokens, sm_scale):
    """Plain attention per request and head over [prefix, draft block] under the mask."""
    heads, kv_heads = x["q"].shape[1], x["k"].shape[1]
    out = torch.empty_like(x["q"])
    for b, p in enumerate(prefix_lens):
        start = int(x["kv_indptr"][b])
        slots = x["slots"][start : start + p]
        rows = slice(b * draft_tokens, (b + 1) * draft_tokens)
        keys = torch.cat([x["k_buffer"][slots], x["k"][rows]]).float()
        values = torch.cat([x["v_buffer"][slots], x["v"][rows]]).float()
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", x["q"][rows].float(), keys) * sm_scale
        visible = torch.cat(
            [
                torch.ones(draft_tokens, p, dtype=torch.bool, device="cuda"),
                x["draft_mask"][b],
            ],
            dim=1,
        )
        scores = scores.masked_fill(~visible, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(
            out.dtype
        )
    return out


def run_kernel(x, draft_tokens):
    from sglang.srt.layers.attention.triton_ops.extend_attention import (
        extend_attention_fwd,
    )

    out = torch.empty_like(x["q"])
    extend_attention_fwd(
        x["q"],
        x["k"],
        x["v"],
        out,
        x["k_buffer"],
        x["v_buffer"],
        x["qo_indptr"],
        x["kv_indptr"],
        x["slots"].to(torch.int64),
        x["custom_mask"],
        True,
        x["mask_indptr"],
        draft_tokens,
        1.0,
        1.0,
        sm_scale=x["q"].shape[-1] ** -0.5,
        skip_prefix_custom_mask=True,
    )
    return out


@pytest.mark.gpu
@pytest.mark.parametrize(
    "bs,prefix_lens,draft_tokens",
    [
        (1, [1], 2),  # bs 1, a one-token prefix
        (1, [300], 32),
        (8, [5, 64, 65, 1, 200, 128, 17, 3], 4),
        (48, None, 8),
        (64, None, 2),
    ],
)
def test_short_tiles_match_plain_attention(bs, prefix_lens, draft_tokens, monkeypatch):
    prefix_lens = prefix_lens or [50 + 7 * b for b in range(bs)]
    x = verify_inputs(bs, prefix_lens, draft_tokens, 32, 8, 128, seed=bs)
    expected = reference(x, prefix_lens, draft_tokens, 128**-0.5)
    # Below 256 (request, head) pairs the split prefix would serve both: compare the tiles.
    monkeypatch.setattr(triton_split_prefix, "_ENABLED", False)
    monkeypatch.setattr(triton_short_extend, "_ENABLED", True)
    short = run_kernel(x, draft_tokens)
    torch.testing.assert_close(short, expected, atol=2e-2, rtol=2e-2)
    # Upstream's tile computes the same attention: the choice changes the work, not the result.
    monkeypatch.setattr(triton_short_extend, "_ENABLED", False)
    upstream = run_kernel(x, draft_tokens)
    torch.testing.assert_close(short, upstream, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "spec",
    [eng.SpecConfig(1, 3, 4), eng.SpecConfig(16, 3, 32)],
    ids=lambda s: s.label,
)
def test_servers_with_short_tiles_stay_token_identical(
    small_pair, spec, monkeypatch, record_metric
):
    """Spec v2 with the short tile on (the engine's processes read the variable at start-up)
    at batch sizes where it applies, CUDA graphs on: identical to the table (no-spec).
    """
    from sglang.srt.layers.attention.triton_short_extend import MIN_PROGRAMS

    target, draft = small_pair
    heads = synth.load_meta(target)["spec"]["num_heads"]
    batch_sizes = (48, 64)
    assert min(batch_sizes) * heads >= MIN_PROGRAMS, "the tile would not apply"
    monkeypatch.delenv("SGLANG_TRITON_SHORT_EXTEND_TILE", raising=False)  # the default
    accept = eng.spec_v2_identical_by_batch_size(
        target, draft, spec, batch_sizes, seed=5
    )
    record_metric("accept_length_by_bs", accept)
    assert all(a > 1.0 for a in accept.values()), accept
