"""layers/attention/fa3_tree_expand.py: which FA3 cascade calls it serves, its reference against
one softmax over the prefix and the visible draft tokens, its kernel against the reference
(fa3_tree_expand_cases.py: on CPU through triton's interpreter, and on CUDA), and on CUDA
against what it replaces, FA3's expand pass and merge_state_v2."""

from __future__ import annotations

from pathlib import Path

import fa3_tree_expand_cases as cases
import pytest
import torch

from sglang.srt.layers.attention import fa3_tree_expand as fte
from specpatch.testing import engine as eng
from specpatch.testing.interpret import interpreter_suite
from specpatch.testing.sm90_compile import launches_compile_for_sm90

HERE = Path(__file__).resolve().parent
NAMES = [f"test_kernel_matches_reference[{c.name}]" for c in cases.CASES]

# The kernel's key loop is bounded by a count it loads, which the interpreter reads as a
# one-element array: numpy >= 2.5 refuses that.
interpreter_run, test_under_interpreter = interpreter_suite(
    HERE / "fa3_tree_expand_cases.py", NAMES, strict_numpy=False
)

BF16 = torch.empty(0, dtype=torch.bfloat16)
SERVED = dict(
    logit_cap=0.0,
    window_size=(-1, -1),
    k_descale=None,
    extra_kwargs={},
    fa_impl_ver=3,
)


def test_on_unless_the_env_says_0():
    assert fte.enabled_by_env({})
    assert fte.enabled_by_env({"SGLANG_FA3_TREE_EXPAND": "1"})
    assert not fte.enabled_by_env({"SGLANG_FA3_TREE_EXPAND": "0"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_serves_plain_bf16_and_fp16_caches(dtype):
    x = torch.empty(0, dtype=dtype)
    assert fte.serves(x, x, **SERVED)


@pytest.mark.parametrize(
    "what,change",
    [
        ("fp8 KV", dict(key_cache=torch.empty(0, dtype=torch.float8_e4m3fn))),
        ("fp8 query", dict(q=torch.empty(0, dtype=torch.float8_e4m3fn))),
        ("KV scales", dict(k_descale=torch.ones(1, 1))),
        ("logit soft-cap", dict(logit_cap=30.0)),
        ("sliding window", dict(window_size=(4096, 0))),
        ("attention sinks", dict(extra_kwargs={"sinks": torch.zeros(4)})),
        ("FA4", dict(fa_impl_ver=4)),
    ],
)
def test_leaves_to_fa3_what_it_does_not_compute(what, change):
    args = {"q": BF16, "key_cache": BF16, **SERVED, **change}
    assert not fte.serves(**args), what


def test_leaves_everything_to_fa3_when_switched_off(monkeypatch):
    monkeypatch.setattr(fte, "_ENABLED", False)
    assert not fte.serves(BF16, BF16, **SERVED)


@pytest.mark.parametrize("case", cases.CASES[:3], ids=[c.name for c in cases.CASES[:3]])
def test_reference_is_one_softmax_over_prefix_and_visible_draft_tokens(case):
    """The cascade's contract: the prefix pass (output and natural-log LSE) merged with the
    visible draft tokens is attention over both at once."""
    x = cases.make_inputs(case, "cpu", torch.float64, seed=3)
    gen = torch.Generator().manual_seed(4)
    rows, heads, dim = x["q"].shape
    prefix_len = 7
    group = heads // case.kv_heads
    prefix_k = torch.randn(
        rows, prefix_len, heads, dim, generator=gen, dtype=torch.float64
    )
    prefix_v = torch.randn(
        rows, prefix_len, heads, dim, generator=gen, dtype=torch.float64
    )
    scores = torch.einsum("rhd,rphd->rhp", x["q"], prefix_k) * x["sm_scale"]
    prefix_out = torch.einsum("rhp,rphd->rhd", scores.softmax(-1), prefix_v)
    prefix_lse = scores.logsumexp(-1).T.contiguous()  # [heads, rows], as FA3 returns it

    merged = fte.attend_and_merge_reference(
        **{**x, "out": prefix_out.clone(), "lse": prefix_lse}
    )

    k_slots = x["key_cache"].reshape(-1, case.kv_heads, dim)
    v_slots = x["value_cache"].reshape(-1, case.kv_heads, dim)
    for r in range(rows):
        slots = x["page_table"][r, : int(x["num_visible"][r])].long()
        keys = torch.cat([prefix_k[r], k_slots[slots].repeat_interleave(group, 1)])
        values = torch.cat([prefix_v[r], v_slots[slots].repeat_interleave(group, 1)])
        s = torch.einsum("hd,khd->hk", x["q"][r], keys) * x["sm_scale"]
        expected = torch.einsum("hk,khd->hd", s.softmax(-1), values)
        torch.testing.assert_close(merged[r], expected)


def test_kernel_compiles_for_sm90():
    """Triton's compiler, which the interpreter does not run, takes the FA3 backend's types
    (bf16 query, output and cache, int32 page table and counts, fp32 LSE)."""
    x = cases.make_inputs(cases.CASES[0], "cpu", torch.bfloat16)
    with launches_compile_for_sm90() as compiled:
        fte.attend_and_merge(**x)
    assert compiled == ["_attend_and_merge_kernel"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases.CASES, ids=[c.name for c in cases.CASES])
def test_kernel_matches_reference_on_cuda(case):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cases.check(case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "bs,draft_tokens,shape", [(1, 32, "tree"), (16, 32, "tree"), (4, 8, "chain")]
)
def test_matches_fa3s_expand_pass_and_merge(bs, draft_tokens, shape):
    """What the FA3 backend ran before: FA3 over each row's visible slots (pages of one
    token), then merge_state_v2 over transposed LSEs. Llama-3-8B's heads (32 / 8, dim 128).
    """
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if eng.fa3_unavailable() is not None:
        pytest.skip(str(eng.fa3_unavailable()))
    from sgl_kernel import merge_state_v2
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    case = cases.Case("fa3", bs, draft_tokens, 32, 8, 128, shape)
    x = cases.make_inputs(case, "cuda", torch.bfloat16, seed=bs)
    rows = bs * draft_tokens
    lens = x["num_visible"]
    o_expand, lse_expand, *_ = flash_attn_with_kvcache(
        q=x["q"],
        k_cache=x["key_cache"].view(-1, 1, 8, 128),
        v_cache=x["value_cache"].view(-1, 1, 8, 128),
        page_table=x["page_table"],
        cache_seqlens=lens,
        cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device="cuda"),
        cu_seqlens_k_new=torch.nn.functional.pad(
            lens.cumsum(0, dtype=torch.int32), (1, 0)
        ),
        max_seqlen_q=1,
        softmax_scale=x["sm_scale"],
        causal=False,
        return_softmax_lse=True,
    )
    fa3, _ = merge_state_v2(
        x["out"], x["lse"].T.contiguous(), o_expand, lse_expand.T.contiguous()
    )
    ours = fte.attend_and_merge(**{**x, "out": x["out"].clone()})
    torch.testing.assert_close(ours, fa3, atol=2e-2, rtol=2e-2)
