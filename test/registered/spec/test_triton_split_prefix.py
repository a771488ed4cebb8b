"""layers/attention/triton_split_prefix.py: when the split-prefix launch serves an extend (CPU),
its kernels against the plain-torch reference (split_prefix_cases.py: on CPU through triton's
interpreter, and on CUDA), and on CUDA against upstream's extend kernel on the same inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import split_prefix_cases
import torch

from sglang.srt.layers.attention import triton_split_prefix as sp
from specpatch.testing import engine as eng
from specpatch.testing import synth
from specpatch.testing.interpret import interpreter_suite
from specpatch.testing.sm90_compile import launches_compile_for_sm90
from specpatch.testing.triton_keys import specialisation

HERE = Path(__file__).resolve().parent
NAMES = [
    f"test_kernel_matches_reference[{c.name}]" for c in split_prefix_cases.CASES
] + [
    f"test_splits_without_keys_are_not_read[{c.name}]"
    for c in split_prefix_cases.EMPTY_SPLIT_CASES
]

# The partial kernel's prefix loop has device bounds, which the interpreter reads as one-element
# arrays: numpy >= 2.5 refuses that (upstream's extend kernel does the same).
interpreter_run, test_under_interpreter = interpreter_suite(
    HERE / "split_prefix_cases.py", NAMES, strict_numpy=False
)


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setattr(sp, "_ENABLED", True)


def test_on_unless_the_env_says_0(monkeypatch):
    assert sp.enabled_by_env({})
    assert sp.enabled_by_env({"SGLANG_TRITON_SPLIT_PREFIX_EXTEND": "1"})
    assert not sp.enabled_by_env({"SGLANG_TRITON_SPLIT_PREFIX_EXTEND": "0"})
    monkeypatch.setattr(sp, "_ENABLED", False)
    assert sp.plan_split_prefix(4, 1, 32, 8, 128, 128) is None


def test_the_plan_packs_the_gqa_group_and_splits_towards_one_program_per_sm(enabled):
    # bs 1 of a 32/8-head model, chain 1,3,4: 4 heads x 4 rows in a 16-row tile, 8 KV heads
    # x 16 splits = 128 partial programs.
    assert sp.plan_split_prefix(4, 1, 32, 8, 128, 128) == sp.SplitPlan(4, 4, 16, 16)
    # tree 16,3,32: 4 x 32 = 128 rows, on eight warps; bs 4 -> 32 (request, KV head)
    # pairs x 4 splits.
    assert sp.plan_split_prefix(32, 4, 32, 8, 128, 128) == sp.SplitPlan(
        4, 32, 128, 4, 8
    )
    # Uneven lengths round up; a group of 3 pads its tile.
    assert sp.plan_split_prefix(3, 2, 24, 8, 64, 64) == sp.SplitPlan(3, 4, 16, 8)
    # MHA: one head a tile, whose 16 rows every extend up to 16 rows shares.
    assert sp.plan_split_prefix(1, 1, 4, 4, 16, 16) == sp.SplitPlan(1, 16, 16, 16)


def test_large_batches_take_the_gqa_tile_with_one_split(enabled):
    """Where the batch alone fills the GPU (bs 48 of a 32 / 8-head model: 384 (request, KV
    head) programs), one split: the gain is the GQA group's heads sharing each K/V block, which
    triton_short_extend's tile reads once per query head."""
    assert sp.plan_split_prefix(32, 48, 32, 8, 128, 128) == sp.SplitPlan(
        4, 32, 128, 1, 8
    )
    assert sp.plan_split_prefix(4, 64, 32, 8, 128, 128) == sp.SplitPlan(4, 4, 16, 1)
    # bs 8 of that model: 64 programs, two splits.
    assert sp.plan_split_prefix(4, 8, 32, 8, 128, 128).num_splits == 2


@pytest.mark.parametrize(
    "group,rows", [(1, 16), (2, 8), (3, 4), (4, 4), (6, 2), (8, 2), (16, 1), (32, 1)]
)
def test_short_extends_share_the_rows_a_16_row_tile_holds(enabled, group, rows):
    """Extends of 1 .. rows tokens (a prefill that extends a cached prefix by a token or
    two, a chain's verify) get one Q_ROWS, hence one compile, and the tile they had."""
    assert sp.min_q_rows(group) == rows
    plans = {
        sp.plan_split_prefix(n, 1, group * 2, 2, 64, 64) for n in range(1, rows + 1)
    }
    assert {(p.q_rows, p.tile_rows) for p in plans} == {(rows, max(16, group * rows))}
    longer = sp.plan_split_prefix(rows * 2, 1, group * 2, 2, 64, 64)
    assert longer is None or longer.q_rows == rows * 2


def test_the_split_count_is_a_runtime_argument_of_one_compile():
    """Batch sizes pick 1-16 splits; the partial kernel's Triton specialisation key is the
    same for all of them (one compile), while a constexpr (Q_ROWS) still tells variants
    apart."""

    def key(num_splits, q_rows=4):
        return specialisation(
            sp._partial_kernel,
            torch.zeros(4),
            num_splits=num_splits,
            GROUP=4,
            Q_ROWS=q_rows,
            TILE_ROWS=16,
            BLOCK_N=32,
            D=128,
            USE_CUSTOM_MASK=False,
            IS_CAUSAL=True,
        )

    assert len({key(n) for n in (1, 2, 4, 8, 16)}) == 1
    assert key(4, q_rows=4) != key(4, q_rows=8)


@pytest.mark.parametrize(
    "args,why",
    [
        ((64, 1, 32, 8, 128, 128), "4 x 64 rows do not fit one tile"),
        ((torch.tensor(4), 1, 32, 8, 128, 128), "a length on the device"),
        ((0, 1, 32, 8, 128, 128), "nothing to extend"),
        ((4, 1, 32, 8, 192, 128), "MLA-style split head dims"),
        ((4, 1, 32, 8, 96, 96), "a head dim that is not a power of two"),
    ],
)
def test_upstream_serves_what_the_plan_does_not_cover(enabled, args, why):
    assert sp.plan_split_prefix(*args) is None, why


def test_only_plain_attention_over_a_visible_prefix_is_split(enabled):
    mask = torch.ones(4, dtype=torch.bool)
    plain = dict(
        logit_cap=0.0,
        sinks=None,
        sliding_window_size=-1,
        xai_temperature_len=-1,
        custom_mask=mask,
        skip_prefix_custom_mask=True,
    )
    assert sp.plain_extend(**plain)
    assert sp.plain_extend(
        **{**plain, "custom_mask": None, "skip_prefix_custom_mask": False}
    )
    for key, value in [
        ("logit_cap", 30.0),
        ("sinks", torch.zeros(32)),
        ("sliding_window_size", 4096),
        ("xai_temperature_len", 1024),
        ("skip_prefix_custom_mask", False),
    ]:
        assert not sp.plain_extend(**{**plain, key: value}), key
    assert sp.plan_split_prefix(4, 1, 32, 8, 128, 128, plain=False) is None


# The server's KV cache in bf16 for every case; in fp8 where the head dim allows it (triton's
# fp8 dot needs 32 or more, upstream's extend kernel has the same limit), and at the
# Llama-3-8B shape, with the wide tree's full 128-row tile on eight warps.
LLAMA_VERIFY = split_prefix_cases.Case(
    "llama8b_tree4", (256,), (4,), 32, 8, 128, "tree"
)
LLAMA_WIDE_TREE = split_prefix_cases.Case(
    "llama8b_tree32", (256,), (32,), 32, 8, 128, "tree"
)
COMPILE_CASES = [
    (c, torch.bfloat16) for c in [*split_prefix_cases.CASES, LLAMA_WIDE_TREE]
] + [
    (c, torch.float8_e4m3fn)
    for c in [*split_prefix_cases.CASES, LLAMA_VERIFY, LLAMA_WIDE_TREE]
    if c.dim >= 32
]


@pytest.mark.parametrize(
    "case,kv_cache",
    COMPILE_CASES,
    ids=[f"{c.name}-{str(t).removeprefix('torch.')}" for c, t in COMPILE_CASES],
)
def test_the_kernels_compile_for_sm90_with_the_servers_types(case, kv_cache):
    """The interpreter runs the kernels' arithmetic, not triton's compiler, which refused a
    first version on the GPU host (int64 query and int32 prefix offsets merged across an
    `if`). The cases carry the triton backend's index dtypes; the KV cache is bf16 or fp8.
    """
    x = split_prefix_cases.make_inputs(case, "cpu", torch.bfloat16)
    x["k_buffer"], x["v_buffer"] = (x[k].to(kv_cache) for k in ("k_buffer", "v_buffer"))
    with launches_compile_for_sm90() as compiled:
        sp.split_prefix_extend_attention(
            split_prefix_cases.plan_for(case),
            o_extend=torch.empty_like(x["q_extend"]),
            **x,
        )
    assert compiled == ["_partial_kernel", "_merge_kernel"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", split_prefix_cases.CASES, ids=[c.name for c in split_prefix_cases.CASES]
)
def test_kernel_matches_reference_on_cuda(case):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    split_prefix_cases.check(case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("prefix,rows", [(256, 4), (1024, 32), (3000, 2)])
def test_matches_upstreams_extend_kernel_on_a_verify(prefix, rows):
    """The Llama-3-8B shape (32 / 8 heads, dim 128) at bs 1, tree mask: the same attention
    as upstream's kernel, to bf16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    case = split_prefix_cases.Case("verify", (prefix,), (rows,), 32, 8, 128, "tree")
    x = split_prefix_cases.make_inputs(case, "cuda", torch.bfloat16, seed=prefix)
    ours = torch.empty_like(x["q_extend"])
    sp.split_prefix_extend_attention(
        split_prefix_cases.plan_for(case), o_extend=ours, **x
    )
    upstream = split_prefix_cases.upstream_extend(x, torch.empty_like(ours))
    torch.testing.assert_close(ours, upstream, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "spec",
    [eng.SpecConfig(1, 3, 4), eng.SpecConfig(16, 3, 32)],
    ids=lambda s: s.label,
)
def test_servers_with_split_prefixes_stay_token_identical(
    small_pair, spec, monkeypatch, record_metric
):
    """Spec v2 with the split prefix on (the engine's processes read the variable at
    start-up) at batch sizes where it applies, CUDA graphs on: identical to the table.
    """
    target, draft = small_pair
    heads = synth.load_meta(target)["spec"]["num_heads"]
    batch_sizes = (1, 4, 24)
    monkeypatch.setenv("SGLANG_TRITON_SPLIT_PREFIX_EXTEND", "1")
    accept = eng.spec_v2_identical_by_batch_size(
        target, draft, spec, batch_sizes, seed=7
    )
    record_metric("accept_length_by_bs", accept)
    assert all(a > 1.0 for a in accept.values()), accept
