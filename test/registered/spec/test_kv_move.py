"""KV-cache row moves (spec v2 tree drafting) for every pool kind, against a plain reference.

A move means: afterwards slot tgt[i] holds what slot src[i] held before the call. The reference
applies the moves one by one from a snapshot taken before any of them, so overlapping moves (a
slot that is one move's source and another's target) have exactly one right answer.

kv_move's functions are tested directly. The pools' move_kv_cache methods come from the
spec-kv-moves-for-all-pools patch
(memory_pool.py) and must be in the installed build: a missing method fails, it never skips.
Every pool here is the real class built with device="cpu" (all of them construct on CPU).
MHA's tiled Triton copy kernel cannot run on CPU, so the CPU tests cover MHA's torch path
(SGLANG_NATIVE_MOVE_KV_CACHE=1, and pools built without the kernel); the `gpu` tests at the end
run the kernel, MLA and NSA on CUDA.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention.nsa import index_buf_accessor
from sglang.srt.mem_cache import kv_move
from sglang.srt.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MHATokenToKVPoolFP4,
    MLATokenToKVPool,
    MLATokenToKVPoolFP4,
    NSATokenToKVPool,
)
from specpatch.testing.sm90_compile import launches_compile_for_sm90

NATIVE_ENV = "SGLANG_NATIVE_MOVE_KV_CACHE"
NSA_PAGE = 64  # NSATokenToKVPool asserts page_size == 64 off ROCm

# name -> (tgt, src); every slot < 40, so they fit every pool below.
CASES = {
    # Accepted-path compaction: the path [root, node 3, node 5] moves to the block's front.
    "compaction": ([10, 11, 12], [10, 13, 15]),
    # Path [root, 2, 3, 4]: each source is the next move's target.
    "chain_forward": ([20, 21, 22, 23], [20, 22, 23, 24]),
    # Each source is the previous move's target.
    "chain_backward": ([24, 23, 22], [23, 22, 21]),
    "swap": ([5, 6], [6, 5]),
    "bs1_single": ([7], [9]),
    # Two requests' blocks of 6 draft tokens (slots scattered like the allocator leaves them).
    "two_requests": ([30, 31, 32, 3, 4], [30, 33, 35, 3, 8]),
    "padding_slot_0": ([0, 1], [1, 0]),
}


def as_loc(values, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def random_case(num_slots: int, n: int, seed: int, device="cpu"):
    """Distinct targets; sources drawn from all slots, so many are also targets."""
    gen = torch.Generator().manual_seed(seed)
    tgt = torch.randperm(num_slots, generator=gen)[:n]
    src = torch.randint(0, num_slots, (n,), generator=gen)
    return tgt.to(device), src.to(device)


def fill_random_bytes(buffers, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in buffers:
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def reference_rows(buffers, tgt: torch.Tensor, src: torch.Tensor):
    before = [b.clone() for b in buffers]
    after = [b.clone() for b in buffers]
    for t, s in zip(tgt.tolist(), src.tolist()):
        for a, b in zip(after, before):
            a[t] = b[s]
    return after


def assert_same_bytes(actual, expected) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        # Bytes, not values: random bf16 bytes include NaNs.
        assert torch.equal(
            a.view(torch.uint8), e.view(torch.uint8)
        ), f"buffer {i} differs"


# --- NSA indexer tokens, read through the pool's own accessor ---------------------------------


def index_tokens(pool, buf: torch.Tensor):
    """Every token's (K bytes, scale bytes) via index_buf_accessor's reference getters."""
    num_pages = buf.shape[0]
    pages = torch.arange(num_pages, device=buf.device)
    seq_len = num_pages * pool.page_size
    k = index_buf_accessor.GetK.slow(pool, buf, seq_len=seq_len, page_indices=pages)
    s = index_buf_accessor.GetS.slow(pool, buf, seq_len=seq_len, page_indices=pages)
    return k.clone(), s.clone()


def accessor_pool(page_size: int, device="cpu"):
    """What GetK/GetS.slow read from a pool: its layout parameters."""
    return SimpleNamespace(
        page_size=page_size, index_head_dim=128, quant_block_size=128, device=device
    )


def indexer_buffer(num_pages: int, page_size: int, device="cpu") -> torch.Tensor:
    buf = torch.empty(
        num_pages, page_size * (128 + 4), dtype=torch.uint8, device=device
    )
    fill_random_bytes([buf], seed=num_pages * 1000 + page_size)
    return buf


# --- pools ------------------------------------------------------------------------------------


def make_mha(device="cpu", layer_num=2, size=64, page_size=1, **kw):
    return MHATokenToKVPool(
        size,
        page_size,
        torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=layer_num,
        device=device,
        enable_memory_saver=False,
        enable_alt_stream=False,
        **kw,
    )


def make_mha_fp4(device="cpu", layer_num=2, size=64, page_size=1, **kw):
    return MHATokenToKVPoolFP4(
        size,
        page_size,
        torch.float4_e2m1fn_x2,
        head_num=2,
        head_dim=32,
        layer_num=layer_num,
        device=device,
        enable_memory_saver=False,
        enable_alt_stream=False,
        **kw,
    )


def make_mla(device="cpu", layer_num=2, size=64, page_size=1):
    return MLATokenToKVPool(
        size,
        page_size,
        torch.bfloat16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=layer_num,
        device=device,
        enable_memory_saver=False,
    )


def make_mla_fp4(device="cpu", layer_num=2, size=64, page_size=1):
    return MLATokenToKVPoolFP4(
        size,
        page_size,
        torch.float4_e2m1fn_x2,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        layer_num=layer_num,
        device=device,
        enable_memory_saver=False,
    )


def make_nsa(device="cpu", layer_num=2, size=128):
    return NSATokenToKVPool(
        size,
        NSA_PAGE,
        kv_lora_rank=16,
        dtype=torch.bfloat16,
        qk_rope_head_dim=8,
        layer_num=layer_num,
        device=device,
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=16 + 8,
    )


def row_buffers(pool):
    """Every buffer indexed by token slot on dim 0 (the NSA indexer is checked separately)."""
    if isinstance(pool, MHATokenToKVPool):
        return [
            *pool.k_buffer,
            *pool.v_buffer,
            *getattr(pool, "k_scale_buffer", []),
            *getattr(pool, "v_scale_buffer", []),
        ]
    return [*pool.kv_buffer, *getattr(pool, "kv_scale_buffer", [])]


def check_pool_move(pool, tgt: torch.Tensor, src: torch.Tensor) -> None:
    """pool.move_kv_cache against the reference, on every buffer it owns."""
    rows = row_buffers(pool)
    fill_random_bytes(rows, seed=1)
    expected = reference_rows(rows, tgt, src)
    indexers = getattr(pool, "index_k_with_scale_buffer", [])
    fill_random_bytes(indexers, seed=2)
    expected_index = [
        reference_rows(index_tokens(pool, buf), tgt, src) for buf in indexers
    ]

    pool.move_kv_cache(tgt, src)

    assert_same_bytes(rows, expected)
    for buf, exp in zip(indexers, expected_index):
        assert_same_bytes(list(index_tokens(pool, buf)), exp)


def snapshot(pool):
    return [
        b.clone()
        for b in row_buffers(pool) + getattr(pool, "index_k_with_scale_buffer", [])
    ]


POOLS = {
    "mha_native": make_mha,
    "mha_fp4": make_mha_fp4,
    "mla": make_mla,
    "mla_fp4": make_mla_fp4,
    "nsa": make_nsa,
}


# =============================================================================================
# kv_move functions
# =============================================================================================


def test_check_slots_in_range_passes_valid_and_empty():
    kv_move.check_slots_in_range(as_loc([0, 5, 9]), 10, "x")
    kv_move.check_slots_in_range(as_loc([]), 0, "x")
    kv_move.check_slots_in_range(torch.tensor([3], dtype=torch.int32), 4, "x")


@pytest.mark.parametrize("bad", [-1, 10, 11, -100])
def test_check_slots_in_range_raises_on_cpu(bad):
    with pytest.raises(IndexError) as err:
        kv_move.check_slots_in_range(as_loc([1, bad, 2]), 10, "MyPool tgt_loc")
    msg = str(err.value)
    assert "MyPool tgt_loc" in msg and f"slot {bad}" in msg and "[0, 10)" in msg


@pytest.mark.parametrize("side", ["tgt", "src"])
def test_check_move_in_range_names_the_bad_side_on_cpu(side):
    good, bad = as_loc([1, 2, 3]), as_loc([1, 10, 3])
    tgt, src = (bad, good) if side == "tgt" else (good, bad)
    with pytest.raises(IndexError, match=f"MyPool.move_kv_cache {side}_loc: slot 10"):
        kv_move.check_move_in_range(tgt, src, 10, "MyPool.move_kv_cache")
    kv_move.check_move_in_range(good, good, 10, "MyPool.move_kv_cache")


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_the_slot_check_kernel_compiles_for_sm90(slot_dtype):
    """What CUDA moves launch (the CPU path above checks in torch), through triton's
    compiler, which the interpreter does not run; debug=True keeps its device assert."""
    tgt, src = torch.tensor([3, 9], dtype=slot_dtype), torch.tensor([0, 8])
    with launches_compile_for_sm90() as compiled:
        kv_move._launch_slot_check(tgt, src.to(slot_dtype), tgt.numel(), 10)
    assert compiled == ["_assert_slots_in_range_kernel"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_move_token_rows_cases(case):
    tgt, src = map(as_loc, CASES[case])
    buffers = [
        torch.empty(40, 2, 3, dtype=torch.bfloat16),
        torch.empty(40, 5, dtype=torch.uint8),
    ]
    fill_random_bytes(buffers)
    expected = reference_rows(buffers, tgt, src)
    kv_move.move_token_rows(buffers, tgt, src)
    assert_same_bytes(buffers, expected)


@pytest.mark.parametrize("seed", range(5))
def test_move_token_rows_random_overlapping(seed):
    tgt, src = random_case(50, 30, seed)
    assert set(src.tolist()) & set(tgt.tolist()), "the case should overlap"
    buffers = [torch.empty(50, 4, dtype=torch.float32)]
    fill_random_bytes(buffers, seed)
    expected = reference_rows(buffers, tgt, src)
    kv_move.move_token_rows(buffers, tgt.to(torch.int32), src.to(torch.int32))
    assert_same_bytes(buffers, expected)


def test_move_token_rows_empty_is_a_no_op():
    buffers = [torch.arange(12.0).view(6, 2)]
    kv_move.move_token_rows(buffers, as_loc([]), as_loc([]))
    assert torch.equal(buffers[0], torch.arange(12.0).view(6, 2))


@pytest.mark.parametrize("page_size", [1, 4, 64])
@pytest.mark.parametrize("case", sorted(CASES) + ["random"])
def test_move_paged_index_k_rows_matches_accessor(page_size, case):
    num_pages = -(-40 // page_size) + 1
    buf = indexer_buffer(num_pages, page_size)
    pool = accessor_pool(page_size)
    if case == "random":
        tgt, src = random_case(num_pages * page_size, 25, seed=page_size)
    else:
        tgt, src = map(as_loc, CASES[case])
    expected = reference_rows(index_tokens(pool, buf), tgt, src)

    kv_move.move_paged_index_k_rows(buf, page_size, 128, tgt, src)

    assert_same_bytes(list(index_tokens(pool, buf)), expected)


def test_move_paged_index_k_rows_agrees_with_setters():
    """Write tokens with the accessor's setters, move, and find them at their targets."""
    page_size, num_pages = 4, 6
    buf = torch.zeros(num_pages, page_size * 132, dtype=torch.uint8)
    pool = accessor_pool(page_size)
    slots = as_loc(range(num_pages * page_size))
    k = torch.randint(0, 256, (len(slots), 128), dtype=torch.uint8)
    s = torch.randint(0, 256, (len(slots), 4), dtype=torch.uint8)
    index_buf_accessor.SetK.slow(pool, buf, slots, k)
    index_buf_accessor.SetS.slow(pool, buf, slots, s)
    tgt, src = as_loc([1, 2, 3, 9]), as_loc([5, 1, 2, 22])

    kv_move.move_paged_index_k_rows(buf, page_size, 128, tgt, src)

    got_k, got_s = index_tokens(pool, buf)
    exp_k, exp_s = reference_rows([k, s], tgt, src)
    assert torch.equal(got_k, exp_k) and torch.equal(got_s, exp_s)


def test_move_paged_index_k_rows_rejects_a_foreign_layout():
    buf = torch.zeros(2, 4 * 128, dtype=torch.uint8)  # no room for scales
    with pytest.raises(ValueError):
        kv_move.move_paged_index_k_rows(buf, 4, 128, as_loc([1]), as_loc([2]))


# =============================================================================================
# Pool methods (patch spec-kv-moves-for-all-pools)
# =============================================================================================


@pytest.mark.parametrize(
    "cls",
    [
        MHATokenToKVPool,
        MHATokenToKVPoolFP4,
        MLATokenToKVPool,
        MLATokenToKVPoolFP4,
        NSATokenToKVPool,
    ],
)
def test_pool_has_move_kv_cache(cls):
    # No skip: CI installs the patched build, and a pool without the method is the bug itself.
    assert hasattr(
        cls, "move_kv_cache"
    ), f"{cls.__name__} has no move_kv_cache (patch spec-kv-moves-for-all-pools)"


@pytest.fixture
def native_move(monkeypatch):
    monkeypatch.setenv(NATIVE_ENV, "1")


@pytest.mark.parametrize("case", sorted(CASES) + ["random"])
@pytest.mark.parametrize("kind", sorted(POOLS))
def test_pool_move_cases(kind, case, native_move):
    pool = POOLS[kind]()
    if case == "random":
        tgt, src = random_case(pool.size + pool.page_size, 30, seed=len(kind))
    else:
        tgt, src = map(as_loc, CASES[case])
    check_pool_move(pool, tgt, src)


def test_mha_pool_without_copy_kernel_moves_with_torch(monkeypatch):
    # SWA / hybrid sub-pools are built without enable_kv_cache_copy; before 0004 they asserted.
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    pool = make_mha()
    assert pool._kv_copy_config is None
    check_pool_move(pool, *map(as_loc, CASES["chain_forward"]))


def test_mha_fp4_builds_with_kv_cache_copy_and_moves_scales(monkeypatch):
    # enable_kv_cache_copy is on whenever speculative decoding is; FP4 used to crash in init.
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    pool = make_mha_fp4(enable_kv_cache_copy=True)
    assert pool._kv_copy_config is None
    check_pool_move(pool, *map(as_loc, CASES["compaction"]))


def test_pool_move_with_paged_mha(native_move):
    pool = make_mha(size=64, page_size=16)
    check_pool_move(pool, *random_case(80, 40, seed=3))


def test_nsa_pool_move_random_over_all_pages():
    pool = make_nsa(size=256)
    check_pool_move(pool, *random_case(256 + NSA_PAGE, 100, seed=11))


@pytest.mark.parametrize("kind", sorted(POOLS))
def test_pool_empty_move_changes_nothing(kind, native_move):
    pool = POOLS[kind]()
    fill_random_bytes(
        row_buffers(pool) + getattr(pool, "index_k_with_scale_buffer", [])
    )
    before = snapshot(pool)
    pool.move_kv_cache(as_loc([]), as_loc([]))
    assert_same_bytes(snapshot(pool), before)


@pytest.mark.parametrize("kind", sorted(POOLS))
def test_zero_layer_pool_returns_at_once(kind, monkeypatch):
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    kwargs = {"enable_kv_cache_copy": True} if kind.startswith("mha") else {}
    pool = POOLS[kind](layer_num=0, **kwargs)
    assert row_buffers(pool) == []
    pool.move_kv_cache(as_loc([1, 2]), as_loc([3, 4]))
    # No buffers, so not even the slots are looked at.
    pool.move_kv_cache(as_loc([-1]), as_loc([10**6]))


@pytest.mark.parametrize("which", ["tgt", "src"])
@pytest.mark.parametrize("offset", ["negative", "past_end", "far_past_end"])
@pytest.mark.parametrize("kind", sorted(POOLS))
def test_pool_out_of_range_slot_raises_and_moves_nothing(
    kind, which, offset, native_move
):
    pool = POOLS[kind]()
    num_slots = pool.size + pool.page_size
    bad = {"negative": -1, "past_end": num_slots, "far_past_end": num_slots + 1000}[
        offset
    ]
    good = as_loc([3, 4, 5])
    broken = as_loc([6, bad, 7])
    tgt, src = (broken, good) if which == "tgt" else (good, broken)
    fill_random_bytes(
        row_buffers(pool) + getattr(pool, "index_k_with_scale_buffer", [])
    )
    before = snapshot(pool)

    with pytest.raises(IndexError) as err:
        pool.move_kv_cache(tgt, src)

    msg = str(err.value)
    assert f"{which}_loc" in msg and f"slot {bad}" in msg and f"[0, {num_slots})" in msg
    assert_same_bytes(snapshot(pool), before)


def test_nsa_slot_must_fit_the_indexer_cache_too():
    # size 100 is not a page multiple: kv_buffer has 164 rows, the indexer 2 pages (128 tokens).
    pool = make_nsa(size=100)
    check_pool_move(pool, as_loc([127]), as_loc([1]))
    with pytest.raises(IndexError, match=r"\[0, 128\)"):
        pool.move_kv_cache(as_loc([150]), as_loc([1]))


def test_pool_move_rejects_mismatched_lengths(native_move):
    with pytest.raises(ValueError):
        make_mla().move_kv_cache(as_loc([1, 2]), as_loc([3]))


def test_swa_pool_of_only_swa_layers_moves_through_both_sub_pools():
    """SWAKVPool delegates: its full sub-pool has no layers, its SWA sub-pool has no kernel."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(
        size=32,
        size_swa=48,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        swa_attention_layer_ids=[0, 1],
        full_attention_layer_ids=[],
        enable_kvcache_transpose=False,
        device="cpu",
        enable_alt_stream=False,
    )
    assert pool.full_kv_pool.layer_num == 0
    # full slot i lives at SWA slot 40 - i (the last entry is the allocator's -1 sentinel).
    pool.register_mapping(torch.cat([40 - torch.arange(33), as_loc([-1])]))
    swa = pool.swa_kv_pool
    rows = row_buffers(swa)
    fill_random_bytes(rows)
    tgt, src = as_loc([10, 11, 12]), as_loc([10, 13, 15])
    expected = reference_rows(rows, 40 - tgt, 40 - src)

    pool.move_kv_cache(tgt, src)

    assert_same_bytes(rows, expected)


def test_hisparse_nsa_pool_refuses_moves():
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseNSATokenToKVPool

    pool = HiSparseNSATokenToKVPool(
        128,
        NSA_PAGE,
        kv_lora_rank=16,
        dtype=torch.bfloat16,
        qk_rope_head_dim=8,
        layer_num=1,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=24,
    )
    with pytest.raises(NotImplementedError, match="HiSparse"):
        pool.move_kv_cache(as_loc([1]), as_loc([2]))


# =============================================================================================
# GPU: MHA's tiled Triton kernel, MLA and NSA on CUDA
# =============================================================================================


def compaction_case(bs: int, num_draft_tokens: int, max_accept: int, seed: int, device):
    """Accepted-path moves of `bs` requests over scattered verify slots, as tree_compaction
    builds them: rows that do not move copy onto themselves."""
    gen = torch.Generator().manual_seed(seed)
    slots = (
        torch.randperm(bs * num_draft_tokens + 50, generator=gen)[
            : bs * num_draft_tokens
        ]
        + 1
    )
    tgt, src = [], []
    for b in range(bs):
        block = slots[b * num_draft_tokens : (b + 1) * num_draft_tokens].tolist()
        n = int(torch.randint(1, max_accept + 1, (1,), generator=gen))
        later = sorted(
            torch.randperm(num_draft_tokens - 1, generator=gen)[: n - 1].add(1).tolist()
        )
        path = [0] + later + list(range(n, max_accept))  # identity moves past the path
        tgt += block[:max_accept]
        src += [block[j] for j in path[:n]] + block[n:max_accept]
    return as_loc(tgt, device), as_loc(src, device)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", sorted(CASES) + ["random", "compaction_bs8", "compaction_bs96"]
)
def test_gpu_mha_triton_kernel(case, monkeypatch):
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    pool = MHATokenToKVPool(
        2048,
        1,
        torch.bfloat16,
        head_num=4,
        head_dim=64,
        layer_num=3,
        device="cuda",
        enable_memory_saver=False,
        enable_kv_cache_copy=True,
    )
    assert pool._kv_copy_config is not None
    if case == "random":
        tgt, src = random_case(2049, 100, seed=5, device="cuda")
    elif case.startswith("compaction_bs"):
        # bs 96 x 5 moves passes the kernel's chunk size (128 / 256 moves per launch).
        tgt, src = compaction_case(
            int(case.removeprefix("compaction_bs")), 16, 5, 0, "cuda"
        )
    else:
        tgt, src = (as_loc(x, "cuda") for x in CASES[case])
    check_pool_move(pool, tgt, src)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES) + ["random", "compaction_bs96"])
@pytest.mark.parametrize("kind", ["mla", "nsa"])
def test_gpu_mla_and_nsa_moves(kind, case):
    pool = make_mla("cuda", size=2048) if kind == "mla" else make_nsa("cuda", size=2048)
    if case == "random":
        tgt, src = random_case(2048, 100, seed=6, device="cuda")
    elif case == "compaction_bs96":
        tgt, src = compaction_case(96, 16, 5, 1, "cuda")
    else:
        tgt, src = (as_loc(x, "cuda") for x in CASES[case])
    check_pool_move(pool, tgt, src)
    torch.cuda.synchronize()


BAD_SLOT_CALLS = {
    "slots": "kv_move.check_slots_in_range(torch.tensor([3, {bad}], device='cuda'), 10, 'Pool tgt_loc')",
    "move-tgt": "kv_move.check_move_in_range(torch.tensor([3, {bad}], device='cuda'), "
    "torch.tensor([1, 2], device='cuda'), 10, 'Pool.move_kv_cache')",
    "move-src": "kv_move.check_move_in_range(torch.tensor([1, 2], device='cuda'), "
    "torch.tensor([{bad}, 3], device='cuda'), 10, 'Pool.move_kv_cache')",
}


@pytest.mark.gpu
@pytest.mark.parametrize("call", sorted(BAD_SLOT_CALLS))
@pytest.mark.parametrize("bad", [10, -1])
def test_gpu_out_of_range_slot_is_a_device_assert(bad, call):
    # A device assert poisons the CUDA context, so it runs in a child process.
    code = (
        textwrap.dedent(
            """
        import torch
        from sglang.srt.mem_cache import kv_move
        kv_move.check_slots_in_range(torch.tensor([3, 9], device="cuda"), 10, "ok")
        kv_move.check_move_in_range(torch.tensor([3, 9], device="cuda"), torch.tensor([0, 8], device="cuda"), 10, "ok")
        torch.cuda.synchronize()
        print("in-range passed", flush=True)
        """
        )
        + BAD_SLOT_CALLS[call].format(bad=bad)
        + textwrap.dedent(
            """
        torch.cuda.synchronize()
        print("NOT REACHED", flush=True)
        """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert "in-range passed" in proc.stdout, proc.stderr
    assert proc.returncode != 0 and "NOT REACHED" not in proc.stdout
    assert (
        "device-side assert" in proc.stderr or "outside the pool" in proc.stderr
    ), proc.stderr
